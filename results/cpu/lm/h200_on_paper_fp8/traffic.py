"""Where the bytes moved per step go: GPT-2 (124M) compiled for an H200, by kind of kernel.

    PYTHONPATH=/path/to/cuda_plugin:. JAX_PLATFORMS=cpu python results/cpu/lm/h200_on_paper_fp8/traffic.py

Compiles the train step of `experiments.lm.on_paper` (context 1024, 8 sequences,
autocast route) under mixed_bf16 and mixed_float8 and splits the estimate of
`jaxamp.hlo_report.bytes_accessed` (each top-level kernel reads its operands and
writes its result once) by kernel: FP8 GEMMs, other GEMMs, FP8 quantization
kernels (fusions traced under jaxamp's ``jaxamp_fp8`` scope outside a fallback:
amax reductions, scaling and casts to FP8), and everything else. Writes
traffic.json beside this file.
"""

import collections
import functools
import json
import os
import re
import sys

import jax
import jax.numpy as jnp

import jaxamp
from experiments.benchmark import targets
from experiments.lm import train
from experiments.lm.config import LMConfig
from experiments.train import resolve_precision
from jaxamp import hlo_report

_OP_NAME = re.compile(r'op_name="([^"]*)"')


def gemm_kind(module, instruction) -> str | None:
    """``FP8 GEMMs`` or ``other GEMMs`` for a kernel that is a matmul, else None.

    A GEMM is a cuBLAS custom call, or a fusion around a dot or one (XLA's
    GEMM fusions); it is FP8 when an operand of its matmul is FP8.
    """
    if instruction.opcode == "custom-call":
        target = hlo_report._custom_call_target(instruction.attributes)
        if "cublas" in target:
            return "FP8 GEMMs" if "f8" in target else "other GEMMs"
        return None
    for called in hlo_report._called_computations(instruction):
        if called not in module.computations:
            continue
        shapes = module.shapes_of(called)
        for inner in module.computations[called]:
            inner_kind = gemm_kind(module, inner)
            if inner.opcode == "dot" or inner_kind:
                operands = [shape for name in inner.operands for shape in shapes.get(name, ())]
                fp8 = any(shape.element_type.startswith("f8") for shape in operands)
                return inner_kind or ("FP8 GEMMs" if fp8 else "other GEMMs")
    return None


def kind(module, instruction) -> str:
    found = gemm_kind(module, instruction)
    if found:
        return found
    op_name = _OP_NAME.search(instruction.attributes)
    op_name = op_name.group(1) if op_name else ""
    if "jaxamp_fp8" in op_name and "jaxamp_fp8_fallback" not in op_name:
        return "FP8 quantization"
    return "other"


def traffic_by_kind(text: str) -> dict[str, int]:
    module = hlo_report.HloModule.parse(text)
    shapes = module.shapes_of(module.entry)
    totals = collections.Counter()
    for instruction in module.computations[module.entry]:
        if instruction.opcode in hlo_report._NO_TRAFFIC_OPCODES:
            continue  # loops and calls too: the sum is checked against the whole estimate below
        results = instruction.shapes[:1] if instruction.opcode == "custom-call" else instruction.shapes
        operands = (shape for name in instruction.operands for shape in shapes.get(name, ()))
        totals[kind(module, instruction)] += sum(shape.num_bytes for shape in (*results, *operands))
    return dict(totals)


def main() -> int:
    spec = jaxamp.gpu_targets.gpu_spec("h200")
    device = jaxamp.gpu_target_device(spec)
    found = {}
    for name in ("mixed_bf16", "mixed_float8"):
        config = LMConfig(model="gpt2", precision=name, route="autocast", batch_size=8)
        precision = resolve_precision(name)
        model, _ = train.create_model(config, precision, 50304, "gpu")
        tx = train.create_optimizer(config)
        state = jax.eval_shape(
            functools.partial(train.create_train_state, config, precision, model, 1024, tx)
        )
        windows = jax.ShapeDtypeStruct((8, 1025), jnp.int32)
        step = train.make_train_step(train.make_loss_fn(model.apply, "autocast", precision.policy))
        compiled = targets.compile_step(
            step, jaxamp.on_device((state, windows), device), name, precision.context(), spec
        )
        with open(f"/tmp/lm_h200_{name}.hlo", "w") as file:  # to look into, without compiling again
            file.write(compiled.text)
        by_kind = traffic_by_kind(compiled.text)
        assert sum(by_kind.values()) == compiled.bytes_accessed, (by_kind, compiled.bytes_accessed)
        found[name] = by_kind
        print(name, {key: f"{value / 1e9:.1f} GB" for key, value in sorted(by_kind.items())}, flush=True)
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "traffic.json"), "w") as file:
        json.dump({"command": "python " + " ".join(sys.argv), "bytes_per_step": found}, file, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
