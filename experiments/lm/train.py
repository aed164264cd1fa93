"""Training a GPT-style language model with jaxamp: the recipe.

Read top to bottom, this is the whole recipe:

1. `experiments.train.resolve_precision` (shared with the CIFAR recipe) turns
   ``--precision`` into a `jaxamp.Policy` and a matmul precision.
2. `create_train_state` builds the model (`experiments.lm.model`) and a
   `jaxamp.TrainState` with AdamW (warm-up, cosine decay, gradient clipping)
   and the policy's loss scale. On the ``apply_policy`` route the model is
   wrapped with `jaxamp.apply_policy`.
3. `make_loss_fn` is the next-token cross-entropy in float32; on the
   ``autocast`` route the plain model's loss runs under `jaxamp.autocast`.
   `make_train_step` differentiates it through the loss scale with
   `jaxamp.scaled_value_and_grad`, and `TrainState.apply_gradients` skips a
   step whose gradients overflowed.
4. `train_and_evaluate` shards the state over the devices
   (`experiments.lm.sharding`; with ``--gather-dtype``/``--reduce-dtype``
   the loss runs under `jaxamp.fsdp.fsdp_loss`, which gathers params and sums
   gradients in those dtypes), compiles the steps ahead of time, feeds each
   process only its rows of each batch (`experiments.lm.data`), and
   evaluates the held-out loss every ``--eval-every`` steps.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxamp
from experiments import interrupts
from experiments.distributed import host_value
from experiments.lm import data as data_lib
from experiments.lm import figures
from experiments.lm import model as model_lib
from experiments.lm.config import BLOCK_RECIPES, LMConfig, communication_policy, validate
from experiments.lm.sharding import Sharding
from experiments.progress import Progress
from experiments.results import skipped_steps_line, state_checksum, state_finite
from experiments.train import Precision, resolve_loss_scale, resolve_precision


def create_model(config: LMConfig, precision: Precision, vocab_size: int, platform: str):
    """The model (policy-wrapped on the ``apply_policy`` route) and its attention choice.

    Under ``mixed_nvfp4`` the output head (the token embedding's ``attend``)
    runs in bfloat16, as NVIDIA's NVFP4 recipe keeps it (`high_precision_layers`).
    """
    size = model_lib.SIZES[config.model]
    policy = precision.policy
    attention = model_lib.choose_attention(config.attention, platform, policy.compute_dtype, size.head_dim)
    model = model_lib.create_model(config.model, vocab_size, attention, scan_layers=config.scan_layers)
    if config.route == "apply_policy":
        model = jaxamp.apply_policy(model, precision.policy, overrides=high_precision_layers(precision.policy))
    return model, attention


def high_precision_layers(policy: jaxamp.Policy) -> dict:
    """The layers a policy's recipe keeps in bfloat16: NVFP4's output head, none otherwise."""
    return {nn.Embed: "mixed_bf16"} if policy.matmul_format == "nvfp4" else {}


def create_optimizer(config: LMConfig) -> optax.GradientTransformation:
    """AdamW (beta2 0.95, as GPT-2 reproductions use), warm-up then cosine to a tenth, clipped.

    Weight decay applies to the weights (kernels, the token and position
    embeddings: `decays_weight`), not to biases and LayerNorm scales. A
    precision that names an update rounding (``bfloat16_kahan``) wraps it in
    `jaxamp.low_precision_optimizer`.
    """
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=config.lr,
        warmup_steps=min(config.warmup_steps, config.steps - 1),
        decay_steps=config.steps,
        end_value=config.lr / 10,
    )
    adamw = optax.chain(
        optax.clip_by_global_norm(config.clip_norm),
        optax.adamw(
            schedule,
            b1=0.9,
            b2=0.95,
            weight_decay=config.weight_decay,
            mask=lambda params: jax.tree_util.tree_map_with_path(
                lambda path, _: decays_weight(path), params
            ),
        ),
    )
    return resolve_precision(config.precision).optimizer(adamw, key=config.seed)


def decays_weight(path) -> bool:
    """Whether AdamW decays the param at `path` (a key path of the params): all but biases and
    LayerNorm scales, by name, so that a bias of more than one dimension (the attention's
    ``(3, heads, head_dim)``) or one stacked over scanned layers is not decayed."""
    name = getattr(path[-1], "key", getattr(path[-1], "name", None)) if path else None
    return name not in ("bias", "scale")


def model_for_init(model):
    """The model that creates the params: `model`, with the ``einsum`` attention in place of ``cudnn``.

    ``init`` runs the model as written, in float32, and cuDNN's attention
    takes half operands only; the params are the same for every attention.
    Under `jaxamp.apply_policy` or `jaxamp.autocast` the model is traced in
    the compute dtype, so the train step runs cuDNN with float32 params.
    """
    inner = getattr(model, "module", model)  # an apply_policy model wraps the GPT
    if getattr(inner, "attention", None) != "cudnn":
        return model
    einsum = inner.clone(attention="einsum")
    return model.clone(module=einsum) if inner is not model else einsum


def create_train_state(
    config: LMConfig, precision: Precision, model, context: int, tx: optax.GradientTransformation
) -> jaxamp.TrainState:
    """Initializes params from ``config.seed`` and builds the `jaxamp.TrainState` around `tx`."""
    sample = jnp.zeros((1, context), jnp.int32)
    params = model_for_init(model).init(jax.random.key(config.seed), sample)["params"]
    params = precision.policy.cast_to_param(params)  # the autocast route's plain model makes float32
    return jaxamp.TrainState.create(
        apply_fn=model.apply,
        params=params,
        tx=tx,
        loss_scale=resolve_loss_scale(config.loss_scale, precision.policy),
    )


def token_losses(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Per-token cross-entropy in float32, natural log (nats)."""
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)


