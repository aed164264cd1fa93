"""The settings of a CIFAR run, and the checks of them that need no JAX.

`TrainConfig` holds everything that defines a run; the command line maps onto
its fields. This module imports nothing heavy (no JAX, Flax or TensorFlow),
so ``python -m experiments.cifar`` answers a mistyped flag before any of them
loads; `experiments.train` uses these and re-exports them.
"""

from __future__ import annotations

import dataclasses
import math

from experiments.flags import unknown_name

# How a policy reaches the model: ``auto`` is ``apply_policy``, which runs the
# model through autocast; ``autocast`` rewrites the plain model's ``apply``.
ROUTES = ("auto", "apply_policy", "autocast")

# The keys of experiments.models.MODELS (tests/test_command_startup.py checks they agree).
MODEL_NAMES = ("mobilenetv2", "resnet101", "resnet152", "resnet18", "resnet34", "resnet50", "resnet_tiny")

# What --precision takes: jaxamp.get_policy's names, each policy with its aliases beside it
# (tests/test_command_startup.py checks that these are exactly the names get_policy knows, and that
# each alias names its policy), and tf32, the one name that is no policy but a matmul precision.
POLICY_NAMES: dict[str, tuple[str, ...]] = {
    "mixed_float16": ("mixed", "mixed_fp16"),
    "mixed_bfloat16": ("mixed_bf16",),
    "mixed_float8": ("mixed_fp8",),
    "mixed_mxfp8": (),
    "mixed_nvfp4": (),
    "float32": ("fp32", "f32", "full"),
    "float16": ("fp16", "f16"),
    "bfloat16": ("bf16",),
    "float64": ("f64",),
    "half": (),
    "bfloat16_nearest": ("bf16_nearest",),
    "bfloat16_stochastic": ("bf16_stochastic",),
    "bfloat16_kahan": ("bf16_kahan",),
    "bfloat16_int8": ("bf16_int8",),
    "bfloat16_fp8": ("bf16_fp8",),
    "bfloat16_int8_per_tensor": ("bf16_int8_per_tensor",),
}
TF32 = "tf32"

# Every name --precision takes without loading jaxamp; any other is a policy spec (p=f32,c=f16,o=f32).
KNOWN_PRECISIONS = (*POLICY_NAMES, *(alias for aliases in POLICY_NAMES.values() for alias in aliases), TF32)

# The CLI's float32 names compute matmuls in true float32; tf32 at JAX's default precision.
FLOAT32_PRECISIONS = {**dict.fromkeys(("float32", *POLICY_NAMES["float32"]), "highest"), TF32: "default"}

PRECISION_CHOICES = """\
  half compute:     mixed_float16 (mixed, mixed_fp16), mixed_bfloat16 (mixed_bf16), mixed_float8 (mixed_fp8)
  Blackwell:        mixed_mxfp8, mixed_nvfp4 (block-scaled matmuls)
  all one dtype:    float32 (fp32, f32, full), float16 (fp16, f16), bfloat16 (bf16), float64 (f64),
                    half (float16; bfloat16 on TPU)
  bfloat16 params:  bfloat16_nearest, bfloat16_stochastic, bfloat16_kahan (each also bf16_...)
  8-bit state:      bfloat16_int8, bfloat16_fp8, bfloat16_int8_per_tensor (each also bf16_...)
  not a policy:     tf32: float32 with JAX's default matmul precision (TF32 on NVIDIA GPUs)
  or a spec:        p=f32,c=f16,o=f32 (keys p, c, o, m, u, state, block: see jaxamp.get_policy)"""
"""The precisions, grouped, each with its aliases: what a mistyped ``--precision`` is answered with."""


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything that defines a run; the CLI flags map onto these fields."""

    model: str = "resnet18"
    precision: str = "mixed"
    loss_scale: str = "default"
    dataset: str = "cifar10"
    data: str = "tfds"
    data_dir: str | None = None
    epochs: int = 2
    batch_size: int = 128
    eval_batch_size: int = 500
    lr: float = 0.1
    momentum: float = 0.9
    weight_decay: float = 5e-4
    warmup_epochs: float = 1.0
    label_smoothing: float = 0.0
    steps_per_epoch: int | None = None
    eval_every: int = 1
    seed: int = 0
    checkpoint_dir: str | None = None
    resume: bool = False
    out: str | None = None
    progress: bool = True
    grad_accum: int = 1
    checkpoint_every: int | None = None
    max_consecutive_skips: int = 50
    max_overflows_at_min_scale: int = 0
    inject_nonfinite: float = 0.0
    route: str = "auto"
    record_overflow: bool = False


def check_precision(name: str) -> str:
    """Returns ``--precision`` `name` if it is a name of `KNOWN_PRECISIONS` or a jaxamp policy spec.

    A name is checked here, at once; a spec (it holds ``=``) loads jaxamp to parse it.

    Raises:
        ValueError: an unknown name (the message names it, the nearest names
            and every valid one, grouped), or jaxamp's for a bad spec.
        TypeError: jaxamp's.
    """
    key = "".join(name.split()).lower()
    if key in KNOWN_PRECISIONS:
        return name
    if "=" not in key:
        raise ValueError(unknown_name("precision", name, KNOWN_PRECISIONS, PRECISION_CHOICES))
    import jaxamp  # pylint: disable=import-outside-toplevel  # loads JAX, so only for a spec

    jaxamp.split_precision(name)
    return name


def parse_loss_scale(spec: str) -> tuple[str, float | None]:
    """Checks ``--loss-scale`` without building anything: ``(kind, static value)``.

    Builds no array, so a flag parser can call it before ``jax.distributed``
    is initialised.

    Raises:
        ValueError: naming the spec and the valid forms.
    """
    key = "".join(spec.split()).lower()
    if key in ("default", "dynamic", "none"):
        return key, None
    if key.startswith("static:"):
        try:
            value = float(key.removeprefix("static:"))
        except ValueError:
            value = math.nan
        if math.isfinite(value) and value > 0:
            return "static", value
    raise ValueError(
        f"Unknown loss scale {spec!r}; choose default, dynamic, none or static:N "
        "with N a positive number (e.g. static:1024)."
    )


def validate_rate(rate: float) -> float:
    """Returns `rate` if it lies in [0, 1); raises ValueError naming it otherwise."""
    if not 0.0 <= rate < 1.0:
        raise ValueError(
            f"--inject-nonfinite {rate!r} must lie in [0, 1): the share of steps whose "
            "gradients become inf or NaN (0 turns injection off; 0.1 is 10%)."
        )
    return rate
