"""Fault classes of FP8 delayed scaling and FP8 weight gathers.

* The amax history takes only the amaxes of a step that counts: no inf or
  NaN amax in any row or column, and nothing from a skipped step, whatever
  made it skip.
* The settings a history is made with (its length, reduction and margin)
  reach the scale the FP8 matmuls use, through every constructor and every
  step, and are never dropped or rounded.
* A weight whose FP8 gather scale has nothing to divide by (all zeros: a
  zero-initialized kernel; or so small that the scale overflows float32)
  is gathered finite, as its unsharded self.

On the CPU, tiny shapes; each test says which fault would make it fail.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import jaxamp
from jaxamp import fp8

MATMUL = (((1,), (0,)), ((), ()))  # x @ w


def gaussian(seed, *shape):
    return jax.random.normal(jax.random.key(seed), shape)


def fp8_matmul_loss(params, x):
    """One FP8 matmul and a mean square (one FP8 site), plus a float32 term on `params["b"]`."""
    product = jaxamp.fp8_dot_general(x, params["w"], MATMUL).astype(jnp.float32)
    return jnp.mean(jnp.square(product)) + jnp.sum(jnp.sqrt(params["b"]))


PARAMS = {"w": gaussian(1, 32, 16), "b": jnp.ones(4)}
X = gaussian(0, 8, 32)


def filled_history(rows=2, length=3):
    """A history whose window holds 1, 2 and 3 (newest first: 3, 2, 1) in every cell."""
    history = fp8.Fp8History.create(rows=rows, length=length)
    for amax in (1.0, 2.0, 3.0):
        history = history.record(jnp.full((rows, 3), amax))
    return history


# --- the history takes only the amaxes of a step that counts -----------------------------------


@pytest.mark.parametrize("value", [jnp.inf, -jnp.inf, jnp.nan], ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize("cell", [(0, 0), (1, 1), (1, 2)], ids=["lhs", "rhs", "cotangent"])
def test_a_non_finite_amax_in_any_row_or_column_leaves_the_whole_window_as_it_was(value, cell):
    """`record` with keep=True (a Python bool and a traced one, under jit). Fails if the check
    were `isinf` alone (NaN enters), per row or per column (the other cells roll), or dropped."""
    history = filled_history()
    amaxes = jnp.full((2, 3), 4.0).at[cell].set(value)
    for after in (
        history.record(amaxes),
        jax.jit(lambda h, a: h.record(a, keep=jnp.array(True)))(history, amaxes),
    ):
        np.testing.assert_array_equal(after.amax_history, history.amax_history)
        assert after.recorded


@pytest.mark.parametrize("keep", [False, jnp.array(False)], ids=["bool", "traced"])
def test_a_step_not_kept_leaves_the_window_as_it_was_even_with_finite_amaxes(keep):
    """Fails if `keep` were ignored where every amax is finite."""
    history = filled_history()
    after = jax.jit(lambda h: h.record(jnp.full((2, 3), 4.0), keep=keep))(history)
    np.testing.assert_array_equal(after.amax_history, history.amax_history)


def test_a_step_skipped_for_a_gradient_outside_the_fp8_matmul_records_none_of_its_finite_amaxes():
    """`sqrt` of a zero outside the FP8 matmul: its gradient is inf, every amax finite. The step
    is skipped and the window stays as it was; the next finite step enters. Fails if the history
    kept every step (keep=True), or judged a step by its amaxes alone."""
    value_and_grad = jax.jit(fp8.delayed_value_and_grad(fp8_matmul_loss))
    history = fp8.init_fp8_history(fp8_matmul_loss, PARAMS, X, length=4)
    _, _, grads_finite, history = value_and_grad(history, PARAMS, X)
    assert bool(grads_finite)
    x_amax = float(jnp.max(jnp.abs(X)))
    np.testing.assert_array_equal(history.amax_history[0, 0], [x_amax, 0.0, 0.0, 0.0])

    _, grads, grads_finite, after = value_and_grad(history, {**PARAMS, "b": jnp.zeros(4)}, X * 2)
    assert not bool(grads_finite) and not np.all(np.isfinite(grads["b"]))
    np.testing.assert_array_equal(after.amax_history, history.amax_history)

    _, _, grads_finite, after = value_and_grad(history, PARAMS, X * 2)
    assert bool(grads_finite)
    np.testing.assert_array_equal(after.amax_history[0, 0], [2 * x_amax, x_amax, 0.0, 0.0])


# --- the settings a history is made with reach the scale ---------------------------------------

SETTINGS = {"length": 3, "reduction": "most_recent", "margin": 2}


def made_by_create():
    return fp8.Fp8History.create(rows=1, **SETTINGS)


def made_by_init():
    return fp8.init_fp8_history(fp8_matmul_loss, PARAMS, X, **SETTINGS)


def settings_of(history):
    return {
        "length": history.amax_history.shape[-1],
        "reduction": history.reduction,
        "margin": history.margin,
    }


@pytest.mark.parametrize("make", [made_by_create, made_by_init], ids=["create", "init_fp8_history"])
def test_the_length_reduction_and_margin_a_history_is_made_with_survive_every_step(make):
    """Through `record`, jit, tree_map and a jitted `delayed_value_and_grad` step, and the amax it
    scales by is the newest amax times 2**margin. Fails if a constructor dropped or defaulted a
    setting, or a step replaced the history with one of default settings."""
    history = make()
    assert settings_of(history) == SETTINGS
    history = history.record(jnp.full((1, 3), 8.0)).record(jnp.full((1, 3), 3.0))
    history = jax.tree.map(lambda leaf: leaf, jax.jit(lambda h: h)(history))
    _, _, _, history = jax.jit(fp8.delayed_value_and_grad(fp8_matmul_loss))(history, PARAMS, X)
    assert settings_of(history) == SETTINGS
    newest = history.amax_history[..., 0]
    np.testing.assert_array_equal(history.amax(), newest * 4.0)  # most_recent, not the window's 8
    assert float(newest[0, 0]) == float(jnp.max(jnp.abs(X)))


def test_the_margin_reaches_the_fp8_matmuls_scale():
    """A history that saw a quarter of the input's amax clips the input; a margin of 2 (4x the
    amax) gives back current scaling's product bit for bit. Fails if the margin were dropped
    between the constructor and the matmul."""
    w, x = PARAMS["w"], X
    x_amax, w_amax = float(jnp.max(jnp.abs(x))), float(jnp.max(jnp.abs(w)))

    def product(margin):
        history = fp8.init_fp8_history(lambda w, x: jaxamp.fp8_dot_general(x, w, MATMUL), w, x, margin=margin)
        history = history.record(jnp.array([[x_amax / 4, w_amax / 4, 1.0]]))
        with fp8.delayed_scaling(history):
            return jaxamp.fp8_dot_general(x, w, MATMUL)

    current = jaxamp.fp8_dot_general(x, w, MATMUL)
    np.testing.assert_array_equal(product(2), current)
    assert not np.array_equal(product(0), current)


@pytest.mark.parametrize("name, value", [("margin", 1.5), ("length", 2.5), ("rows", 0.5)])
def test_a_setting_that_is_not_a_whole_number_is_refused_not_rounded(name, value):
    """Fails if `int()` silently rounded a margin of 1.5 to 1 (or a length, or rows)."""
    settings = {"rows": 1, "length": 4, "margin": 0, name: value}
    message = (
        f"Fp8History.create: {name} must be a whole number; got {value}. Pass an int (a margin counts "
        "powers of two of headroom: the amax is multiplied by 2**margin)."
    )
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        fp8.Fp8History.create(**settings)


def test_the_smallest_history_is_one_step_long_and_may_have_no_rows():
    """Fails if a length of 1 or 0 rows were refused, or a length of 0 accepted."""
    assert fp8.Fp8History.create(rows=0, length=1).amax_history.shape == (0, 3, 1)
    for rows, length in ((1, 0), (-1, 4)):
        message = f"An FP8 history needs length >= 1 and rows >= 0; got length {length}, rows {rows}."
        with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
            fp8.Fp8History.create(rows=rows, length=length)


def test_amaxes_of_another_shape_are_refused_naming_the_shape_the_history_needs():
    message = "Fp8History.record needs amaxes of shape (2, 3) (rows, lhs/rhs/cotangent); got (3, 3)."
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        filled_history().record(jnp.ones((3, 3)))


# --- the step takes what jax.value_and_grad takes ----------------------------------------------


def loss_with_aux(w, x, v, *, scale):
    """An FP8 matmul's mean square times `scale`, plus a float32 term on `v`; aux: a scalar."""
    loss = fp8_matmul_loss({"w": w, "b": jnp.ones(4)}, x) * scale + jnp.sum(v**2)
    return loss, -loss


