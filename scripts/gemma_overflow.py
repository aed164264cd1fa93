"""An overflow found by jaxamp's attribution in a model nobody here wrote: Gemma 2, norms in float16.

    pip install --no-deps gemma==2.0.8      # its transformer needs only flax and orbax
    python scripts/gemma_overflow.py > results/cpu/gemma_overflow.txt

The Gemma 2 tiny random config of `scripts/gemma_float16.py` (Google
DeepMind's ``gemma.transformer.Transformer``: 2 layers, width 128,
grouped-query attention, soft-caps), trained by `jaxamp.TrainState` under
``jaxamp.apply_policy(model, "mixed_float16", overrides={RMSNorm:
"float16"})``: its own normalization class (``gemma.layers.RMSNorm``) forced
to run in float16, the mistake the normalization list exists to prevent.
Each step asks `jaxamp.scaled_value_and_grad(..., record_overflow=True)`
where it overflowed. ``--embed-scale`` multiplies the embedding table (100
by default: at 1 no step of this config overflows) to push activations up.

Printed: per skipped step, the gradient leaves the train state names
(`jaxamp.diagnostics.NonFiniteGradients`) and the first matmul that
overflowed (`jaxamp.diagnostics.OverflowRecord`); then the run's skips and
final loss scale, and the same run with the norm left to jaxamp (float32).
"""

from __future__ import annotations

import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import jax
import jax.numpy as jnp
import optax

import jaxamp
from scripts.gemma_float16 import model_and_batch


def run(steps: int, embed_scale: float, norm_in_float16: bool):
    from gemma import layers

    model, params, (inputs, positions, mask), targets = model_and_batch()
    params = jax.tree_util.tree_map_with_path(
        lambda path, leaf: leaf * embed_scale if "embedder" in jax.tree_util.keystr(path) else leaf, params
    )
    overrides = {layers.RMSNorm: "float16"} if norm_in_float16 else None
    policy_model = jaxamp.apply_policy(model, "mixed_float16", overrides=overrides)
    state = jaxamp.TrainState.create(
        apply_fn=policy_model.apply, params=params, tx=optax.adam(1e-3), loss_scale=jaxamp.DynamicLossScale()
    )

    @jax.jit
    def train_step(state):
        def loss_fn(params):
            logits, _ = state.apply_fn({"params": params}, inputs, positions, None, mask)
            return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets).mean()

        loss, grads, finite, record = jaxamp.scaled_value_and_grad(
            loss_fn, state.loss_scale, record_overflow=True
        )(state.params)
        return state.apply_gradients(grads=grads, grads_finite=finite), loss, finite, record

    lines, losses = [], []
    for step in range(1, steps + 1):
        state, loss, finite, record = train_step(state)
        losses.append(float(loss))
        if not bool(finite):
            lines.append(f"  step {step}: {state.nonfinite_grads.summary()}")
            lines.append(f"           {record.summary()}")
    return lines, losses, int(state.skipped_steps), float(state.loss_scale.loss_scale)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12, help="Adam steps (default: %(default)s)")
    parser.add_argument(
        "--embed-scale",
        type=float,
        default=100.0,
        help="multiplies the embedding table (default: %(default)s)",
    )
    args = parser.parse_args(argv)
    print(
        f"Gemma 2 (gemma 2.0.8), tiny random config, {args.steps} Adam steps, embedding x{args.embed_scale:g}, "
        f"JAX {jax.__version__}"
    )
    for norm_in_float16 in (True, False):
        lines, losses, skipped, scale = run(args.steps, args.embed_scale, norm_in_float16)
        name = "RMSNorm forced to float16" if norm_in_float16 else "RMSNorm left to jaxamp (float32)"
        print(
            f"{name}: loss {losses[0]:.3f} -> {losses[-1]:.3f}, skipped {skipped}/{args.steps}, final loss scale {scale:g}"
        )
        print("\n".join(lines[:8]) + ("\n  ..." if len(lines) > 8 else ""), flush=True)


if __name__ == "__main__":
    main()
