"""One training run as two processes on loopback, run by tests/test_distributed.py; prints JSON.

    python tests/distributed_loopback_run.py DIR ARGS...

Starts process 0 and process 1 of ``python -m experiments.cifar ARGS...``,
which meet at a free port of 127.0.0.1; each writes its results to
``DIR/process{index}.json`` and both save checkpoints to ``DIR/checkpoints``
every 2 steps. Waits for both and prints their exit statuses and output as
one JSON line, for the test to assert on.
"""

import json
import os
import socket
import subprocess
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_side_by_side(commands: list[list[str]], timeout: float) -> list[dict]:
    """Runs the commands at once from the repository root; their exit statuses and output.

    One that fails can leave the others waiting for it at a rendezvous, so
    whatever still runs when the first wait ends (or times out) is killed.
    """
    processes = [
        subprocess.Popen(command, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for command in commands
    ]
    try:
        outputs = [process.communicate(timeout=timeout) for process in processes]
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
    return [
        {"returncode": process.returncode, "stdout": stdout, "stderr": stderr}
        for process, (stdout, stderr) in zip(processes, outputs)
    ]


def main(argv):
    directory, *run = argv
    address = f"127.0.0.1:{free_port()}"
    commands = [
        [sys.executable, "-m", "experiments.cifar", *run,
         "--coordinator-address", address, "--num-processes", "2", "--process-id", str(index),
         "--out", os.path.join(directory, f"process{index}.json"),
         "--checkpoint-dir", os.path.join(directory, "checkpoints"), "--checkpoint-every", "2"]
        for index in range(2)
    ]  # fmt: skip
    print(json.dumps(run_side_by_side(commands, timeout=600)))


if __name__ == "__main__":
    main(sys.argv[1:])
