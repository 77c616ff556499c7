#!/usr/bin/env bash
# The GPU checks as one prepared run, for a CUDA machine lent for a few minutes
# (docs/guides/benchmarks-and-results.md, "On a GPU"). In order, each step under its own time
# limit inside one overall deadline, each step's output in $OUT/<step>.log:
#   machine    nvidia-smi, the machine line every record carries (GPU, CPU, torch build) and
#              the transformers and datasets versions
#   tests      the tests marked gpu (every drafter kind decoded on CUDA: greedy output equal
#              to Hugging Face generate in float32, the target's exact law at T > 0)
#   target     the demo target built on the GPU, the CPU build's step count (1240)
#   distill    the main job's EAGLE-3 recipe on that target (450 steps, no speed step)
#   benchmark  plain decoding, the Hugging Face peers and the EAGLE-3 rows (chain, adaptive,
#              tree, hybrid), held-out prompts, T = 0 and 1, and the draft-length sweep at
#              N = 2, 4, 6, 8, into $OUT/bench_gpu.json
# $OUT/steps.txt lists each step's exit status and seconds. Usage:
#   bash scripts/gpu_check.sh --fetch-wheels   # here, once: the packages the GPU image lacks
#   bash scripts/gpu_check.sh                  # there: the checks (python3 holds CUDA torch)
#   bash scripts/gpu_check.sh --dry-run        # anywhere: the same steps on the CPU, tiny sizes,
#                                              # in the running environment (no wheels)
# Environment: OUT (default outputs/gpu-check), PYTHON (default python3), DEADLINE_S (default
# 560: the whole run, under a 600-second command limit), WHEELS (default .whl; empty: none).
set -uo pipefail
cd "$(dirname "$0")/.."

PY="${PYTHON:-python3}"
OUT="${OUT:-outputs/gpu-check}"
WHEELS="${WHEELS-.whl}"
DEADLINE_S="${DEADLINE_S:-560}"
# The packages draftsmith imports that the GPU image does not hold (datasets and what it needs).
MISSING_PACKAGES=(datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19)

if [ "${1:-}" = "--fetch-wheels" ]; then
  mkdir -p "$WHEELS"
  exec "$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$WHEELS" "${MISSING_PACKAGES[@]}"
fi

DRY_RUN=0
if [ "${1:-}" = "--dry-run" ]; then
  DRY_RUN=1
elif [ $# -gt 0 ]; then
  echo "gpu_check.sh: unknown argument '$1' (use --fetch-wheels, --dry-run or nothing)" >&2
  exit 2
fi

if [ "$DRY_RUN" = 1 ]; then
  DEVICE=cpu PRESET=tiny TARGET_STEPS=30 DISTILL_CONFIG=configs/tiny_eagle3.yaml
  DISTILL_STEPS=10 PROMPTS=2 NEW_TOKENS=16 TEST_MARK="gpu or not gpu"
  TESTS=(tests/decode/test_devices.py)
else
  DEVICE=cuda PRESET=demo TARGET_STEPS=1240 DISTILL_CONFIG=configs/demo.yaml
  DISTILL_STEPS=450 PROMPTS=4 NEW_TOKENS=128 TEST_MARK=gpu
  TESTS=(tests)
fi

mkdir -p "$OUT"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/draftsmith-gpu-check.XXXXXX")"
if [ "$DRY_RUN" = 0 ] && [ -n "$WHEELS" ] && compgen -G "$WHEELS/*.whl" > /dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$WORK/site" "$WHEELS"/*.whl || exit 1
  export PYTHONPATH="$WORK/site"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 WANDB_MODE=disabled TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1

START=$(date +%s)
: > "$OUT/steps.txt"

# step NAME LIMIT_S COMMAND...: run COMMAND under the smaller of LIMIT_S and the time left.
step() {
  local name=$1 limit=$2 began rc left
  shift 2
  left=$(( DEADLINE_S - ($(date +%s) - START) ))
  if [ "$left" -lt 10 ]; then
    echo "$name skipped: the deadline has passed" | tee -a "$OUT/steps.txt"
    return 1
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "== $name (at most ${limit} s)"
  began=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  echo "$name rc=$rc $(( $(date +%s) - began ))s" | tee -a "$OUT/steps.txt"
  tail -n 8 "$OUT/$name.log"
  return "$rc"
}

# The machine as every record names it (draftsmith.decode.measure.machine), and the libraries the run imports.
step machine 60 bash -c "
  if command -v nvidia-smi > /dev/null; then nvidia-smi; fi
  '$PY' -c 'import datasets, transformers
from draftsmith.decode.measure.machine import describe_machine, machine_record
print(describe_machine(machine_record(\"$DEVICE\")))
print(\"transformers\", transformers.__version__, \"datasets\", datasets.__version__)'"

step tests 150 "$PY" -m pytest -q -p no:cacheprovider -m "$TEST_MARK" "${TESTS[@]}"

TARGET="$WORK/target"
step target 150 "$PY" -m draftsmith.scripts.build_demo_target --preset "$PRESET" --output-dir "$TARGET" \
  --max-steps "$TARGET_STEPS" --max-minutes 3

DRAFTER="$WORK/distill/drafter"
step distill 180 "$PY" train/distill.py --config "$DISTILL_CONFIG" --target "$TARGET" \
  --output_dir "$WORK/distill" --max_steps "$DISTILL_STEPS" --max_minutes 3 \
  --speed_eval_prompts 0 --report_to none

step benchmark 200 "$PY" -m draftsmith.scripts.benchmark --target "$TARGET" --eagle3 "$DRAFTER" \
  --device "$DEVICE" --num-prompts "$PROMPTS" --max-new-tokens "$NEW_TOKENS" \
  --temperatures 0 1 --repeats 1 --sweep 2 4 6 8 --no-adaptive-tree --plain-also "" \
  --json "$OUT/bench_gpu.json" --plots "$WORK/plots"

echo "total $(( $(date +%s) - START ))s" | tee -a "$OUT/steps.txt"
! grep -q "rc=[1-9]\|skipped" "$OUT/steps.txt"
