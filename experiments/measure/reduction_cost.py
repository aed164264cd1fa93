"""What computing reductions' inputs in float32 costs, compiled for an H200 without a GPU.

`jaxamp.autocast` runs an elementwise chain that feeds only float32
reductions (the ``h * h`` of an RMS norm, the ``mul`` inside
``jnp.linalg.norm``) in float32 (`jaxamp._autocast.reduction_inputs`).
This measurement compiles the same programs twice for an H200 target without a
GPU (`jaxamp.diagnostics.gpu_target_device`), with that rule switched off (the rewrite
autocast made before the rule existed: every other rule is the same code)
and on, and prints side by side:

* ``temp``: ``compiled.memory_analysis().temp_size_in_bytes``;
* ``bytes moved``: `jaxamp.diagnostics.bytes_accessed` of the optimized
  program (each kernel reads its operands and writes its result once);
* ``XLA bytes accessed``: ``compiled.cost_analysis()["bytes accessed"]``,
  printed as ``n/a`` where XLA gives no cost analysis (a deviceless compile
  of this JAX gives none);
* ``kernels``: the kernels of the optimized program that move data (fusions,
  library calls, copies; `jaxamp.diagnostics.kernel_roofline`);
* the share of matmul and convolution FLOPs in float16
  (`jaxamp.diagnostics.hlo_precision_report`).

Programs (the H200 is one compile target; nothing runs):

1. a pre-norm transformer block (multi-head causal attention and a GELU
   MLP), with RMSNorm and with LayerNorm written in ``jnp``, its loss the
   mean squared difference to a float32 target, differentiated with respect
   to the params: ``jax.jit(autocast(jax.grad(loss)))`` and
   ``jax.jit(jax.grad(autocast(loss)))`` with a float32 input (the residual
   stream is then float32, and the norms see float32 values), and
   ``jax.jit(autocast(jax.grad(loss)))`` with a float16 input (activations
   handed over in half precision: the first norm squares float16 values);
   batch 8 x 1024 tokens, width 1024, 16 heads unless the flags say otherwise;
2. the experiments' CIFAR ResNet18 train step at batch 128 (augmentation,
   dynamic loss scale, SGD, all in the step), with the model's ``apply``
   under ``autocast`` in place of ``apply_policy``, and with the whole step
   under ``autocast``. ``--skip-resnet`` leaves it out (it takes minutes to
   compile on a small CPU).

Where the rule leaves the lowered program unchanged, it is compiled once and
the row says so. Needs the CUDA PJRT plugin (``pip install 'jax-mixed-precision[gpu-aot]'``).
Writes reduction_cost.txt.
"""

from __future__ import annotations

import contextlib
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxamp
from experiments.benchmark.roofline import cost_of
from experiments.flags import positive_int
from experiments.measure.gpu_target import target_device
from jaxamp._autocast.lineage import _reduction_inputs_disabled as _disabled  # the rule's switch: no public name

TARGET = "h200"
MODES = {"rule off": _disabled, "rule on": contextlib.nullcontext}


def add_arguments(parser) -> None:
    parser.add_argument("--skip-resnet", action="store_true", help="leave out the ResNet18 train step")
    parser.add_argument("--batch", type=positive_int, default=8, help="transformer block: sequences")
    parser.add_argument("--length", type=positive_int, default=1024, help="transformer block: tokens each")
    parser.add_argument("--width", type=positive_int, default=1024, help="transformer block: width")
    parser.add_argument("--heads", type=positive_int, default=16, help="transformer block: attention heads")


def _rms_norm(h, scale, bias):
    del bias
    return h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + 1e-6) * scale


def _layer_norm(h, scale, bias):
    centered = h - jnp.mean(h, axis=-1, keepdims=True)
    variance = jnp.mean(centered * centered, axis=-1, keepdims=True)
    return centered * jax.lax.rsqrt(variance + 1e-6) * scale + bias


