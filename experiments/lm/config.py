"""The settings of one language-model run, and their validation.

`LMConfig` holds everything that defines a run; the command line maps onto
its fields. `validate` checks them all before anything loads or compiles,
so a bad value costs no time and names itself.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

# No JAX or Flax here: `python -m experiments.lm` parses its flags (defaults and choices from this
# module) before they load. What needs them imports them where it is used.
from experiments import config as cifar_config
from experiments.lm import data as data_lib

if TYPE_CHECKING:
    import jaxamp

ROUTES = ("apply_policy", "autocast")
SHARDING = ("fsdp", "replicated")
ATTENTION_CHOICES = ("auto", "cudnn", "xla", "einsum")

# NVFP4's recipe (mixed_nvfp4) in full, or without one of its tools: jaxamp.fp8.block_recipe's options.
BLOCK_RECIPES: dict[str, dict[str, bool]] = {
    "full": {},
    "no-hadamard": {"hadamard": False},
    "nearest-gradients": {"stochastic_gradients": False},
    "1d-weights": {"two_d_weights": False},
}


@dataclasses.dataclass(frozen=True)
class GPTSize:
    """The shape of a model: depth, width, heads and context length."""

    num_layers: int
    d_model: int
    num_heads: int
    context: int

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads


SIZES: dict[str, GPTSize] = {
    # For tests and the quick run: a few seconds per hundred steps on a CPU core.
    "tiny": GPTSize(num_layers=2, d_model=64, num_heads=4, context=64),
    # For CPU parity runs: about 0.8M parameters.
    "small": GPTSize(num_layers=4, d_model=128, num_heads=4, context=128),
    # GPT-2 small (124M parameters with GPT-2's vocabulary of 50304, padded).
    "gpt2": GPTSize(num_layers=12, d_model=768, num_heads=12, context=1024),
}


@dataclasses.dataclass(frozen=True)
class LMConfig:
    """One run: a model size under one precision and route, on one corpus."""

    model: str = "tiny"
    precision: str = "fp32"
    route: str = "apply_policy"
    attention: str = "auto"
    loss_scale: str = "default"
    data: str = "stdlib"  # or "synthetic", or "tfds:NAME[:FEATURE]"
    data_dir: str | None = None  # *.py files for stdlib; the TFDS data dir for tfds:...
    vocab_size: int | None = None  # None: the corpus's own (256 for bytes)
    context: int | None = None  # None: the model size's
    batch_size: int = 16
    steps: int = 200
    lr: float = 3e-3
    warmup_steps: int = 20
    weight_decay: float = 0.1
    clip_norm: float = 1.0
    eval_every: int = 50
    eval_batches: int = 4
    seed: int = 0
    sharding: str = "fsdp"
    gather_dtype: str | None = None  # None (and reduce_dtype None): plain jit with shardings
    reduce_dtype: str | None = None
    progress: bool = True
    record_overflow: bool = False  # keep the last skipped step's OverflowRecord in the state
    scan_layers: bool = False  # one block scanned over the layers, its params stacked (GPT.scan_layers)
    block_recipe: str = "full"  # mixed_nvfp4's recipe: a key of BLOCK_RECIPES

    @property
    def communicates_explicitly(self) -> bool:
        """Whether the dtypes of the gathers and reductions are stated (`jaxamp.fsdp.fsdp_loss`)."""
        return self.gather_dtype is not None or self.reduce_dtype is not None

    @property
    def sequence_length(self) -> int:
        return self.context or SIZES[self.model].context


class ConfigError(ValueError):
    """A setting is invalid; the message names it, its value and the valid choices."""


def validate(config: LMConfig) -> None:
    """Checks every setting.

    Raises:
        ConfigError: naming the flag, the bad value and what is valid.
    """

    def fail(flag, value, valid):
        raise ConfigError(f"{flag} {value!r} is invalid: expected {valid}.")

    def is_int(value):
        return isinstance(value, int) and not isinstance(value, bool)

    for name in ("batch_size", "steps", "eval_every", "eval_batches"):
        value = getattr(config, name)
        if not (is_int(value) and value >= 1):
            fail(f"--{name.replace('_', '-')}", value, "an integer >= 1")
    if not (is_int(config.warmup_steps) and config.warmup_steps >= 0):
        fail("--warmup-steps", config.warmup_steps, "an integer >= 0")
    for name in ("lr", "clip_norm"):
        value = getattr(config, name)
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            fail(f"--{name.replace('_', '-')}", value, "a finite number > 0")
    if not (isinstance(config.weight_decay, (int, float)) and 0 <= config.weight_decay < math.inf):
        fail("--weight-decay", config.weight_decay, "a finite number >= 0")
    if config.model not in SIZES:
        fail("--model", config.model, f"one of {', '.join(SIZES)}")
    if config.route not in ROUTES:
        fail("--route", config.route, f"one of {', '.join(ROUTES)}")
    if config.attention not in ATTENTION_CHOICES:
        fail("--attention", config.attention, f"one of {', '.join(ATTENTION_CHOICES)}")
    if config.block_recipe not in BLOCK_RECIPES:
        fail("--block-recipe", config.block_recipe, f"one of {', '.join(BLOCK_RECIPES)}")
    try:
        data_lib.parse_source(config.data)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    if config.sharding not in SHARDING:
        fail("--sharding", config.sharding, f"one of {', '.join(SHARDING)}")
    if config.vocab_size is not None and not (is_int(config.vocab_size) and config.vocab_size >= 2):
        fail("--vocab-size", config.vocab_size, "an integer >= 2")
    if config.vocab_size not in (None, 256) and config.data != "synthetic":
        fail(
            "--vocab-size",
            config.vocab_size,
            f"256 (or nothing) with --data {config.data}, whose tokens are bytes",
        )
    limit = SIZES[config.model].context
    if config.context is not None and not (is_int(config.context) and 1 <= config.context <= limit):
        valid = f"an integer from 1 to {limit}, the context of --model {config.model}"
        fail("--context", config.context, valid)
    try:
        cifar_config.check_precision(config.precision)
        cifar_config.parse_loss_scale(config.loss_scale)
    except (ValueError, TypeError) as error:
        raise ConfigError(str(error)) from None
    if config.communicates_explicitly:
        from experiments.train import resolve_precision  # pylint: disable=import-outside-toplevel

        communication_policy(config, resolve_precision(config.precision).policy)


def default_route(precision: str) -> str:
    """The route a precision takes when ``--route`` is left out: ``apply_policy``.

    `jaxamp.apply_policy` runs the model through `jaxamp.autocast`, FP8
    policies (``mixed_float8``) included; ``--route autocast`` applies
    autocast to the loss of the plain model instead.

    Raises:
        ConfigError: `precision` names no precision.
    """
    try:
        cifar_config.check_precision(precision)
    except (ValueError, TypeError) as error:
        raise ConfigError(str(error)) from None
    return "apply_policy"


def communication_policy(config: LMConfig, policy: jaxamp.Policy):
    """The `jaxamp.fsdp.CommunicationPolicy` of ``--gather-dtype`` and ``--reduce-dtype``.

    A dtype left out is the parameter's own. Reducing gradients in a dtype
    narrower than the params' is refused here, before anything compiles.
    An FP8 gather dtype (``float8_e4m3fn``) gathers the weights of matmuls in
    FP8 and dequantizes them into the policy's compute dtype.

    Raises:
        ConfigError: the flags need FSDP sharding or a jaxamp with
            `jaxamp.fsdp.fsdp_loss`, name no dtype, or narrow the reduction.
    """
    import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

    import jaxamp  # pylint: disable=import-outside-toplevel

    if config.sharding != "fsdp":
        raise ConfigError(
            f"--gather-dtype and --reduce-dtype need --sharding fsdp, not {config.sharding!r}: "
            "a replicated state is never gathered."
        )
    if not hasattr(jaxamp, "fsdp"):
        raise ConfigError(
            "--gather-dtype and --reduce-dtype need jaxamp's mixed-precision communication "
            "(jaxamp.fsdp.fsdp_loss), which this jaxamp lacks; leave them out to let XLA communicate "
            "in the params' dtype."
        )
    try:
        communication = jaxamp.fsdp.CommunicationPolicy(
            gather_dtype=config.gather_dtype or "param", reduce_dtype=config.reduce_dtype or "param"
        )
        if communication.fp8_gathers:
            # FP8 weights are dequantized into the dtype the model computes in.
            communication = dataclasses.replace(communication, dequantize_dtype=policy.compute_dtype)
    except (ValueError, TypeError) as error:
        raise ConfigError(str(error)) from None
    from jaxamp.fsdp import is_narrower

    param_dtype = jnp.dtype(policy.param_dtype)
    reduce_dtype = communication.reduce_dtype_for(param_dtype)
    if is_narrower(reduce_dtype, param_dtype):
        raise ConfigError(
            f"--reduce-dtype {config.reduce_dtype!r} is narrower than the params' {param_dtype.name}: "
            f"each device's gradient would be rounded to {reduce_dtype.name} before the sum. Use "
            f"--reduce-dtype {param_dtype.name} or leave it out."
        )
    return communication
