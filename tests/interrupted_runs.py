"""Ctrl-C sent to a tiny training run at several delays from its first compile on: one JSON line per run.

    python tests/interrupted_runs.py FOLDER

Each run is ``python -m experiments.cifar`` with ``--out``, started fresh in a
terminal's Ctrl-C setting, and sent SIGINT by this process
(``send_signal``) the given seconds after its first XLA compilation began.
In the runs marked ``in_a_collection`` the run holds SIGINT blocked except
inside a garbage collection's callback, so that the signal's handler runs
there, where Python drops the ``KeyboardInterrupt`` it raises, as it drops
one raised inside JAX's ``_xla_gc_callback``: the fault a Ctrl-C met about
one time in four on a loaded machine, made certain. Read by
tests/test_interrupts.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (seconds after the first compile began, whether the signal lands in a garbage collection)
RUNS = ((0.0, True), (3.0, True), (1.5, False))

# Long enough that every delay above lands before the run ends, on an idle machine too.
ARGV = [
    "--model", "resnet_tiny", "--data", "synthetic", "--no-progress", "--precision", "mixed",
    "--epochs", "1", "--steps-per-epoch", "200", "--batch-size", "8", "--eval-batch-size", "8",
]  # fmt: skip

FIRST_COMPILE = "first compile begins"

RUN = """
import gc, runpy, signal, sys
# As in a terminal: a shell without job control would start the command with SIGINT ignored.
signal.signal(signal.SIGINT, signal.default_int_handler)
if {in_a_collection!r}:
    signal.pthread_sigmask(signal.SIG_BLOCK, {{signal.SIGINT}})  # before any thread starts

    def delivered_in_a_collection(phase, info):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {{signal.SIGINT}})
        try:
            for _ in range(1000):  # the handler runs between these instructions, inside the callback
                pass
        finally:
            signal.pthread_sigmask(signal.SIG_BLOCK, {{signal.SIGINT}})

    gc.callbacks.insert(0, delivered_in_a_collection)
import jax
compile_program = jax.stages.Lowered.compile

def announced(lowered, *args, **kwargs):
    jax.stages.Lowered.compile = compile_program
    print({first_compile!r}, file=sys.stderr, flush=True)
    return compile_program(lowered, *args, **kwargs)

jax.stages.Lowered.compile = announced
sys.argv = ["experiments.cifar", *{argv!r}]
runpy.run_module("experiments.cifar", run_name="__main__")
"""


def interrupted_run(folder: str, delay: float, in_a_collection: bool) -> dict:
    """One run, sent SIGINT `delay` seconds after its first compile began: what it did."""
    out = os.path.join(folder, f"results-{delay}-{in_a_collection}.json")
    code = RUN.format(in_a_collection=in_a_collection, first_compile=FIRST_COMPILE, argv=[*ARGV, "--out", out])
    process = subprocess.Popen(
        [sys.executable, "-c", code], cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        text=True, env={**os.environ, "JAX_ENABLE_COMPILATION_CACHE": "false"},
    )  # fmt: skip
    before = []
    for line in process.stderr:
        before.append(line)
        if line.strip() == FIRST_COMPILE:
            break
    time.sleep(delay)
    sent_at = time.monotonic()
    process.send_signal(signal.SIGINT)
    try:
        after = process.communicate(timeout=300)[1]
    except subprocess.TimeoutExpired:
        process.kill()
        after = process.communicate()[1]
    stderr = "".join(before) + after
    return {
        "delay_s": delay,
        "in_a_collection": in_a_collection,
        "returncode": process.returncode,
        "stopped_after_s": round(time.monotonic() - sent_at, 1),
        "dropped": "Exception ignored in" in stderr,
        "messages": [line for line in stderr.splitlines() if line.startswith("interrupted")],
        "wrote_results": os.path.exists(out),
        "out": out,
        "stderr_tail": stderr[-2000:],
    }


def main() -> None:
    folder = sys.argv[1]
    for delay, in_a_collection in RUNS:
        print(json.dumps(interrupted_run(folder, delay, in_a_collection)), flush=True)


if __name__ == "__main__":
    main()
