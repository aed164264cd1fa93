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


def main(argv):
    directory, *run = argv
    address = f"127.0.0.1:{free_port()}"
    processes = [
        subprocess.Popen(
            [sys.executable, "-m", "experiments.cifar", *run,
             "--coordinator-address", address, "--num-processes", "2", "--process-id", str(index),
             "--out", os.path.join(directory, f"process{index}.json"),
             "--checkpoint-dir", os.path.join(directory, "checkpoints"), "--checkpoint-every", "2"],
            cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for index in range(2)
    ]
    try:
        outputs = [process.communicate(timeout=600) for process in processes]
    finally:
        for process in processes:  # one that failed can leave the other waiting for it
            if process.poll() is None:
                process.kill()
    print(json.dumps([
        {"returncode": process.returncode, "stdout": stdout, "stderr": stderr}
        for process, (stdout, stderr) in zip(processes, outputs)
    ]))  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1:])