def make_loss_fn(apply_fn: Callable, route: str, policy: jaxamp.Policy) -> Callable:
    """Returns ``loss_fn(params, windows)`` → mean next-token loss (float32).

    `windows` are int32 [B, T + 1]: the model reads the first T tokens and
    predicts the last T. On the ``autocast`` route the whole loss, the plain
    model's apply included, runs under `jaxamp.autocast`.
    """

    def loss_fn(params, windows):
        logits = apply_fn({"params": params}, windows[:, :-1])
        return token_losses(logits, windows[:, 1:]).mean()

    return jaxamp.autocast(loss_fn, policy) if route == "autocast" else loss_fn


def make_train_step(loss_fn: Callable, record_overflow: bool = False) -> Callable:
    """Returns ``train_step(state, windows)`` → ``(state, loss)``.

    With `record_overflow` the step takes its `jaxamp.diagnostics.OverflowRecord`
    and the state keeps the last skipped step's (``state.overflow_record``).
    """

    def train_step(state, windows):
        value_and_grad = jaxamp.scaled_value_and_grad(
            loss_fn, state.loss_scale, record_overflow=record_overflow
        )
        loss, grads, grads_finite, *record = value_and_grad(state.params, windows)
        state = state.apply_gradients(
            grads=grads, grads_finite=grads_finite, overflow_record=record[0] if record else None
        )
        return state, loss

    return train_step


def make_eval_step(loss_fn: Callable) -> Callable:
    """Returns ``eval_step(state, windows)`` → the batch's mean loss, under the training policy."""

    def eval_step(state, windows):
        return loss_fn(state.params, windows)

    return eval_step


@dataclasses.dataclass
class Compiled:
    """The run's compiled programs and what compiling them cost."""

    init: Any
    train_step: Any
    eval_step: Any
    compile_s: dict[str, float]
    train_step_program: str  # the train step as lowered, before XLA partitions and optimizes it


def initial_state_fn(config, precision, model, context: int, tx, train_step: Callable, windows) -> Callable:
    """The function that creates the run's first state.

    With ``config.record_overflow`` the state holds a cleared overflow record
    of the step's sites (found by tracing `train_step` once, without running
    it), so the state keeps one structure from the first step on.
    """

    def create():
        return create_train_state(config, precision, model, context, tx)

    if not config.record_overflow:
        return create
    cleared = jax.eval_shape(create).with_overflow_record_of(train_step, windows).overflow_record
    return lambda: create().replace(overflow_record=cleared)


