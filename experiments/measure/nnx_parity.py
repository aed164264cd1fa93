"""An NNX model trained through jaxamp: float16 and bfloat16 against float32, with skipped steps counted.

The Flax NNX CNN of `experiments.models.nnx_cnn` (two convolutions with
batch normalization, dropout, a dense classifier) trains with the recipe of
docs/guides/flax.md ("Training an NNX model"): `jaxamp.apply_policy` on the
model, `jaxamp.scaled_value_and_grad` and `jaxamp.NNXOptimizer` (Adam,
learning rate cosine-decayed to 0, the policy's default loss scale), under
``float32``, ``mixed_float16`` and ``mixed_bfloat16`` (and, asked with
``--precisions``, the names with bfloat16 params whose optimizer state is
stored in bfloat16 or 8 bits, ``bfloat16_kahan``, ``bfloat16_int8``,
``bfloat16_fp8``: the optimizer `jaxamp.optimizer_for_policy` gives), from
the same initial weights through the same batches. ``--inject-inf-every N`` puts an ``inf``
in every Nth batch but the last: the step is skipped and must leave the
model and the optimizer as they were.

It writes table.md and results.json: per precision, the test accuracy and
loss of the last step, the steps applied (the optimizer's ``step``), the
steps skipped, the loss scale at the end, and the accuracy's difference from
float32's. ``--data synthetic`` (random CIFAR-shaped images) needs nothing;
the default reads Fashion-MNIST's IDX files (``--data-dir``).
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jaxamp
from experiments import data as data_lib
from experiments.flags import comma_list, non_negative_int, positive_float, positive_int
from experiments.measure.markdown import table
from experiments.models.nnx_cnn import NNXSmallCNN

PRECISIONS = ("float32", "mixed_float16", "mixed_bfloat16", "bfloat16", "bfloat16_kahan", "bfloat16_int8",
              "bfloat16_fp8")  # fmt: skip
DEFAULT_PRECISIONS = PRECISIONS[:3]


def add_arguments(parser) -> None:
    parser.add_argument(
        "--data",
        default="fashion_mnist",
        choices=("fashion_mnist", "synthetic"),
        help="Fashion-MNIST (its IDX files in --data-dir) or random CIFAR-shaped images",
    )
    parser.add_argument(
        "--data-dir",
        default=None,
        help=f"the Fashion-MNIST IDX files (default: {data_lib.FASHION_MNIST_DIR})",
    )
    parser.add_argument("--steps", type=positive_int, default=300, help="Adam steps per precision")
    parser.add_argument("--batch-size", type=positive_int, default=64, help="examples per step")
    parser.add_argument(
        "--learning-rate", type=positive_float, default=3e-3, help="peak, cosine-decayed to 0"
    )
    parser.add_argument("--test-examples", type=positive_int, default=10_000, help="test images evaluated")
    parser.add_argument(
        "--inject-inf-every", type=non_negative_int, default=50, help="an inf in every Nth batch; 0: none"
    )
    parser.add_argument("--seed", type=non_negative_int, default=0, help="initial weights and batch order")
    parser.add_argument(
        "--precisions",
        type=comma_list(list(PRECISIONS), what="precision"),
        default=list(DEFAULT_PRECISIONS),
        help="comma-separated; the first is the baseline of the accuracy difference",
    )


def load(args) -> data_lib.Dataset:
    if args.data == "synthetic":
        return data_lib.synthetic_dataset(num_train=args.steps * args.batch_size, num_test=args.test_examples)
    return data_lib.load_dataset("fashion_mnist", "tfds", args.data_dir)


def train(precision: str, dataset: data_lib.Dataset, args) -> dict:
    """Trains one model under `precision` by the guide's recipe; returns what table.md shows."""
    policy, _ = jaxamp.split_precision(precision)
    model = jaxamp.apply_policy(NNXSmallCNN(nnx.Rngs(args.seed), dataset.num_classes), policy)
    adam = optax.adam(optax.cosine_decay_schedule(args.learning_rate, args.steps))
    optimizer = jaxamp.NNXOptimizer(
        model,
        jaxamp.optimizer_for_policy(adam, precision, key=args.seed),
        jaxamp.default_loss_scale(policy),
    )

    @nnx.jit
    def train_step(model, optimizer, images, labels):
        def loss_fn(model):
            return optax.softmax_cross_entropy_with_integer_labels(model(images), labels).mean()

        loss, grads, grads_finite = jaxamp.scaled_value_and_grad(loss_fn, optimizer.loss_scale)(model)
        optimizer.update(model, grads, grads_finite=grads_finite)
        return loss

    @nnx.jit
    def correct(model, images, labels):
        return jnp.sum(jnp.argmax(model(images), axis=-1) == labels)

    order = np.random.default_rng(args.seed).permutation(len(dataset.train_labels))
    started = time.perf_counter()
    model.train()
    for step in range(args.steps):
        rows = order[np.arange(step * args.batch_size, (step + 1) * args.batch_size) % len(order)]
        images = data_lib.normalize(jnp.asarray(dataset.train_images[rows]), dataset.mean, dataset.std)
        if args.inject_inf_every and (step + 1) % args.inject_inf_every == 0 and step + 1 < args.steps:
            images = images.at[0, 0, 0, 0].set(jnp.inf)
        loss = train_step(model, optimizer, images, jnp.asarray(dataset.train_labels[rows]))
    train_seconds = time.perf_counter() - started
    model.eval()
    test_images, test_labels = (
        dataset.test_images[: args.test_examples],
        dataset.test_labels[: args.test_examples],
    )
    hits = sum(
        int(correct(model, data_lib.normalize(jnp.asarray(test_images[start : start + 500]), dataset.mean,
                                              dataset.std), jnp.asarray(test_labels[start : start + 500])))
        for start in range(0, len(test_labels), 500)
    )  # fmt: skip
    return {
        "precision": precision,
        "test_accuracy": hits / len(test_labels),
        "last_loss": float(loss),
        "steps_applied": int(optimizer.step[...]),
        "steps_skipped": int(optimizer.skipped_steps),
        "adam_count": int(_adam_state(optimizer.opt_state).count[...]),
        "loss_scale": float(optimizer.loss_scale.loss_scale),
        "train_seconds": train_seconds,
    }


