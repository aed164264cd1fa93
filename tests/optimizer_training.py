"""A few jitted steps of an optimizer through `jaxamp.TrainState`, shared by the optimizer's test files."""

import jax
import jax.numpy as jnp

import jaxamp


def train(tx, params, loss_fn, steps, poison_at=(), state=None):
    """`steps` jitted steps of `tx` on `loss_fn(params)`, from `state` or a new train state with a dynamic
    loss scale; a step whose index is in `poison_at` gets inf gradients (and is skipped).

    Returns:
        The train state after the steps, and each step's loss.
    """
    if state is None:
        state = jaxamp.TrainState.create(
            apply_fn=None, params=params, tx=tx, loss_scale=jaxamp.DynamicLossScale()
        )

    @jax.jit
    def train_step(state, poison):
        loss, grads, grads_finite = jaxamp.scaled_value_and_grad(loss_fn, state.loss_scale)(state.params)
        grads = jax.tree.map(lambda grad: grad * poison, grads)
        return state.apply_gradients(grads=grads, grads_finite=grads_finite & jaxamp.all_finite(grads)), loss

    losses = []
    for step in range(steps):
        state, loss = train_step(state, jnp.inf if step in poison_at else 1.0)
        losses.append(float(loss))
    return state, losses
