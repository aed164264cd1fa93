"""What NVFP4's recipe tools do to the weight gradients of the small language model's own layers.

Training parity (``blackwell-parity``) cannot tell NVFP4's tools apart on
this machine: 150 steps of the small model land within the spread of two
seeds with or without them. This measurement looks where the tools act,
at each layer's wgrad GEMM, on the model's own tensors.

For the model (``--model``) at its initial weights and a batch of 8
windows of its context (128 bytes for ``small``) of the standard-library corpus, every dense layer's
input ``x [M, K]``, weight ``w [K, N]`` and output cotangent ``g [M, N]``
are read from the float32 model's loss (M = 1024 tokens for ``small``). Each is cast to
bfloat16, as ``mixed_nvfp4`` feeds them, and the layer's weight gradient
is computed by:

* ``bfloat16``: ``x.T @ g`` of the bfloat16 operands (float32
  accumulation), the compute dtype's own error;
* ``nvfp4 (...)``: `jaxamp.fp8.block_scaled_dot_general`'s backward in
  NVFP4 under `jaxamp.fp8.block_recipe`: the full recipe (the Hadamard
  transform on the wgrad GEMM's inputs and stochastic rounding of the
  gradient), without the transform, with nearest rounding of the gradient,
  and with neither;
* ``gradient only (...)``: ``H(x).T @ q(H(g))`` with ``x`` exact, only the
  gradient quantized (after the transform), stochastically or to nearest:
  the gradient rounding's own share of the error.

The weight gradients of all layers are taken as one vector ``dw`` against
float32's ``x.T @ g``. Two errors per row, over ``--batches`` batches:

* one step: ``|dw_q - dw| / |dw|``, the mean over the batches;
* accumulated over n steps: ``|sum dw_q - sum dw| / |sum dw|`` over the
  first n batches, what an optimizer's moving averages see. An unbiased
  rounding's error averages out as n grows; a biased one's stays.

Writes recipe.md (the table), recipe.json and accumulated_error.png.
"""

from __future__ import annotations

import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from experiments.flags import positive_int
from experiments.lm import data as data_lib
from experiments.lm import model as model_lib
from experiments.lm.train import token_losses
from experiments.measure.markdown import table
from jaxamp.fp8 import block_recipe, block_scaled_dot_general
from jaxamp.fp8._block_formats import NVFP4, dequantize, hadamard, quantize

BATCH = 8
MATMUL = (((1,), (0,)), ((), ()))
# (row label, block_recipe options)
RECIPES = (
    ("nvfp4 (full recipe)", {}),
    ("nvfp4 (no Hadamard)", {"hadamard": False}),
    ("nvfp4 (nearest gradients)", {"stochastic_gradients": False}),
    ("nvfp4 (neither)", {"hadamard": False, "stochastic_gradients": False}),
)
GRADIENT_ONLY = (("gradient only (stochastic)", "stochastic"), ("gradient only (nearest)", "nearest"))


def add_arguments(parser) -> None:
    parser.add_argument("--model", default="small", choices=("tiny", "small"), help="the language model's size")
    parser.add_argument("--batches", type=positive_int, default=64, help="batches (steps) to accumulate over")
    parser.add_argument("--seed", type=int, default=0, help="the model's initial weights and the batches")


