"""jaxamp: automatic mixed precision for JAX and Flax.

Precision policies applied to Flax models without editing them, or to any
JAX function with `autocast`; loss scales whose state is a jit-safe pytree;
and a train state that skips the update of any step whose gradients
overflowed. This namespace holds what a training script needs; three
public submodules hold the rest (the first two are loaded the first time
they are named):

* `jaxamp.diagnostics`: compiled and HLO reports, `check_fp8`, FP8
  quantization statistics, GPU targets compiled for without a GPU, the
  collectives of a sharded program, why a step was skipped;
* `jaxamp.fsdp`: sharded training with communication dtypes;
* `jaxamp.fp8`: FP8's building blocks and delayed scaling.

Every other module is private (its name starts with an underscore) and may
change without notice.

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

from jaxamp import _supported_jax

_supported_jax.check()  # before the modules that use JAX's APIs

from jaxamp._autocast.primitives import NoAutocastRuleWarning
from jaxamp._autocast.scope import float32_scope
from jaxamp._autocast.transform import autocast
from jaxamp._finite import all_finite, select_tree
from jaxamp._flax.apply import apply_policy
from jaxamp._flax.layers import NORMALIZATION_LAYERS
from jaxamp._optimizer.low_precision import low_precision_optimizer
from jaxamp._optimizer.storage import OptimizerStorage, optimizer_for_policy, split_precision
from jaxamp._policy import Policy, get_policy
from jaxamp._precision_report import precision_report
from jaxamp._report import PrecisionReport
from jaxamp._scaling.grads import scaled_value_and_grad
from jaxamp._scaling.guard import LossScaleStuckError, OverflowGuard
from jaxamp._scaling.loss_scale import (
    DynamicLossScale,
    LossScale,
    NoOpLossScale,
    StaticLossScale,
    default_loss_scale,
)
from jaxamp._scaling.loss_scaling import LossScalingState, loss_scale_of, loss_scaling
from jaxamp._scaling.nnx_training import NNXOptimizer
from jaxamp._scaling.train_state import TrainState
from jaxamp.fp8 import fp8_dot_general

__version__ = "0.1.0"

__all__ = [
    "NORMALIZATION_LAYERS",
    "DynamicLossScale",
    "LossScale",
    "LossScaleStuckError",
    "LossScalingState",
    "NNXOptimizer",
    "NoAutocastRuleWarning",
    "NoOpLossScale",
    "OptimizerStorage",
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
    "optimizer_for_policy",
    "precision_report",
    "scaled_value_and_grad",
    "select_tree",
    "split_precision",
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
