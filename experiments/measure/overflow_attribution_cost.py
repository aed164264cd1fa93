"""What overflow attribution costs a train step: CPU step time and, compiled for an H200, bytes moved.

Three versions of one `mixed_float16` train step (`jaxamp.apply_policy`,
`jaxamp.scaled_value_and_grad`, `jaxamp.TrainState.apply_gradients`, Adam,
a dynamic loss scale), which differ only in what they record:

* ``none``: no attribution (the state's ``nonfinite_grads`` set to None);
* ``leaves``: the gradient attribution, always on in a `TrainState` (one bool
  per parameter leaf, `jaxamp.diagnostics.NonFiniteGradients`);
* ``leaves+record``: also ``record_overflow=True`` (each matmul's and
  convolution's amax forward and backward, `jaxamp.diagnostics.OverflowRecord`).

On this CPU, for an MLP and a small CNN (the quick benchmark's kinds of
model), each step is timed in interleaved rounds (one step of each version in
turn per round, `experiments.benchmark.timing`) and the median is printed as
a ratio to ``none``. Compiled for an H200 target without a GPU (the CUDA
plugin must be installed; the part is skipped otherwise), the CIFAR ResNet18
step at batch 128 and the GPT-2 124M step at batch 8, context 1024, are
compiled in the three versions and their bytes moved
(`jaxamp.diagnostics.bytes_accessed` of the optimized program) and temporary
memory printed as ratios to ``none``; nothing runs there. ``--skip-gpu``
leaves the H200 part out; ``--skip-gpt2`` the GPT-2 step. Writes
overflow_attribution_cost.txt.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import jaxamp
from experiments.benchmark.timing import interleaved_medians
from experiments.flags import positive_int
from experiments.lm import config as lm_config
from experiments.lm import model as lm_model
from experiments.measure.gpu_target import compile_for, target_device
from experiments.measure.markdown import table
from experiments.models import create_model

VERSIONS = ("none", "leaves", "leaves+record")


def add_arguments(parser) -> None:
    parser.add_argument(
        "--rounds", type=positive_int, default=60, help="interleaved timing rounds on the CPU"
    )
    parser.add_argument("--skip-gpu", action="store_true", help="leave out the H200-target compiles")
    parser.add_argument("--skip-gpt2", action="store_true", help="leave out the GPT-2 124M compile")


def make_step(version: str, train: bool | None):
    """The train step of `version`; `train` is the model's ``train`` argument (None: it takes none)."""
    record = version == "leaves+record"

    def step(state, x, labels):
        def loss_fn(params):
            variables = {
                "params": params,
                **({"batch_stats": state.batch_stats} if state.batch_stats else {}),
            }
            if state.batch_stats:
                logits, _ = state.apply_fn(variables, x, train=True, mutable=["batch_stats"])
            elif train is None:
                logits = state.apply_fn(variables, x)
            else:
                logits = state.apply_fn(variables, x, train=train)
            return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

        outputs = jaxamp.scaled_value_and_grad(loss_fn, state.loss_scale, record_overflow=record)(
            state.params
        )
        loss, grads, finite = outputs[:3]
        state = state.apply_gradients(grads=grads, grads_finite=finite)
        return state, (loss, outputs[3]) if record else loss

    return step


def make_state(model, variables, version: str):
    state = jaxamp.TrainState.create(
        apply_fn=model.apply,
        params=variables["params"],
        tx=optax.adam(1e-3),
        loss_scale=jaxamp.DynamicLossScale(),
        batch_stats=variables.get("batch_stats"),
    )
    return state.replace(nonfinite_grads=None) if version == "none" else state


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        for _ in range(3):
            x = nn.relu(nn.Dense(512)(x))
        return nn.Dense(10)(x)