def layer_tensors(model: nn.Module, params, windows: jax.Array) -> dict[str, tuple[jax.Array, ...]]:
    """Each dense layer's ``(x [M, K], w [K, N], g [M, N])`` from the float32 model's loss on `windows`.

    ``g`` is the loss's cotangent at the layer's output, read as the
    gradient of a zero added there.
    """

    def is_dense_call(context) -> bool:
        return context.method_name == "__call__" and isinstance(context.module, (nn.Dense, nn.DenseGeneral))

    def loss(params, added_zeros):
        inputs, outputs = {}, {}

        def intercept(next_fun, args, kwargs, context):
            out = next_fun(*args, **kwargs)
            if not is_dense_call(context):
                return out
            name = "/".join(context.module.path)
            inputs[name], outputs[name] = args[0], out
            return out + added_zeros[name] if added_zeros is not None else out

        with nn.intercept_methods(intercept):
            logits = model.apply({"params": params}, windows[:, :-1])
        return token_losses(logits, windows[:, 1:]).mean(), (inputs, outputs)

    _, (_, outputs) = jax.eval_shape(lambda p: loss(p, None), params)
    zeros = jax.tree.map(lambda out: jnp.zeros(out.shape, out.dtype), outputs)
    cotangents, (inputs, _) = jax.grad(loss, argnums=1, has_aux=True)(params, zeros)
    tensors = {}
    for name, g in cotangents.items():
        kernel = params
        for part in name.split("/"):
            kernel = kernel[part]
        tokens = g.shape[0] * g.shape[1]
        x = inputs[name].reshape(tokens, -1)
        tensors[name] = (x, kernel["kernel"].reshape(x.shape[1], -1), g.reshape(tokens, -1))
    return tensors


def weight_gradients(tensors, method) -> jax.Array:
    """All layers' weight gradients by `method(x, w, g)`, as one float32 vector (layers in name order)."""
    return jnp.concatenate([method(*tensors[name]).astype(jnp.float32).ravel() for name in sorted(tensors)])


def float32_gradient(x, w, g):
    del w
    return jnp.dot(x.T, g, precision=jax.lax.Precision.HIGHEST)


def bfloat16_gradient(x, w, g):
    del w
    return jnp.dot(x.astype(jnp.bfloat16).T, g.astype(jnp.bfloat16), preferred_element_type=jnp.float32)


def nvfp4_gradient(x, w, g):
    """The weight gradient of NVFP4's backward, as ``mixed_nvfp4`` runs it, under the current recipe."""
    half = [operand.astype(jnp.bfloat16) for operand in (x, w, g)]
    _, backward = jax.vjp(lambda x, w: block_scaled_dot_general(x, w, MATMUL, "nvfp4"), half[0], half[1])
    return backward(half[2])[1]


def gradient_only(rounding: str):
    """``H(x).T @ q(H(g))``: only the (bfloat16) gradient quantized, after the Hadamard transform."""

    def method(x, w, g):
        del w
        x_t = hadamard(x.astype(jnp.bfloat16), transposed=True).astype(jnp.float32)  # [K, M]
        g_t = quantize(hadamard(g.astype(jnp.bfloat16), transposed=True), NVFP4, rounding=rounding, stream=1)
        return jnp.dot(x_t, dequantize(g_t).T, precision=jax.lax.Precision.HIGHEST)  # [K, N]

    return method


def methods(tensors_example) -> dict:
    """Each row's compiled ``tensors -> dw``, the block recipe fixed when each is traced."""

    def compiled(method):
        # A function of its own per row: JAX reuses a trace of the same function, recipe or not.
        return jax.jit(lambda tensors: weight_gradients(tensors, method)).lower(tensors_example).compile()

    rows = {"float32": compiled(float32_gradient), "bfloat16": compiled(bfloat16_gradient)}
    for label, options in RECIPES:
        with block_recipe(**options):
            rows[label] = compiled(nvfp4_gradient)
    for label, rounding in GRADIENT_ONLY:
        rows[label] = compiled(gradient_only(rounding))
    return rows


class ErrorTracker:
    """Each row's error against the ``float32`` row, one step at a time and of the sums so far.

    Attributes:
        one_step: per row, ``|dw_q - dw| / |dw|`` of each step.
        accumulated: per row, ``|sum dw_q - sum dw| / |sum dw|`` over the steps so far, after each step.
    """

    def __init__(self):
        self.one_step: dict[str, list[float]] = {}
        self.accumulated: dict[str, list[float]] = {}
        self._sums: dict[str, jax.Array] = {}

    def add(self, gradients: dict[str, jax.Array]) -> None:
        """One step's weight gradients by every row, ``float32`` among them."""
        for label, gradient in gradients.items():
            self._sums[label] = self._sums[label] + gradient if label in self._sums else gradient
        reference, reference_sum = gradients["float32"], self._sums["float32"]
        for label, gradient in gradients.items():
            if label == "float32":
                continue
            self.one_step.setdefault(label, []).append(_relative(gradient, reference))
            self.accumulated.setdefault(label, []).append(_relative(self._sums[label], reference_sum))