def _transformer_loss(norm, heads):
    def block(params, x):
        batch, length, width = x.shape

        def split(h):
            return h.reshape(batch, length, heads, width // heads)

        h = norm(x, params["norm1_scale"], params["norm1_bias"])
        q, k, v = (split(h @ params[name]) for name in ("wq", "wk", "wv"))
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(width // heads)
        causal = jnp.tril(jnp.ones((length, length), bool))
        weights = jax.nn.softmax(jnp.where(causal, logits, -1e9), axis=-1)
        attended = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(batch, length, width)
        x = x + attended @ params["wo"]
        h = norm(x, params["norm2_scale"], params["norm2_bias"])
        return x + jax.nn.gelu(h @ params["w1"]) @ params["w2"]

    def loss(params, x, target):
        return jnp.mean(jnp.square(block(params, x) - target))

    return loss


def _transformer_arguments(batch, length, width, input_dtype, device):
    shapes = {
        "norm1_scale": (width,),
        "norm1_bias": (width,),
        "norm2_scale": (width,),
        "norm2_bias": (width,),
        "wq": (width, width),
        "wk": (width, width),
        "wv": (width, width),
        "wo": (width, width),
        "w1": (width, 4 * width),
        "w2": (4 * width, width),
    }
    params = {name: jax.ShapeDtypeStruct(shape, jnp.float32) for name, shape in shapes.items()}
    x = jax.ShapeDtypeStruct((batch, length, width), input_dtype)
    target = jax.ShapeDtypeStruct((batch, length, width), jnp.float32)
    return jaxamp.diagnostics.on_device((params, x, target), device)


def _measure(build) -> dict:
    """Compiles ``jax.jit(fun)`` for `arguments`, ``(fun, arguments) = build()``, with the rule off, then on.

    `build` makes a new autocast wrapper each time, so the second lowering
    neither reuses the first one's rewrite nor JAX's trace of it. Where the
    rule leaves the lowered program unchanged, it is compiled once and the
    figures are the same program's.
    """
    results, programs = {}, {}
    for mode, switch in MODES.items():
        start = time.perf_counter()
        with switch():
            fun, arguments = build()
            lowered = jax.jit(fun).lower(*arguments)
        programs[mode] = lowered.as_text()
        if mode == "rule on" and programs["rule on"] == programs["rule off"]:
            results[mode] = {**results["rule off"], "compile_s": None}
            continue
        compiled = lowered.compile()
        seconds = time.perf_counter() - start
        text = compiled.as_text()
        try:
            xla_costs = cost_of(compiled)
        except Exception:  # noqa: BLE001 (a compile-only device may raise instead of returning nothing)
            xla_costs = {}
        results[mode] = {
            "temp": compiled.memory_analysis().temp_size_in_bytes,
            "bytes": jaxamp.diagnostics.bytes_accessed(text),
            "xla_bytes": xla_costs.get("bytes accessed"),
            "kernels": len(jaxamp.diagnostics.kernel_roofline(text, TARGET).kernels),
            "half_share": jaxamp.diagnostics.hlo_precision_report(text).fraction(jnp.float16),
            "compile_s": seconds,
        }
    results["same_program"] = programs["rule on"] == programs["rule off"]
    return results


def _row(name, results) -> str:
    before, after = results["rule off"], results["rule on"]

    def megabytes(value):
        return "n/a" if value is None else f"{value / 1e6:.2f} MB"

    def ratio(key):
        if before[key] in (None, 0) or after[key] is None:
            return "n/a"
        return f"{after[key] / before[key]:.4f}"

    def seconds(value):
        return "(same)" if value is None else f"{value:.1f}"

    program = "identical (compiled once)" if results["same_program"] else "different"
    return "\n".join(
        [
            name,
            f"  {'':<22} {'rule off':>14} {'rule on':>14} {'on/off':>8}",
            (
                f"  {'temp':<22} {megabytes(before['temp']):>14} {megabytes(after['temp']):>14} "
                f"{ratio('temp'):>8}"
            ),
            (
                f"  {'bytes moved':<22} {megabytes(before['bytes']):>14} {megabytes(after['bytes']):>14} "
                f"{ratio('bytes'):>8}"
            ),
            (
                f"  {'XLA bytes accessed':<22} {megabytes(before['xla_bytes']):>14} "
                f"{megabytes(after['xla_bytes']):>14} {ratio('xla_bytes'):>8}"
            ),
            f"  {'kernels':<22} {before['kernels']:>14} {after['kernels']:>14}",
            f"  {'matmul FLOPs float16':<22} {before['half_share']:>14.1%} {after['half_share']:>14.1%}",
            f"  {'compile s':<22} {seconds(before['compile_s']):>14} {seconds(after['compile_s']):>14}",
            f"  lowered programs: {program}",
        ]
    )


def transformer_rows(device, batch=8, length=1024, width=1024, heads=16):
    orders = {
        "autocast(grad(loss))": lambda loss: jaxamp.autocast(jax.grad(loss)),
        "grad(autocast(loss))": lambda loss: jax.grad(jaxamp.autocast(loss)),
    }
    variants = [
        ("autocast(grad(loss))", jnp.float32),
        ("grad(autocast(loss))", jnp.float32),
        ("autocast(grad(loss))", jnp.float16),
    ]
    for norm_name, norm in (("RMSNorm", _rms_norm), ("LayerNorm", _layer_norm)):
        loss = _transformer_loss(norm, heads)
        for order, input_dtype in variants:
            arguments = _transformer_arguments(batch, length, width, input_dtype, device)
            results = _measure(lambda: (orders[order](loss), arguments))  # noqa: B023 (called at once)
            name = (
                f"transformer block, {norm_name}, jit({order}), {np.dtype(input_dtype).name} input, "
                f"batch {batch} x {length} tokens, width {width}, {heads} heads"
            )
            yield _row(name, results)


def resnet_rows(device, batch_size=128):
    """The experiments' train step, with ``autocast`` in two places.

    ``apply``: the model's ``apply`` under autocast, differentiated by the
    step (``grad(autocast(apply))``); ``step``: the whole step under
    autocast (``autocast(grad(...))``: the backward pass, the loss scale and
    the optimizer are rewritten too). The model is built with the float32
    policy, so autocast alone decides its dtypes.
    """
    from experiments import data as data_lib
    from experiments import train
    from experiments.benchmark import targets

    config = train.TrainConfig(
        model="resnet18",
        precision="fp32",
        batch_size=batch_size,
        data="synthetic",
        epochs=1,
        loss_scale="dynamic",
    )
    dataset = data_lib.synthetic_dataset(num_train=1, num_test=1)  # mean/std only
    _, *data = targets.abstract_arguments("resnet18", "fp32", batch_size, device)
    precision = train.resolve_precision("fp32")
    steps_per_epoch = 50000 // batch_size
    step = train.make_train_step(config, dataset)

    def state_with(apply_under_autocast):
        state = train.create_train_state(config, precision, 10, steps_per_epoch)
        if apply_under_autocast:
            state = state.replace(apply_fn=jaxamp.autocast(state.apply_fn, "mixed_float16"))
        return state

    def arguments(apply_under_autocast):
        return (
            jaxamp.diagnostics.on_device(jax.eval_shape(lambda: state_with(apply_under_autocast)), device),
            *data,
        )

    variants = {
        "apply under autocast: grad(autocast(apply))": lambda: (step, arguments(True)),
        "whole step under autocast: autocast(grad(...))": lambda: (
            jaxamp.autocast(step, "mixed_float16"),
            arguments(False),
        ),
    }
    for name, build in variants.items():
        results = _measure(build)
        yield _row(f"ResNet18 CIFAR train step, batch {batch_size}, dynamic loss scale, {name}", results)


def run(args, out) -> None:
    device = target_device(TARGET)
    out.print(f"# jax {jax.__version__}, target {TARGET} ({device.device_kind}), compiled without a GPU")
    out.print(f"# load average at start: {os.getloadavg()[0]:.1f}")
    out.print("# rule off: autocast with the float32-reduction-inputs rule switched off; rule on: as shipped")
    for row in transformer_rows(device, args.batch, args.length, args.width, args.heads):
        out.print(row)
    if not args.skip_resnet:
        for row in resnet_rows(device):
            out.print(row)
    out.save_printed("reduction_cost.txt")