def _adam_state(opt_state):
    """Adam's own state inside the loss scaling's (and `low_precision_optimizer`'s) state."""
    found = [node for node in jax.tree.leaves(opt_state, is_leaf=_is_adam) if _is_adam(node)]
    return found[0]


def _is_adam(node) -> bool:
    return isinstance(node, optax.ScaleByAdamState)


def run(args, out) -> None:
    started = time.perf_counter()
    dataset = load(args)
    runs = []
    for precision in args.precisions:
        runs.append(train(precision, dataset, args))
        out.print(f"  {precision}: {runs[-1]}")
    baseline = runs[0]["test_accuracy"]
    rows = [
        [
            run["precision"],
            f"{run['test_accuracy']:.2%}",
            f"{100 * (run['test_accuracy'] - baseline):+.2f}",
            f"{run['last_loss']:.4f}",
            str(run["steps_applied"]),
            str(run["steps_skipped"]),
            str(run["adam_count"]),
            f"{run['loss_scale']:g}",
        ]
        for run in runs
    ]
    header = [
        "precision", "test accuracy", f"vs {runs[0]['precision']} (points)", "last loss", "optimizer step",
        "skipped", "Adam count", "loss scale",
    ]  # fmt: skip
    injected = (
        f"an inf in batches {args.inject_inf_every}, {2 * args.inject_inf_every}, ... but the last"
        if args.inject_inf_every
        else "no inf injected"
    )
    text = "\n".join(
        [
            "# An NNX model trained through jaxamp: float16 and bfloat16 against float32",
            "",
            f"Command: `{out.command}`",
            f"(jax {jax.__version__}, {jax.devices()[0].platform}, {time.perf_counter() - started:.0f} s in all).",
            (
                f"`experiments.models.nnx_cnn.NNXSmallCNN` on {dataset.name} ({len(dataset.train_labels):,} "
                f"training images, {len(dataset.test_labels[: args.test_examples]):,} test images), "
                f"the recipe of docs/guides/flax.md: Adam, learning rate {args.learning_rate:g} cosine-decayed "
                f"to 0, {args.steps} steps of batch {args.batch_size}, {injected}; the policy's default loss "
                "scale. Optimizer step: `NNXOptimizer.step`, the steps applied; it and Adam's own count "
                "leave out the skipped steps."
            ),
            "",
            table(header, rows),
        ]
    )
    out.print(text)
    out.write("table.md", text)
    out.write_json("results.json", {"command": out.command, "runs": runs})
