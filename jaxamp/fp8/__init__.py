"""FP8 matmuls: the kernel, delayed scaling, and where FP8 pays.

`jaxamp.autocast(f, "mixed_float8")` runs the eligible matmuls and forward
convolutions of any JAX function through these building blocks; they can
also be called directly. One file per job:

* `_matmul`: `fp8_dot_general` and `fp8_convolution`, per-tensor current
  scaling (`quantize`), and the named fallbacks (`FP8_FALLBACK_REASONS`);
* `_delayed`: delayed scaling, TransformerEngine's recipe, an option:
  `Fp8History` (the amax window a train step carries), `init_fp8_history`,
  `delayed_value_and_grad` (the step helper), `delayed_scaling` (the
  context it opens), and the sites that hand each FP8 matmul its history
  row and send its amaxes out of the step (a client of `jaxamp._probe`);
* `_payoff`: whether FP8 pays for one matmul's shape on a GPU, which decides
  where ``mixed_float8`` runs FP8 (its public face is
  `jaxamp.diagnostics.fp8_matmul_cost` and `jaxamp.diagnostics.fp8_target`).
"""

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

__all__ = [
    "FP8_BACKWARD_DTYPE",
    "FP8_FALLBACK_REASONS",
    "FP8_FORWARD_DTYPE",
    "Fp8History",
    "Quantized",
    "delayed_scaling",
    "delayed_value_and_grad",
    "fp8_convolution",
    "fp8_dot_general",
    "init_fp8_history",
    "quantize",
]
