"""FP8 matmuls: the kernel, delayed scaling, and where FP8 pays; Blackwell's block-scaled formats.

`jaxamp.autocast(f, "mixed_float8")` runs the eligible matmuls and forward
convolutions of any JAX function through these building blocks, and
``"mixed_mxfp8"`` and ``"mixed_nvfp4"`` its eligible matmuls through the
block-scaled ones; they can also be called directly. One file per job:

* `_matmul`: `fp8_dot_general` and `fp8_convolution`, per-tensor current
  scaling (`quantize`), and the named fallbacks (`FP8_FALLBACK_REASONS`);
* `_delayed`: delayed scaling, TransformerEngine's recipe, an option:
  `Fp8History` (the amax window a train step carries), `init_fp8_history`,
  `delayed_value_and_grad` (the step helper), `delayed_scaling` (the
  context it opens), and the sites that hand each FP8 matmul its history
  row and send its amaxes out of the step (a client of `jaxamp._probe`);
* `_payoff`: whether FP8 pays for one matmul's shape on a GPU, which decides
  where ``mixed_float8`` runs FP8 (its public face is
  `jaxamp.diagnostics.fp8_matmul_cost` and `jaxamp.diagnostics.fp8_target`);
* `_block_formats`: MXFP8 and NVFP4, quantized in blocks along one axis,
  with the NVFP4 recipe's 2D weight blocks, random Hadamard transform and
  stochastic rounding;
* `_block_scaled`: `block_scaled_dot_general`, the three block-scaled
  GEMMs of a matmul's training step (emulated in float32 off CUDA);
* `_recipe`: `block_recipe`, the NVFP4 recipe's switches, for ablations.
"""

from jaxamp.fp8._block_scaled import block_scaled_dot_general
from jaxamp.fp8._delayed import Fp8History, delayed_scaling, delayed_value_and_grad, init_fp8_history
from jaxamp.fp8._matmul import (
    FP8_BACKWARD_DTYPE,
    FP8_FALLBACK_REASONS,
    FP8_FORWARD_DTYPE,
    Quantized,
    fp8_convolution,
    fp8_dot_general,
    quantize,
)
from jaxamp.fp8._recipe import block_recipe

__all__ = [
    "FP8_BACKWARD_DTYPE",
    "FP8_FALLBACK_REASONS",
    "FP8_FORWARD_DTYPE",
    "Fp8History",
    "Quantized",
    "block_recipe",
    "block_scaled_dot_general",
    "delayed_scaling",
    "delayed_value_and_grad",
    "fp8_convolution",
    "fp8_dot_general",
    "init_fp8_history",
    "quantize",
]
