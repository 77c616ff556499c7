#!/usr/bin/env bash
# Create (or reuse) .venv with the CPU build of torch and draftsmith with its extras.
# GPU users: install the CUDA build of torch that matches their driver first
# (https://pytorch.org/get-started/locally/), then `pip install -e '.[serve,dev]'`.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
python -m pip install --quiet --upgrade pip
# The CPU wheel first: a bare `torch` requirement would pull a multi-GB CUDA build.
python -c "import torch" 2>/dev/null || python -m pip install --quiet "torch==2.13.0"
python -m pip install --quiet -e ".[serve,dev]"
