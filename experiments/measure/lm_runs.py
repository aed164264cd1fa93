"""The language model's runs that a parity measurement makes, and what it reads back from them.

    folder = run_lm(["--model", "tiny", "--precisions", "mixed_float8,mixed_bf16"], out, "tiny")
    payload = read_results(folder)        # the run's results.json: command, environment, runs

Each run is ``python -m experiments.lm ... --out-dir DIR`` in a process of
its own (its progress and evaluations show as it goes), so that a device
count set for it (``XLA_FLAGS``) is its alone.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any


def run_lm(flags: list[str], out, subfolder: str = "", env: dict[str, str] | None = None) -> str:
    """Runs ``python -m experiments.lm FLAGS`` into `subfolder` of the run folder `out`; returns that folder.

    What the run writes (results.json, table.md, plots) is recorded as written by the measurement.

    Raises:
        SystemExit: the run failed (its own message is above).
    """
    out_dir = os.path.join(out.path, subfolder) if subfolder else out.path
    os.makedirs(out_dir, exist_ok=True)
    started = time.time()
    print("running: python -m experiments.lm " + " ".join([*flags, "--out-dir", out_dir]), flush=True)
    command = [sys.executable, "-m", "experiments.lm", *flags, "--out-dir", out_dir]
    status = subprocess.run(command, env={**os.environ, **(env or {})}, check=False).returncode
    if status:
        raise SystemExit(
            f"error: python -m experiments.lm exited with status {status} (its message is above)."
        )
    for name in sorted(os.listdir(out_dir)):
        if os.path.getmtime(os.path.join(out_dir, name)) >= started:
            out.written.append(os.path.join(subfolder, name))
    return out_dir


def read_results(out_dir: str) -> dict[str, Any]:
    """The ``results.json`` an ``experiments.lm`` run wrote into `out_dir`."""
    with open(os.path.join(out_dir, "results.json"), encoding="utf-8") as file:
        return json.load(file)
