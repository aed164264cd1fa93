"""Fault classes of `jaxamp.low_precision_optimizer`'s state (docs/dev/fault-classes.md).

Two classes the scenario tests of tests/test_low_precision_optimizer.py let
through:

* state written back rounded to nearest instead of stochastically: a moving
  average that changes by less than half an ulp a step, Adam's ``nu`` with
  ``b2 = 0.999`` once its gradients stop, then never decays;
* a ``state_dtype`` mapping decided by the wrong field of a nested optax
  state: the innermost named field of a leaf's path must decide, and a
  leaf whose innermost field is not named falls back to the next one out.
"""

import jax
import jax.numpy as jnp
import optax
import pytest

import jaxamp

B2 = 0.999
WIDTH = 1000


def nu_after_the_gradients_stop(tx, quiet_steps):
    """One step of gradient 1 on `WIDTH` bfloat16 params, then `quiet_steps` of gradient 0: Adam's `nu`."""
    params = jnp.zeros((WIDTH,), jnp.bfloat16)

    def step(grads, opt_state):
        _, opt_state = tx.update(grads, opt_state, params)
        return opt_state

    @jax.jit
    def run(params):
        opt_state = step(jnp.ones_like(params), tx.init(params))
        return jax.lax.fori_loop(0, quiet_steps, lambda _, s: step(jnp.zeros_like(params), s), opt_state)

    return run(params).inner_state.nu.astype(jnp.float32)


@pytest.mark.parametrize("rounding", ["nearest", "stochastic", "kahan"])
def test_adams_second_moment_in_bfloat16_decays_by_b2_each_step_once_the_gradients_stop(rounding):
    """0.1% a step is below half a bfloat16 ulp (0.2% to 0.4%): rounded to nearest, nu would stay put.

    After one gradient of 1, nu is 1 - b2 = 0.001; 500 quiet steps later it
    is 0.001 * 0.999**500 = 6.06e-4 in float32. Stored stochastically, the
    mean over 1000 elements lands within 1% of it, whatever rounding lands
    the params (the state is rounded stochastically under every one).
    """
    tx = jaxamp.low_precision_optimizer(optax.scale_by_adam(b2=B2), rounding=rounding, key=3)
    nu = nu_after_the_gradients_stop(tx, quiet_steps=500)
    expected = (1 - B2) * B2**500
    assert float(nu.mean()) == pytest.approx(expected, rel=0.01)
    assert float(nu.max()) < 1 - B2  # every element decayed, none stuck where it started


def adam_state_dtypes(inner, state_dtype):
    """The dtypes Adam's mu and nu are stored in, inside `inner`, after init and after a jitted step."""
    params = {"kernel": jnp.ones((4, 4), jnp.bfloat16)}
    tx = jaxamp.low_precision_optimizer(inner, state_dtype=state_dtype)
    opt_state = tx.init(params)
    _, stepped = jax.jit(tx.update)(params, opt_state, params)
    found = []
    for state in (opt_state, stepped):
        adam = next(
            s for s in jax.tree.leaves(state.inner_state, is_leaf=lambda s: isinstance(s, optax.ScaleByAdamState))
            if isinstance(s, optax.ScaleByAdamState)
        )  # fmt: skip
        found.append((adam.mu["kernel"].dtype, adam.nu["kernel"].dtype))
    assert found[0] == found[1]
    return found[0]


INJECTED_ADAM = optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)


@pytest.mark.parametrize(
    "inner, state_dtype, mu_dtype, nu_dtype",
    [
        # inject_hyperparams puts Adam's state under its own field `inner_state`: mu and nu decide.
        (INJECTED_ADAM, {"mu": jnp.float32, "nu": jnp.bfloat16}, jnp.float32, jnp.bfloat16),
        # Both `inner_state` (outer) and `mu` (inner) are named: the innermost decides for mu; nu, not
        # named itself, falls back to the next field out.
        (INJECTED_ADAM, {"inner_state": jnp.bfloat16, "mu": jnp.float32}, jnp.float32, jnp.bfloat16),
        # MultiSteps around adam: the same, one level deeper (`inner_opt_state`).
        (
            optax.MultiSteps(optax.adam(1e-3), every_k_schedule=2),
            {"inner_opt_state": jnp.float16, "nu": jnp.float32},
            jnp.float16,
            jnp.float32,
        ),
    ],
    ids=["inject-mu-f32-nu-bf16", "inject-outer-bf16-mu-f32", "multisteps-outer-f16-nu-f32"],
)
def test_a_nested_optimizers_state_dtype_is_decided_by_the_innermost_named_field(
    inner, state_dtype, mu_dtype, nu_dtype
):
    assert adam_state_dtypes(inner, state_dtype) == (jnp.dtype(mu_dtype), jnp.dtype(nu_dtype))
