"""What overflow attribution costs a train step: CPU step time and, compiled for an H200, bytes moved.

    JAX_PLATFORMS=cpu python scripts/overflow_attribution_cost.py > results/cpu/overflow_attribution_cost.txt

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
turn per round) and the median is printed as a ratio to ``none``. Compiled
for an H200 target without a GPU (the CUDA plugin must be installed; the
part is skipped otherwise), the CIFAR ResNet18 step at batch 128 and the
GPT-2 124M step at batch 8, context 1024, are compiled in the three versions
and their bytes moved (`jaxamp.diagnostics.bytes_accessed` of the optimized
program) and temporary memory printed as ratios to ``none``; nothing runs
there. ``--skip-gpu`` leaves the H200 part out; ``--skip-gpt2`` the GPT-2 step.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

VERSIONS = ("none", "leaves", "leaves+record")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--rounds", type=int, default=60, help="interleaved timing rounds on the CPU (default 60)"
    )
    parser.add_argument("--skip-gpu", action="store_true", help="leave out the H200-target compiles")
    parser.add_argument("--skip-gpt2", action="store_true", help="leave out the GPT-2 124M compile")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import optax

    import jaxamp
    from experiments.lm import config as lm_config
    from experiments.lm import model as lm_model
    from experiments.models import create_model

    def make_step(version, train):
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

    def make_state(model, variables, version):
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

    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, {args.rounds} interleaved rounds")
    print()
    print("CPU step time, median of interleaved rounds, as a ratio to 'none':")
    print()
    print("| model | batch | none ms | leaves | leaves+record |")
    print("|---|---:|---:|---:|---:|")
    cpu_models = {
        "MLP 784-512x3-10": (MLP(), jnp.ones((128, 784)), None),
        "resnet_tiny (CNN)": (create_model("resnet_tiny"), jnp.ones((32, 32, 32, 3)), True),
    }
    for name, (module, x, train) in cpu_models.items():
        model = jaxamp.apply_policy(module, "mixed_float16")
        kwargs = {} if train is None else {"train": False}
        variables = model.init(jax.random.key(0), x, **kwargs)
        labels = jnp.zeros(x.shape[0], jnp.int32)
        steps, states = {}, {}
        for version in VERSIONS:
            states[version] = make_state(model, variables, version)
            steps[version] = jax.jit(make_step(version, train)).lower(states[version], x, labels).compile()
            jax.block_until_ready(steps[version](states[version], x, labels))
        times = {version: [] for version in VERSIONS}
        for _ in range(args.rounds):
            for version in VERSIONS:
                start = time.perf_counter()
                jax.block_until_ready(steps[version](states[version], x, labels))
                times[version].append(time.perf_counter() - start)
        medians = {version: statistics.median(values) for version, values in times.items()}
        print(
            f"| {name} | {x.shape[0]} | {medians['none'] * 1e3:.2f} | {medians['leaves'] / medians['none']:.3f}x "
            f"| {medians['leaves+record'] / medians['none']:.3f}x |"
        )
    if args.skip_gpu:
        return
    if not jaxamp.diagnostics.cuda_plugin_available():
        print("\nH200 target: skipped (the jax-cuda12-plugin is not installed).")
        return
    from jaxamp.diagnostics import bytes_accessed, gpu_target_device, on_device

    device = gpu_target_device("h200")
    print()
    print("Compiled for an H200 (nothing runs): bytes moved and temp memory, as ratios to 'none':")
    print()
    print("| step | none GB moved | leaves | leaves+record | none temp GiB | leaves | leaves+record |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    gpu_models = {"ResNet18, batch 128": (create_model("resnet18"), (128, 32, 32, 3), jnp.float32, True, 10)}
    if not args.skip_gpt2:
        size = lm_config.SIZES["gpt2"]
        gpu_models["GPT-2 124M, batch 8 x 1024"] = (
            lm_model.GPT(vocab_size=50304, size=size, attention="xla"),
            (8, 1024),
            jnp.int32,
            None,
            50304,
        )
    for name, (module, shape, dtype, train, classes) in gpu_models.items():
        model = jaxamp.apply_policy(module, "mixed_float16")
        x = jax.ShapeDtypeStruct(shape, dtype)
        kwargs = {} if train is None else {"train": False}
        variables = jax.eval_shape(
            lambda model=model, shape=shape, dtype=dtype, kwargs=kwargs: model.init(
                jax.random.key(0), jnp.zeros(shape, dtype), **kwargs
            )
        )
        labels_shape = shape if train is None else shape[:1]
        labels = jax.ShapeDtypeStruct(labels_shape, jnp.int32)
        figures = {}
        for version in VERSIONS:
            state = jax.eval_shape(
                lambda model=model, variables=variables, version=version: make_state(
                    model, variables, version
                )
            )
            args_on_device = on_device((state, x, labels), device)
            start = time.perf_counter()
            compiled = jax.jit(make_step(version, train)).lower(*args_on_device).compile()
            figures[version] = (
                bytes_accessed(compiled.as_text()),
                compiled.memory_analysis().temp_size_in_bytes,
                time.perf_counter() - start,
            )
            print(f"  compiled {name} / {version} in {figures[version][2]:.0f} s", file=sys.stderr)
        base_bytes, base_temp, _ = figures["none"]
        print(
            f"| {name} | {base_bytes / 1e9:.2f} | {figures['leaves'][0] / base_bytes:.4f}x "
            f"| {figures['leaves+record'][0] / base_bytes:.4f}x | {base_temp / 2**30:.2f} "
            f"| {figures['leaves'][1] / base_temp:.4f}x | {figures['leaves+record'][1] / base_temp:.4f}x |"
        )


if __name__ == "__main__":
    main()