def test_a_delayed_step_differentiates_the_argnums_asked_for_with_aux_and_keywords():
    """argnums=(0, 2), has_aux=True and a keyword argument, against jax.value_and_grad (the
    empty history scales as current scaling does). Fails if a keyword were dropped (when sizing
    the history or in the step), the aux taken for the loss, or the argnums shifted wrongly."""
    w, v = PARAMS["w"], jnp.arange(3.0)
    history = fp8.init_fp8_history(loss_with_aux, w, X, v, scale=2.0)
    assert history.rows == 1
    value_and_grad = fp8.delayed_value_and_grad(loss_with_aux, has_aux=True, argnums=(0, 2))
    (loss, aux), grads, grads_finite, _ = value_and_grad(history, w, X, v, scale=2.0)
    (expected_loss, _), expected_grads = jax.value_and_grad(loss_with_aux, argnums=(0, 2), has_aux=True)(
        w, X, v, scale=2.0
    )
    assert bool(grads_finite) and isinstance(grads, tuple) and len(grads) == 2
    np.testing.assert_allclose(loss, expected_loss, rtol=1e-6)
    np.testing.assert_allclose(aux, -loss, rtol=1e-6)
    for grad, expected in zip(grads, expected_grads, strict=True):
        np.testing.assert_allclose(grad, expected, rtol=1e-5)


