"""What a run reports, and where: the run directory, the environment, per-epoch
lines, summaries, the JSON file.

Every command that writes results (``experiments.compare``,
``experiments.benchmark``, ...) writes them to a fresh directory under
``runs/`` unless the user names one (`run_directory`), so running a command
as documented never overwrites the results committed under ``results/``.

Also the two per-epoch facts about the train state that the results record:
`state_checksum` (is this the same state, bit for bit, as another run's?)
and `state_finite` (did any inf or NaN get in?). Both read the state on the
host, so they run at an epoch's end, never inside a step.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import platform
import tempfile
from typing import Any

import flax
import jax
import jaxlib
import numpy as np
import optax

import jaxamp
from experiments.distributed import host_value
from experiments.outputs import RUNS_ROOT


def machine() -> dict[str, Any]:
    """What ran where: the devices, the processes and the library versions."""
    device = jax.devices()[0]
    return {
        "device_kind": device.device_kind,
        "platform": device.platform,
        "device_count": jax.device_count(),
        "process_count": jax.process_count(),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "flax": flax.__version__,
        "optax": optax.__version__,
        "jaxamp": jaxamp.__version__,
    }


def environment(config: Any, precision: Any) -> dict[str, Any]:
    """What ran where (`machine`), with the precision and sizes of the run."""
    return {
        **machine(),
        "precision": precision.name,
        "policy": precision.describe(),
        "matmul_precision": precision.matmul_precision,
        "model": config.model,
        "batch_size": config.batch_size,
        "grad_accum": config.grad_accum,
        "dataset": config.dataset,
        "data": config.data,
    }


_CHECKSUMMED_PARTS = ("params", "opt_state", "batch_stats", "loss_scale")


def state_checksum(state: jaxamp.TrainState) -> str:
    """Hex SHA-256 over the bytes of every leaf of params, optimizer state,
    batch statistics and loss scale, in tree order.

    Two states with the same checksum are bit-identical in all of those. Reads
    the whole state on the host: call it at an epoch's end, not per step.
    """
    digest = hashlib.sha256()
    for leaf in jax.tree.leaves([getattr(state, part) for part in _CHECKSUMMED_PARTS]):
        digest.update(np.ascontiguousarray(host_value(leaf)).tobytes())
    return digest.hexdigest()


def state_finite(state: jaxamp.TrainState) -> bool:
    """Whether every floating leaf of the state is finite: params, optimizer state, batch
    statistics, loss scale; not the overflow record (``--record-overflow``), whose amaxes hold
    the skipped step's inf by design."""
    if getattr(state, "overflow_record", None) is not None:
        state = state.replace(overflow_record=None)
    return all(
        bool(np.all(np.isfinite(host_value(leaf))))
        for leaf in jax.tree.leaves(state)
        if isinstance(leaf, jax.Array) and jax.numpy.issubdtype(leaf.dtype, jax.numpy.inexact)
    )


def skipped_steps_line(state: Any, newly_skipped: int) -> str | None:
    """One line for the steps skipped since the last report, naming the last one's non-finite
    gradient leaves (`jaxamp.diagnostics.NonFiniteGradients`) and, where the state keeps its
    overflow record (``--record-overflow``), the op that overflowed first; None when none was
    skipped.

    Read at a report (an epoch's end, an evaluation), so at most one line per
    report and no read inside a step.
    """
    if newly_skipped <= 0:
        return None
    record = getattr(state, "nonfinite_grads", None)
    overflow = getattr(state, "overflow_record", None)
    first = None if overflow is None else overflow.first_overflow()
    if overflow is None:
        cause = None
    elif first is None:  # e.g. an injected fault, or an op the record does not watch
        cause = f"no overflow in the {len(overflow.sites)} matmuls and convolutions recorded"
    else:
        cause = str(first)
    last = "" if record is None else f"; the last: {record.summary(cause=cause)}"
    return f"{newly_skipped} step{'s' if newly_skipped > 1 else ''} skipped since the last report{last}"


