"""jaxamp: automatic mixed precision for JAX and Flax.

Precision policies applied to Flax models without editing them, or to any
JAX function with `autocast`; loss scales whose state is a jit-safe pytree;
and a train state that skips the update of any step whose gradients
overflowed.

Examples:
    >>> policy = jaxamp.get_policy("mixed_float16")
    >>> model = jaxamp.apply_policy(ResNet18(), policy)
    >>> state = jaxamp.TrainState.create(
    ...     apply_fn=model.apply, params=params, tx=optax.adam(1e-3),
    ...     loss_scale=jaxamp.default_loss_scale(policy))
    >>> loss, grads, grads_finite = jaxamp.scaled_value_and_grad(
    ...     loss_fn, state.loss_scale)(state.params)
    >>> state = state.apply_gradients(grads=grads, grads_finite=grads_finite)
"""

from jaxamp import supported_jax

supported_jax.check()  # before any module that reads JAX's primitives

from jaxamp.finite import all_finite, select_tree
from jaxamp.fp8 import (
    FP8_FALLBACK_REASONS,
    Fp8QuantizationStats,
    Fp8TensorStats,
    fp8_dot_general,
    fp8_quantization_stats,
)
from jaxamp.fp8_check import Fp8NotUsedWarning, check_fp8
from jaxamp.fsdp import CommunicationPolicy, fsdp_loss, fsdp_shardings, get_communication_policy
from jaxamp.gpu_targets import GPU_TARGETS, GpuSpec, gpu_target_device, on_device
from jaxamp.grads import scaled_value_and_grad
from jaxamp.jaxpr_policy import autocast, float32_scope
from jaxamp.layer_policies import NORMALIZATION_LAYERS
from jaxamp.loss_scale import (
    DynamicLossScale,
    LossScale,
    NoOpLossScale,
    StaticLossScale,
    default_loss_scale,
)
from jaxamp.module_policy import apply_policy
from jaxamp.overflow_guard import LossScaleStuckError, OverflowGuard
from jaxamp.policy import Policy, get_policy
from jaxamp.report import PrecisionReport, hlo_precision_report, precision_report
from jaxamp.train_state import TrainState

__version__ = "0.1.0"

__all__ = [
    "FP8_FALLBACK_REASONS",
    "GPU_TARGETS",
    "NORMALIZATION_LAYERS",
    "CommunicationPolicy",
    "DynamicLossScale",
    "Fp8NotUsedWarning",
    "Fp8QuantizationStats",
    "Fp8TensorStats",
    "GpuSpec",
    "LossScale",
    "LossScaleStuckError",
    "NoOpLossScale",
    "OverflowGuard",
    "Policy",
    "PrecisionReport",
    "StaticLossScale",
    "TrainState",
    "all_finite",
    "apply_policy",
    "autocast",
    "check_fp8",
    "default_loss_scale",
    "float32_scope",
    "fp8_dot_general",
    "fp8_quantization_stats",
    "fsdp_loss",
    "fsdp_shardings",
    "get_communication_policy",
    "get_policy",
    "gpu_target_device",
    "hlo_precision_report",
    "on_device",
    "precision_report",
    "scaled_value_and_grad",
    "select_tree",
]