def cpu_rows(rounds: int):
    """Per model: median ms of ``none`` and the other versions' ratios to it."""
    cpu_models = {
        "MLP 784-512x3-10": (MLP(), jnp.ones((128, 784)), None),
        "resnet_tiny (CNN)": (create_model("resnet_tiny"), jnp.ones((32, 32, 32, 3)), True),
    }
    for name, (module, x, train) in cpu_models.items():
        model = jaxamp.apply_policy(module, "mixed_float16")
        kwargs = {} if train is None else {"train": False}
        variables = model.init(jax.random.key(0), x, **kwargs)
        labels = jnp.zeros(x.shape[0], jnp.int32)
        steps = {}
        for version in VERSIONS:
            state = make_state(model, variables, version)
            compiled = jax.jit(make_step(version, train)).lower(state, x, labels).compile()
            steps[version] = lambda compiled=compiled, state=state, x=x, labels=labels: compiled(
                state, x, labels
            )
        print(f"  timing {name}: {rounds} rounds", flush=True)
        medians = interleaved_medians(steps, rounds=rounds, steps=1, warmup=1)
        none = medians["none"]
        yield [
            name,
            x.shape[0],
            f"{none * 1e3:.2f}",
            f"{medians['leaves'] / none:.3f}x",
            f"{medians['leaves+record'] / none:.3f}x",
        ]


def gpu_rows(skip_gpt2: bool):
    """Per step compiled for an H200: ``none``'s bytes moved and temp memory, the other versions' ratios."""
    device = target_device("h200")
    gpu_models = {"ResNet18, batch 128": (create_model("resnet18"), (128, 32, 32, 3), jnp.float32, True)}
    if not skip_gpt2:
        gpu_models["GPT-2 124M, batch 8 x 1024"] = (
            lm_model.GPT(vocab_size=50304, size=lm_config.SIZES["gpt2"], attention="xla"),
            (8, 1024),
            jnp.int32,
            None,
        )
    for name, (module, shape, dtype, train) in gpu_models.items():
        model = jaxamp.apply_policy(module, "mixed_float16")
        x = jax.ShapeDtypeStruct(shape, dtype)
        kwargs = {} if train is None else {"train": False}
        variables = jax.eval_shape(
            lambda model=model, shape=shape, dtype=dtype, kwargs=kwargs: model.init(
                jax.random.key(0), jnp.zeros(shape, dtype), **kwargs
            )
        )
        labels = jax.ShapeDtypeStruct(shape if train is None else shape[:1], jnp.int32)
        figures = {}
        for version in VERSIONS:
            state = jax.eval_shape(
                lambda model=model, variables=variables, version=version: make_state(
                    model, variables, version
                )
            )
            program = compile_for(make_step(version, train), (state, x, labels), device)
            figures[version] = (
                jaxamp.diagnostics.bytes_accessed(program.text),
                program.compiled.memory_analysis().temp_size_in_bytes,
            )
            print(f"  compiled {name} / {version} in {program.seconds:.0f} s", flush=True)
        base_bytes, base_temp = figures["none"]
        yield [
            name,
            f"{base_bytes / 1e9:.2f}",
            f"{figures['leaves'][0] / base_bytes:.4f}x",
            f"{figures['leaves+record'][0] / base_bytes:.4f}x",
            f"{base_temp / 2**30:.2f}",
            f"{figures['leaves'][1] / base_temp:.4f}x",
            f"{figures['leaves+record'][1] / base_temp:.4f}x",
        ]


def run(args, out) -> None:
    out.print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, {args.rounds} interleaved rounds")
    out.print()
    out.print("CPU step time, median of interleaved rounds, as a ratio to 'none':")
    out.print()
    rows = list(cpu_rows(args.rounds))
    out.print(table(["model", "batch", "none ms", "leaves", "leaves+record"], rows, "lrrrr").rstrip())
    if not args.skip_gpu:
        out.print()
        if jaxamp.diagnostics.cuda_plugin_available():
            rows = list(gpu_rows(args.skip_gpt2))
            out.print(
                "Compiled for an H200 (nothing runs): bytes moved and temp memory, as ratios to 'none':"
            )
            out.print()
            header = [
                "step",
                "none GB moved",
                "leaves",
                "leaves+record",
                "none temp GiB",
                "leaves",
                "leaves+record",
            ]
            out.print(table(header, rows).rstrip())
        else:
            out.print("H200 target: skipped (the jax-cuda12-plugin is not installed).")
    out.save_printed("overflow_attribution_cost.txt")