def _relative(value: jax.Array, reference: jax.Array) -> float:
    return float(jnp.linalg.norm(value - reference) / jnp.linalg.norm(reference))


def checkpoints(batches: int) -> list[int]:
    """1, 4, 16, ... up to `batches`, and `batches`."""
    points = [n for n in (4**power for power in range(12)) if n < batches]
    return [*points, batches]


def plot(path: str, results: dict) -> None:
    import matplotlib  # pylint: disable=import-outside-toplevel

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

    figure, axes = plt.subplots(figsize=(7, 4.5))
    steps = np.arange(1, len(next(iter(results["accumulated"].values()))) + 1)
    for label, errors in results["accumulated"].items():
        axes.loglog(steps, errors, label=label, linestyle="--" if label.startswith("gradient only") else "-")
    axes.set_xlabel("steps accumulated")
    axes.set_ylabel("relative error of the summed weight gradients")
    axes.set_title(f"NVFP4's wgrad GEMM on the {results['model']} language model's layers")
    axes.grid(alpha=0.3, which="both")
    axes.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def report(results: dict, command: str) -> str:
    """recipe.md: each row's one-step error and its accumulated error at the checkpoints."""
    points = checkpoints(results["batches"])
    header = ["weight gradient by", "one step", *(f"accumulated, {n} steps" for n in points)]
    rows = [
        [label, f"{results['one_step'][label]:.4f}", *(f"{errors[n - 1]:.4f}" for n in points)]
        for label, errors in results["accumulated"].items()
    ]
    return "\n".join(
        [
            "# NVFP4's recipe tools at the wgrad GEMM: the small language model's own layers",
            "",
            f"Command: `{command}`. The {results['model']} model at its initial weights (seed "
            f"{results['seed']}), {results['layers']} dense layers, batches of {BATCH} windows of {results['context']} bytes; "
            "relative error of all layers' weight gradients against float32's (one step: mean over the "
            "batches; accumulated: the sums over the first n batches).",
            "",
            table(header, rows, "l" + "r" * (len(header) - 1)).rstrip(),
            "",
        ]
    )


def run(args, out) -> None:
    corpus = data_lib.load_stdlib_corpus()
    model = model_lib.create_model(args.model, corpus.vocab_size, "xla")
    context = model.size.context
    params = model.init(jax.random.key(args.seed), jnp.zeros((1, context), jnp.int32))["params"]

    def windows(step: int) -> jax.Array:
        offsets = data_lib.batch_offsets(len(corpus.train), BATCH, context, args.seed, step)
        return jnp.asarray(data_lib.batch_rows(corpus.train, offsets, context, slice(None)))

    tensors_of = jax.jit(lambda windows: layer_tensors(model, params, windows))
    rows = methods(tensors_of(windows(0)))
    errors = ErrorTracker()
    started = time.monotonic()
    for step in range(args.batches):
        tensors = tensors_of(windows(step))
        errors.add({label: compiled(tensors) for label, compiled in rows.items()})
        if step + 1 in checkpoints(args.batches):
            out.print(
                f"{step + 1} steps ({time.monotonic() - started:.0f} s): "
                + ", ".join(f"{label} {values[-1]:.4f}" for label, values in errors.accumulated.items())
            )
    results = {
        "model": args.model,
        "seed": args.seed,
        "context": context,
        "batches": args.batches,
        "layers": len(tensors),
        "one_step": {label: float(np.mean(values)) for label, values in errors.one_step.items()},
        "accumulated": errors.accumulated,
    }
    text = report(results, out.command)
    out.print(text.rstrip())
    out.write("recipe.md", text)
    out.write_json("recipe.json", results)
    plot(out.file("accumulated_error.png"), results)