def compile_steps(config, precision, model, sharding: Sharding, context: int) -> Compiled:
    """Compiles state creation, the train step and the eval step ahead of time.

    The state is created inside ``jit`` with its sharded layout as output, so
    no process ever holds a full copy; the steps keep that layout
    (``donate`` reuses the old state's memory).
    """
    tx = create_optimizer(config)  # one instance: the state's tree structure includes it
    windows = jax.ShapeDtypeStruct((config.batch_size, context + 1), jnp.int32, sharding=sharding.batch)
    loss_fn = make_loss_fn(model.apply, config.route, precision.policy)
    if config.communicates_explicitly:
        # Gathers and gradient sums in the stated dtypes, written into the
        # program (`jaxamp.fsdp.fsdp_loss`), instead of what XLA's partitioner picks.
        loss_fn = jaxamp.fsdp.fsdp_loss(
            loss_fn, sharding.mesh, communication_policy(config, precision.policy)
        )
    train_step_fn = make_train_step(loss_fn, config.record_overflow)
    with precision.context():
        initial_state = initial_state_fn(config, precision, model, context, tx, train_step_fn, windows)
    abstract_state = jax.eval_shape(initial_state)
    state_sharding = sharding.state(abstract_state)
    state_arg = jax.tree.map(
        lambda leaf, where: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=where),
        abstract_state,
        state_sharding,
    )
    times = {}
    with precision.context(), jaxamp.fp8.block_recipe(**BLOCK_RECIPES[config.block_recipe]):
        start = time.perf_counter()
        init = jax.jit(initial_state, out_shardings=state_sharding).lower().compile()
        times["init"] = time.perf_counter() - start
        start = time.perf_counter()
        lowered = jax.jit(
            train_step_fn, out_shardings=(state_sharding, sharding.replicated), donate_argnums=0
        ).lower(state_arg, windows)
        train_step = lowered.compile()
        times["train_step"] = time.perf_counter() - start
        start = time.perf_counter()
        eval_step = (
            jax.jit(make_eval_step(loss_fn), out_shardings=sharding.replicated)
            .lower(state_arg, windows)
            .compile()
        )
        times["eval_step"] = time.perf_counter() - start
    return Compiled(init, train_step, eval_step, times, lowered.as_text(dialect="hlo"))


def evaluate(compiled: Compiled, state, batches: list[jax.Array]) -> float:
    """Mean held-out loss (nats per token) over the fixed held-out batches."""
    losses = [compiled.eval_step(state, batch) for batch in batches]
    return float(np.mean([host_value(loss) for loss in losses]))


