#!/usr/bin/env bash
# Set-up on a fresh machine (Python >= 3.11), from the repository root: a virtual
# environment in .venv with the library, the experiments and the tests (CPU JAX).
# The README's set-up command and CI's (.ci/run) are this script.
set -euo pipefail
cd "$(dirname "$0")/.."

python3 -m venv .venv
.venv/bin/pip install -q 'pip>=25.1'    # dependency groups need pip 25.1
.venv/bin/pip install -q -e . --group experiments --group test
