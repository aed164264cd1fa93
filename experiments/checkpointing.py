"""Checkpoints that resume a run exactly, mid-epoch included (orbax).

A checkpoint holds two items, written together and atomically by orbax (into
a temporary folder renamed into place once complete, so a kill mid-write
leaves the previous checkpoint the latest):

* ``state``: params, optimizer state, batch statistics, the loss scale with
  all its counters (the skip counters included: ``state.skipped_steps`` is
  the loss scale's, so it is restored with it and no second copy can
  disagree), ``step``, and the last skipped step's attribution
  (``nonfinite_grads``, ``overflow_record``);
* ``meta`` (JSON): the run's `signature`, the `Position` (epoch, steps of it
  done, the run's RNG key, the sums of the epoch's metrics so far) and the
  results of the finished epochs.

A checkpoint is named by the global step it was taken after. With several
processes every process calls `save` and `restore` and orbax writes from
process 0 alone.

Resuming checks the signature first: a checkpoint made by another model,
precision, batch size, device count (or any other setting that changes the
computation) is refused with the settings that differ, before any state is
read.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any

import jax
import orbax.checkpoint as ocp

import jaxamp
from experiments import interrupts

# Settings that change what a step computes; a checkpoint resumes only under the same ones.
SIGNATURE_FIELDS = {
    "model": "--model",
    "precision": "--precision",
    "loss_scale": "--loss-scale",
    "dataset": "--dataset",
    "data": "--data",
    "batch_size": "--batch-size",
    "grad_accum": "--grad-accum",
    "device_count": "the device count",
    "epochs": "--epochs",
    "steps_per_epoch": "--steps-per-epoch",
    "lr": "--lr",
    "label_smoothing": "--label-smoothing",
    "seed": "--seed",
    "inject_nonfinite": "--inject-nonfinite",
    "record_overflow": "--record-overflow",
}
_STEP_FOLDER = re.compile(r"^\d+$")
_ORBAX_TEMPORARY = re.compile(r"^\d+\.orbax-checkpoint-tmp")
_MAX_TO_KEEP = 3
_EFFECTIVE_IDS = os.access in os.supports_effective_ids


def latest_checkpoint(directory: str) -> str | None:
    """The folder of the newest complete checkpoint in `directory`, or None.

    Reads folder names only (a checkpoint being written has orbax's temporary
    suffix until it is complete), so it answers also while the process is
    being interrupted.
    """
    try:
        steps = [int(name) for name in os.listdir(directory) if _STEP_FOLDER.match(name)]
    except OSError:
        return None
    return os.path.join(directory, str(max(steps))) if steps else None


class CheckpointError(RuntimeError):
    """A checkpoint folder cannot be used; the message says why and what to do."""


@dataclasses.dataclass(frozen=True)
class Position:
    """Where in the run a checkpoint was taken.

    Attributes:
        epoch: the epoch to continue (1-based).
        steps_done: steps of that epoch already taken.
        rng_key_data: the run's RNG key (``jax.random.key_data``); epoch
            orders and step keys derive from it.
        epoch_sums: the sums of the epoch's per-step metrics over its steps
            taken so far (loss, correct, injected), as float32 values.
    """

    epoch: int
    steps_done: int
    rng_key_data: list[int]
    epoch_sums: dict[str, float]


def signature(config: Any, device_count: int) -> dict[str, Any]:
    """The settings a checkpoint must share with the run that resumes it."""
    values = {name: getattr(config, name) for name in SIGNATURE_FIELDS if name != "device_count"}
    return {**values, "device_count": device_count}


def check_folder_usable(directory: str) -> None:
    """Raises CheckpointError unless `directory` can hold checkpoints.

    It must be a folder (or creatable), readable and writable by this user,
    and hold nothing but this experiment's checkpoints.
    """
    path = os.path.abspath(directory)
    if os.path.exists(path) and not os.path.isdir(path):
        raise CheckpointError(f"--checkpoint-dir {directory} is a file, not a folder; name a folder.")
    existing = path
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    # effective ids: what this process may do (also after seteuid), not its real user
    if not os.access(existing, os.R_OK | os.W_OK | os.X_OK, effective_ids=_EFFECTIVE_IDS):
        raise CheckpointError(
            f"No permission to write checkpoints in {existing}"
            + (f" (to create {path})" if existing != path else "")
            + "; choose a folder you can write to, or fix its permissions."
        )
    if existing == path:
        foreign = sorted(
            name
            for name in os.listdir(path)
            if not (_STEP_FOLDER.match(name) or _ORBAX_TEMPORARY.match(name))
        )
        if foreign:
            raise CheckpointError(
                f"--checkpoint-dir {directory} holds {', '.join(foreign[:5])}"
                f"{' ...' if len(foreign) > 5 else ''}, which is not a checkpoint of this experiment; "
                "name an empty or new folder, or one that only this experiment's checkpoints use."
            )


class Checkpointer:
    """Saves and restores the train state, its position and the results so far.

    Args:
        directory: the checkpoint folder (created if missing).
        run_signature: see `signature`.
        resume: whether the run continues from the latest checkpoint; when
            False the folder must hold no checkpoint yet, so that a new run
            never mixes its checkpoints with an old one's.

    Raises:
        CheckpointError: the folder is unusable (see `check_folder_usable`),
            or holds checkpoints and `resume` is False.
    """

    def __init__(self, directory: str, run_signature: dict[str, Any], *, resume: bool):
        check_folder_usable(directory)
        if resume and not os.path.isdir(directory):
            # Checked before orbax creates the folder: a failed resume leaves nothing behind.
            raise CheckpointError(
                f"--resume found no checkpoint in {directory}: there is no such folder. Run without "
                "--resume to start afresh, or name the --checkpoint-dir of the run to continue."
            )
        self.directory = directory
        self._signature = run_signature
        try:
            self._manager = ocp.CheckpointManager(
                os.path.abspath(directory),
                options=ocp.CheckpointManagerOptions(max_to_keep=_MAX_TO_KEEP, create=True),
            )
        except OSError as error:
            raise CheckpointError(f"Cannot use --checkpoint-dir {directory}: {error}.") from error
        latest = self._manager.latest_step()
        if latest is not None and not resume:
            raise CheckpointError(
                f"--checkpoint-dir {directory} already holds checkpoints (the latest after step "
                f"{latest}); pass --resume to continue that run, or name a new folder."
            )
        if resume:
            self._check_signature(self._latest_meta())

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def save(
        self, global_step: int, state: jaxamp.TrainState, position: Position, results: dict[str, Any]
    ) -> None:
        """Saves and waits until the checkpoint is complete on disk.

        A Ctrl-C during the save takes effect once it is complete (a second one
        at once): orbax writes in background threads, and an interrupt landing
        inside it leaves a thread that fails noisily at exit.
        """
        meta = {"signature": self._signature, "position": dataclasses.asdict(position), "results": results}
        with interrupts.deferred():
            self._manager.save(
                global_step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardSave(saved_parts(state)), meta=ocp.args.JsonSave(meta)
                ),
            )
            self._manager.wait_until_finished()

    def restore_latest(self, state: jaxamp.TrainState) -> tuple[jaxamp.TrainState, Position, dict[str, Any]]:
        """Restores the latest checkpoint into `state`'s structure and shardings.

        Returns:
            ``(state, position, results)``.

        Raises:
            CheckpointError: there is no checkpoint, it is not readable, or it
                was made with other settings (the message names each).
        """
        meta = self._latest_meta()
        self._check_signature(meta)
        step = self._manager.latest_step()
        where = os.path.join(self.directory, str(step))
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, saved_parts(state))
        try:
            restored = self._manager.restore(
                step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract))
            )["state"]
        except Exception as error:
            raise CheckpointError(
                f"The state in {where} cannot be read; delete that checkpoint to resume from an earlier "
                f"one, or start afresh in a new folder.\n{_cause(error)}"
            ) from error
        return state.replace(**restored), Position(**meta["position"]), meta["results"]

    def _latest_meta(self) -> dict[str, Any]:
        """The latest checkpoint's JSON item; raises CheckpointError if none is readable."""
        step = self._manager.latest_step()
        if step is None:
            raise CheckpointError(
                f"--resume found no checkpoint in {self.directory}; run without --resume to start "
                "afresh, or name the folder of the run to continue."
            )
        where = os.path.join(self.directory, str(step))
        try:
            meta = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
            if not isinstance(meta.get("signature"), dict) or "position" not in meta:
                raise KeyError("signature or position")
            return meta
        except Exception as error:  # orbax reports a damaged checkpoint through many types
            raise CheckpointError(
                f"{where} is not a readable checkpoint of this experiment; delete it to resume from an "
                f"earlier one, or start afresh in a new folder.\n{_cause(error)}"
            ) from error

    def _check_signature(self, meta: dict[str, Any]) -> None:
        saved = meta["signature"]
        differences = [
            f"{SIGNATURE_FIELDS.get(name, name)} (checkpoint {saved.get(name)!r}, this run {value!r})"
            for name, value in self._signature.items()
            if saved.get(name) != value
        ]
        if differences:
            where = os.path.join(self.directory, str(self._manager.latest_step()))
            raise CheckpointError(
                f"Refusing to resume from {where}: it was made with other settings: "
                + "; ".join(differences)
                + ". Resume with the checkpoint's settings, or start afresh in a new folder."
            )


_CAUSE_CHARACTERS = 300


def _cause(error: Exception) -> str:
    """The second line of an unreadable checkpoint's error: what orbax or tensorstore said.

    Their messages run to thousands of characters of JSON on one line, so the
    advice goes first, on a line of its own, and this detail is cut short.
    """
    detail = " ".join(str(error).split())
    if len(detail) > _CAUSE_CHARACTERS:
        detail = detail[:_CAUSE_CHARACTERS] + " ..."
    return f"  cause: {type(error).__name__}: {detail}"


def saved_parts(state: jaxamp.TrainState) -> dict[str, Any]:
    """The parts of the state that change: everything but apply_fn and tx.

    The last skipped step's attribution (``nonfinite_grads``, and the
    ``overflow_record`` of a run with ``--record-overflow``) is saved with
    the rest, so a resumed run names the same layers.
    """
    parts = {
        "step": state.step,
        "params": state.params,
        "opt_state": state.opt_state,
        "batch_stats": state.batch_stats,
        "loss_scale": state.loss_scale,
    }
    for name in ("nonfinite_grads", "overflow_record"):
        if getattr(state, name, None) is not None:
            parts[name] = getattr(state, name)
    return parts
