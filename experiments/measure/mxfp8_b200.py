"""Does `jax.nn.scaled_matmul` (MXFP8: block-32 e8m0 scales) compile to a block-scaled GEMM without a GPU?

For a B200 and an H200 target (`jaxamp.diagnostics.GPU_TARGETS`), each with
the cuDNN version jaxamp's target config states (9.8) and with 9.10, this
lowers ``jax.nn.scaled_matmul`` of float8_e4m3fn operands (1 x 256 x 512
and 1 x 256 x 512) with float8_e8m0fnu scales per block of 32, compiles it
and prints the custom call JAX lowered it to and the library calls in the
optimized program. A finding, not a test: what the installed CUDA plugin
does. Needs the CUDA PJRT plugin. Writes mxfp8_b200.txt.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
from jax.experimental import topologies

import jaxamp
from experiments.measure.gpu_target import compile_for, target_device

STATED = "dnn_version_info { major: 9 minor: 8 }"


def device_for(target: str, cudnn: tuple[int, int]):
    """A compile-only device of `target` whose config states cuDNN `cudnn`."""
    target_device(target)  # registers the CUDA plugin
    config = jaxamp.diagnostics.gpu_spec(target).target_config()
    assert STATED in config, "the stated cuDNN version changed: update this measurement"
    config = config.replace(STATED, f"dnn_version_info {{ major: {cudnn[0]} minor: {cudnn[1]} }}")
    return topologies.get_topology_desc(platform="cuda", target_config=config, topology="1x1x1").devices[0]


def calls(target: str, cudnn: tuple[int, int]) -> tuple[list[str], list[str]]:
    batch, m, n, k = 1, 256, 256, 512
    operands = (
        jax.ShapeDtypeStruct((batch, m, k), jnp.float8_e4m3fn),
        jax.ShapeDtypeStruct((batch, n, k), jnp.float8_e4m3fn),
        jax.ShapeDtypeStruct((batch, m, k // 32), jnp.float8_e8m0fnu),
        jax.ShapeDtypeStruct((batch, n, k // 32), jnp.float8_e8m0fnu),
    )

    def matmul(lhs, rhs, lhs_scales, rhs_scales):
        return jax.nn.scaled_matmul(lhs, rhs, lhs_scales, rhs_scales, preferred_element_type=jnp.bfloat16)

    program = compile_for(matmul, operands, device_for(target, cudnn))
    asked = sorted(set(re.findall(r"stablehlo\.custom_call @([\w$]+)", program.lowered.as_text())))
    ran = sorted(set(re.findall(r'custom_call_target="([^"]+)"', program.text)))
    return asked, ran


def add_arguments(parser) -> None:
    del parser  # no flags of its own


def run(args, out) -> None:
    del args
    out.print(f"jax {jax.__version__}")
    for target in ("b200", "h200"):
        for cudnn in ((9, 8), (9, 10)):
            asked, ran = calls(target, cudnn)
            out.print(f"{target} (cuDNN {cudnn[0]}.{cudnn[1]} stated): lowered to {asked}; compiled to {ran}")
    out.save_printed("mxfp8_b200.txt")