# --- a weight with nothing to scale by is gathered finite --------------------------------------


def zero_kernel(shape):
    return jnp.zeros(shape)


def tiny_kernel(shape):
    """An amax of 1e-37: 448 / 1e-37 overflows float32. Zeros around it would turn into NaN."""
    return jnp.zeros(shape).at[0, 0].set(1e-37)


@pytest.mark.parametrize("gather", ["float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("kernel", [zero_kernel, tiny_kernel], ids=["zero-initialized", "amax 1e-37"])
def test_a_kernel_with_nothing_to_scale_by_is_gathered_finite_as_its_unsharded_self(gather, kernel):
    """One device's FSDP loss with an FP8 gather: the loss and the gradients equal the unsharded
    ones (the kernel gathers as zeros, or as the one value FP8 holds of it). Fails if the scale guard
    took an amax of 0 as usable (`>=` for `>`: 0 times an inf scale is NaN), or did not bound a
    scale that overflows."""
    params = {"kernel": kernel((3, 4)), "bias": jnp.linspace(-1.0, 1.0, 4)}
    inputs = jnp.arange(6.0).reshape(2, 3) / 5

    def loss_fn(params, inputs):
        return jnp.mean((inputs @ params["kernel"] + params["bias"]) ** 2)

    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    sharded = jaxamp.fsdp.fsdp_loss(loss_fn, mesh, f"gather={gather},reduce=f32,dequantize=f32")
    loss, grads = jax.jit(jax.value_and_grad(sharded))(params, inputs)
    expected_loss, expected_grads = jax.value_and_grad(loss_fn)(
        {**params, "kernel": jnp.zeros((3, 4))}, inputs
    )
    np.testing.assert_allclose(loss, expected_loss, rtol=1e-6)
    for name in params:
        np.testing.assert_allclose(grads[name], expected_grads[name], rtol=1e-6)