def train_and_evaluate(
    config: LMConfig,
    corpus: data_lib.Corpus | None = None,
    log: Callable[[str], None] = print,
    on_record: Callable[[dict[str, Any]], None] | None = None,
    sharding: Sharding | None = None,
) -> dict[str, Any]:
    """Trains one model under one precision and route; returns the run's results.

    Args:
        config: the run's settings.
        corpus: the tokens; loaded from `config` when None.
        log: where the per-evaluation lines go.
        on_record: called with the results so far after every evaluation
            (to rewrite the results file as the run goes).
        sharding: where state and batches live; all devices, as
            ``config.sharding`` says, when None.

    Returns:
        ``config``, the attention used, compile times, step cost, every
        evaluation (step, train seconds so far, train and held-out loss,
        held-out bits per byte, loss scale, skipped steps) and a summary.

    Raises:
        experiments.lm.config.ConfigError: an invalid setting.
        experiments.lm.data.DataUnavailableError: the corpus is missing or too small.
        experiments.distributed.DistributedSetupError: the batch does not
            split over the devices.
    """
    validate(config)
    precision = resolve_precision(config.precision)
    sharding = sharding or Sharding.over_all_devices(config.sharding)
    sharding.check_batch_size(config.batch_size)
    corpus = corpus or data_lib.load_corpus(
        config.data,
        config.data_dir,
        config.vocab_size or 256,
        config.seed,
        jax.process_index(),
        jax.process_count(),
    )
    context = config.sequence_length
    data_lib.check_fits(corpus, context)
    vocab_size = config.vocab_size or corpus.vocab_size
    model, attention = create_model(config, precision, vocab_size, jax.devices()[0].platform)
    compiled = compile_steps(config, precision, model, sharding, context)

    rows = sharding.process_rows(config.batch_size)

    def batch(tokens, offsets):
        return sharding.global_batch(data_lib.batch_rows(tokens, offsets, context, rows), config.batch_size)

    held_out = data_lib.held_out_offsets(
        corpus.held_out.size, config.eval_batches * config.batch_size, context
    )
    held_out_batches = [
        batch(corpus.held_out, held_out[start : start + config.batch_size])
        for start in range(0, held_out.size, config.batch_size)
    ]
    tokens_per_step = config.batch_size * context
    results: dict[str, Any] = {
        "config": dataclasses.asdict(config),
        "precision": {
            "policy": precision.describe(),
            "matmul_precision": precision.matmul_precision,
        },
        "attention": attention,
        "corpus": corpus.description,
        "context": context,
        "vocab_size": vocab_size,
        "num_params": model_lib.num_params(model_lib.SIZES[config.model], vocab_size),
        "compile_s": compiled.compile_s,
        "cost": figures.step_cost(compiled.train_step, sharding.device_count, compiled.train_step_program),
        "analytic_flops_per_step": model_lib.model_flops_per_token(
            model_lib.SIZES[config.model], vocab_size, context
        )
        * tokens_per_step,
        "evaluations": [],
    }
    log(
        f"{config.model} ({results['num_params']:,} params) | {config.precision} via {config.route} | "
        f"attention {attention} | {jax.devices()[0].device_kind} x{sharding.device_count} | compile "
        f"{sum(compiled.compile_s.values()):.1f}s"
    )

    state = compiled.init()
    train_s, pending = 0.0, []
    progress: Progress | None = None  # drawn from the first step on; record(0) comes before it

    def record(step: int) -> None:
        nonlocal pending
        # None before the first step: JSON has no NaN.
        train_loss = float(np.mean([host_value(loss) for loss in pending])) if pending else None
        pending = []
        held_out_loss = evaluate(compiled, state, held_out_batches)
        entry = {
            "step": step,
            "train_time_s": train_s,
            "train_loss": train_loss,
            "held_out_loss": held_out_loss,
            "held_out_bits_per_byte": held_out_loss / math.log(2),
            "loss_scale": float(host_value(state.loss_scale.loss_scale)),
            "skipped_steps": int(host_value(state.skipped_steps)),
        }
        previous = results["evaluations"][-1]["skipped_steps"] if results["evaluations"] else 0
        skipped_line = skipped_steps_line(state, entry["skipped_steps"] - previous)
        if skipped_line:
            entry["last_skipped_step"] = skipped_line
        results["evaluations"].append(entry)
        lines = [format_evaluation(entry, config.steps)] + ([f"  {skipped_line}"] if skipped_line else [])
        for line in lines:
            if progress is None:
                log(line)
            else:
                progress.write(line, log)
        if on_record:
            interrupts.stop_if_interrupted()
            on_record(results)

    record(0)
    description = f"{config.precision} seed {config.seed}"
    progress = Progress(config.steps, description, config.progress, tokens_per_step, rate_name="tokens_s")
    start = time.perf_counter()
    for step in range(1, config.steps + 1):
        interrupts.stop_if_interrupted()
        offsets = data_lib.batch_offsets(corpus.train.size, config.batch_size, context, config.seed, step)
        state, loss = compiled.train_step(state, batch(corpus.train, offsets))
        pending.append(loss)
        progress.update(step, loss)
        if step % config.eval_every == 0 or step == config.steps:
            state = jax.block_until_ready(state)
            train_s += time.perf_counter() - start
            record(step)
            start = time.perf_counter()
    progress.close()

    final = results["evaluations"][-1]
    results["summary"] = {
        "held_out_bits_per_byte": final["held_out_bits_per_byte"],
        "held_out_loss": final["held_out_loss"],
        "train_time_s": train_s,
        "steps": config.steps,
        "skipped_steps": final["skipped_steps"],
        "loss_scale": final["loss_scale"],
        "peak_memory_bytes": figures.peak_memory(),
        "state_finite": state_finite(state),
        "state_checksum": state_checksum(state),
        **figures.throughput(
            results["cost"]["flops_per_step"],
            tokens_per_step,
            train_s / config.steps,
            config.precision,
            # The heavy math's dtype: FP8 policies' matmuls run at the FP8 peak.
            precision.policy.matmul_dtype or precision.policy.compute_dtype,
        ),
    }
    prefix = f"[process {jax.process_index()}] " if jax.process_count() > 1 else ""
    log(f"{prefix}state checksum {results['summary']['state_checksum'][:16]}")
    return results


def format_evaluation(entry: dict[str, Any], steps: int) -> str:
    """The one line printed at each evaluation.

    Its train loss is the mean over the steps since the last evaluation (``mean
    loss``); the progress bar's ``step_loss`` is one recent step's.
    """
    train_loss = "-" if entry["train_loss"] is None else f"{entry['train_loss']:.4f}"
    return (
        f"step {entry['step']:>5}/{steps} | train {entry['train_time_s']:7.1f}s mean loss {train_loss}"
        f" | held-out {entry['held_out_bits_per_byte']:.4f} bits/byte | loss scale {entry['loss_scale']:g}"
        f" | skipped {entry['skipped_steps']}"
    )
