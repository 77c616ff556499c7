#!/usr/bin/env bash
# Create (or reuse) .venv with the CPU build of torch and draftsmith with its extras.
# GPU users: install the CUDA build of torch that matches their driver first
# (https://pytorch.org/get-started/locally/), then `pip install -e '.[serve,dev]'`.
#
# PYTHON picks the interpreter (default: python3.11 where it exists, else python3).
# DRAFTSMITH_ANY_PYTHON=1 accepts another Python version, with the note below.
set -euo pipefail
cd "$(dirname "$0")/.."

# The demo's figures were made with this Python: its standard library is the demo corpus.
DEMO_PYTHON="3.11"
TORCH_VERSION="2.13.0"
TORCH_CPU_INDEX="https://download.pytorch.org/whl/cpu"

if [ -z "${PYTHON:-}" ]; then
  if command -v "python${DEMO_PYTHON}" >/dev/null 2>&1; then PYTHON="python${DEMO_PYTHON}"; else PYTHON=python3; fi
fi
found="$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
if [ "$found" != "$DEMO_PYTHON" ]; then
  if [ "${DRAFTSMITH_ANY_PYTHON:-0}" != "1" ]; then
    echo "setup_env.sh: $PYTHON is Python $found; draftsmith's demo and its recorded figures use Python $DEMO_PYTHON." >&2
    echo "  The demo target is trained on the running Python's standard library, so another version" >&2
    echo "  trains a different target and gives figures that differ from docs/results/." >&2
    echo "  Fix: install Python $DEMO_PYTHON and rerun (or PYTHON=/path/to/python$DEMO_PYTHON), or set" >&2
    echo "  DRAFTSMITH_ANY_PYTHON=1 to go on with $found (the library and tests work on 3.10 and newer)." >&2
    exit 2
  fi
  echo "setup_env.sh: going on with Python $found (DRAFTSMITH_ANY_PYTHON=1): the demo corpus, target and figures will differ from docs/results/."
fi

"$PYTHON" -m venv .venv
. .venv/bin/activate
python -m pip install --quiet --upgrade pip
# The CPU wheel first: a bare `torch` requirement would pull a multi-GB CUDA build.
if ! python -c "import torch" 2>/dev/null; then
  if python - "$TORCH_CPU_INDEX" <<'EOF'
import sys, urllib.request
try:
    urllib.request.urlopen(sys.argv[1] + "/torch/", timeout=10)
except Exception:
    sys.exit(1)
EOF
  then
    python -m pip install --quiet --index-url "$TORCH_CPU_INDEX" "torch==$TORCH_VERSION"
  else
    echo "setup_env.sh: PyTorch's CPU index ($TORCH_CPU_INDEX) is not reachable; installing torch==$TORCH_VERSION from pip's configured index instead."
    python -m pip install --quiet "torch==$TORCH_VERSION"
  fi
  python -c "import sys, torch; sys.exit(0 if torch.version.cuda is None else 1)" ||
    echo "setup_env.sh: note: the torch just installed is a CUDA build ($(python -c 'import torch; print(torch.__version__)')); on a CPU-only machine it works but is several GB larger."
fi
python -m pip install --quiet -e ".[serve,dev]"