def run_directory(command: str, root: str = RUNS_ROOT, now: datetime.datetime | None = None) -> str:
    """Creates and returns a new, empty directory for one run's results.

    The name is the command and the local start time,
    ``<root>/<command>-YYYYMMDD-HHMMSS`` (``runs/compare-20261201-083000``);
    a second run started in the same second gets ``-2``, ``-3``, ... appended,
    so no run ever writes into another's directory. ``runs/`` is ignored by
    git: results under ``results/`` change only when a user passes that
    directory explicitly (``--out-dir results/...``).

    Args:
      command: a short name for what runs (``compare``, ``benchmark-quick``);
        it becomes the start of the directory's name.
      root: the parent directory, created if missing (default ``runs``,
        relative to the working directory).
      now: the start time to name the directory by (default: now).

    Returns:
      The path of the new directory, ``root`` joined with its name.
    """
    stamp = (now or datetime.datetime.now()).strftime("%Y%m%d-%H%M%S")
    base = os.path.join(root, f"{command}-{stamp}")
    os.makedirs(root, exist_ok=True)
    path, attempt = base, 1
    while True:
        try:
            os.mkdir(path)  # fails if it exists: two runs never share a directory
            return path
        except FileExistsError:
            attempt += 1
            path = f"{base}-{attempt}"


def _umask() -> int:
    """The process's umask (reading it means setting it; it is set straight back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_text_atomically(path: str, text: str) -> None:
    """Writes `text` to a temporary file beside `path`, then renames it.

    Readers see the old file or the new one, never half a file: a crash
    mid-write leaves the previous file intact and no temporary file behind.
    The file gets the permissions ``open(path, "w")`` would give it (0644
    under the usual umask 022), not the temporary file's private 0600.
    """
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=os.path.basename(path))
    try:
        with os.fdopen(handle, "w") as file:
            file.write(text)
        os.chmod(temporary, 0o666 & ~_umask())
        os.replace(temporary, path)
    except BaseException:
        os.unlink(temporary)
        raise


def write_json_atomically(path: str, payload: dict[str, Any]) -> None:
    """Writes `payload` as indented JSON, atomically (`write_text_atomically`)."""
    write_text_atomically(path, json.dumps(payload, indent=2) + "\n")


def format_epoch(record: dict[str, Any], epochs: int) -> str:
    """The one line printed after each epoch."""
    line = (
        f"epoch {record['epoch']:>3}/{epochs} | train {record['train_time_s']:7.2f}s"
        f" loss {record['train_loss']:.4f}"
    )
    if "test_time_s" in record:
        line += f" | test {record['test_time_s']:6.2f}s acc {record['test_accuracy']:.2%}"
    line += (
        f" | {record['images_per_s']:,.0f} img/s | loss scale {record['loss_scale']:g}"
        f" | skipped {record['skipped_steps']}"
    )
    if record.get("injected_nonfinite"):
        line += f" (injected {record['injected_nonfinite']})"
    line += f" | state {record['state_checksum'][:12]}"
    return line


def summarize(epochs: list[dict[str, Any]]) -> dict[str, Any]:
    """Median times per epoch and final accuracy.

    Medians resist the noise of a shared machine; compilation is already
    excluded from every figure.
    """
    if not epochs:
        return {}
    tested = [record for record in epochs if "test_time_s" in record]
    return {
        "train_time_s": float(np.median([record["train_time_s"] for record in epochs])),
        "test_time_s": float(np.median([record["test_time_s"] for record in tested])) if tested else None,
        "images_per_s": float(np.median([record["images_per_s"] for record in epochs])),
        "final_test_accuracy": tested[-1]["test_accuracy"] if tested else None,
        "final_train_loss": epochs[-1]["train_loss"],
        "skipped_steps": epochs[-1]["skipped_steps"],
        "injected_nonfinite": epochs[-1].get("injected_nonfinite", 0),
        "final_state_checksum": epochs[-1].get("state_checksum"),
        "epochs": len(epochs),
    }
