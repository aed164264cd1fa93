"""jaxamp: automatic mixed precision for JAX and Flax.

Precision policies applied to Flax models without editing them, or to any
JAX function with `autocast`; loss scales whose state is a jit-safe pytree;
and a train state that skips the update of any step whose gradients
overflowed. This namespace holds what a training script needs; two
submodules, loaded the first time they are named, hold the rest:

* `jaxamp.diagnostics`: compiled and HLO reports, `check_fp8`, FP8
  quantization statistics, GPU targets compiled for without a GPU, the
  collectives of a sharded program;
* `jaxamp.fsdp`: sharded training with communication dtypes.

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

import importlib as _importlib
import warnings as _warnings

from jaxamp import supported_jax

supported_jax.check()  # before the modules that use JAX's APIs

from jaxamp.finite import all_finite, select_tree
from jaxamp.fp8 import fp8_dot_general
from jaxamp.grads import scaled_value_and_grad
from jaxamp.jaxpr_policy import autocast, float32_scope
from jaxamp.jaxpr_policy.unruled import NoAutocastRuleWarning
from jaxamp.layer_policies import NORMALIZATION_LAYERS
from jaxamp.loss_scale import (
    DynamicLossScale,
    LossScale,
    NoOpLossScale,
    StaticLossScale,
    default_loss_scale,
)
from jaxamp.loss_scaling import LossScalingState, loss_scale_of, loss_scaling
from jaxamp.low_precision_optimizer import low_precision_optimizer
from jaxamp.module_policy import apply_policy
from jaxamp.overflow_guard import LossScaleStuckError, OverflowGuard
from jaxamp.policy import Policy, get_policy
from jaxamp.report import PrecisionReport
from jaxamp.traced_report import precision_report
from jaxamp.train_state import TrainState

__version__ = "0.1.0"

__all__ = [
    "NORMALIZATION_LAYERS",
    "DynamicLossScale",
    "LossScale",
    "LossScaleStuckError",
    "LossScalingState",
    "NoAutocastRuleWarning",
    "NoOpLossScale",
    "OverflowGuard",
    "Policy",
    "PrecisionReport",
    "StaticLossScale",
    "TrainState",
    "all_finite",
    "apply_policy",
    "autocast",
    "default_loss_scale",
    "float32_scope",
    "fp8_dot_general",
    "get_policy",
    "loss_scale_of",
    "loss_scaling",
    "low_precision_optimizer",
    "precision_report",
    "scaled_value_and_grad",
    "select_tree",
]

_SUBMODULES = ("diagnostics", "fsdp")

# Names this namespace had before the diagnostics moved out of the core (jaxamp 0.1):
# name -> the submodule that holds it now.
_MOVED_TO_DIAGNOSTICS = (
    "FP8_FALLBACK_REASONS", "GPU_TARGETS", "Fp8NotUsedWarning", "Fp8QuantizationStats", "Fp8TensorStats",
    "GpuSpec", "check_fp8", "fp8_quantization_stats", "gpu_target_device", "hlo_precision_report", "on_device",
)  # fmt: skip
_MOVED_TO_FSDP = ("CommunicationPolicy", "fsdp_loss", "fsdp_shardings", "get_communication_policy")
_MOVED = {**dict.fromkeys(_MOVED_TO_DIAGNOSTICS, "diagnostics"), **dict.fromkeys(_MOVED_TO_FSDP, "fsdp")}


def __getattr__(name: str):
    """The submodules on first use, and the names that moved to them (with a DeprecationWarning)."""
    if name in _SUBMODULES:
        return _importlib.import_module(f"jaxamp.{name}")
    if name in _MOVED:
        submodule = _MOVED[name]
        _warnings.warn(
            f"jaxamp.{name} moved to jaxamp.{submodule}.{name}: write jaxamp.{submodule}.{name} "
            f"(or `from jaxamp.{submodule} import {name}`). The old name goes away in a later release.",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(_importlib.import_module(f"jaxamp.{submodule}"), name)
    raise AttributeError(f"module 'jaxamp' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*__all__, *_SUBMODULES, "__version__"])
