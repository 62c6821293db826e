#!/usr/bin/env bash
# First contact with a GPU machine (docs/gpu_check.md): the checks that decide the most, each stage in its own
# process under its own `timeout`, its result appended to <results>/results.jsonl as it finishes (a crash or hang
# loses only that stage), under 9 minutes in all on one H200 by construction (the stages' timeouts,
# benchmarks/gpu_check.py STAGES). Needs the Python packages already installed (torch with CUDA, hydra-core, omegaconf...);
# this checkout is used through PYTHONPATH, so nothing is installed and no network is needed.
#
#   bash benchmarks/gpu_check.sh                        # table to docs/gpu_check.md (+ docs/gpu_check.jsonl)
#   bash benchmarks/gpu_check.sh --results DIR          # stage logs, estimates and results.jsonl in DIR
#   bash benchmarks/gpu_check.sh --cpu-smoke            # every stage on CPU, tiny models: checks the check (CI)
#   bash benchmarks/gpu_check.sh --only env,ns5         # some stages
#   bash benchmarks/gpu_check.sh --timeout-scale 2      # every stage's timeout times 2 (a slower machine)
#   bash benchmarks/gpu_check.sh --help                 # this usage and the stages
set -uo pipefail
{  # the whole script is read before it runs: an edit of this file during a run cannot change the run
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-$(command -v python3 || command -v python)}

usage() {
  cat <<'EOF'
usage: bash benchmarks/gpu_check.sh [--cpu-smoke] [--only STAGES] [--results DIR] [--out FILE] [--timeout-scale X]

First contact with a GPU machine (docs/gpu_check.md): the checks that decide the most (environment, NS5 rates,
the optimizers, dit_15b/dit_1b3 training steps, checkpointing), each stage in its own process under its own
timeout, under 9 minutes in all on one H200. Needs a visible CUDA device (or --cpu-smoke) and the Python packages
already installed; this checkout is used through PYTHONPATH, nothing is installed.

  --cpu-smoke        every stage on CPU with tiny models: checks the check (CI), no GPU needed
  --only STAGES      a comma-separated list of stages (below)
  --results DIR      stage logs, estimates and results.jsonl there (an empty folder; default a new temporary
                     folder; when $OUT is a folder, as on a lent GPU machine, results.jsonl is copied there after
                     each stage, and at the end the table and a tar of the whole folder: three files, where such
                     a machine returns at most eight)
  --out FILE         the results table (default docs/gpu_check.md; with --cpu-smoke, DIR/gpu_check.md)
  --timeout-scale X  every stage's timeout times X (a slower machine)
  -h, --help         this text

stages (timeout in s, on a GPU):
EOF
  "$PY" -m benchmarks.gpu_check --plan 2>/dev/null | awk -F'\t' '{printf "  %-20s %s\n", $1, $2}'
}

SMOKE="" ONLY="" RESULTS="" OUT_MD="" SCALE=1
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --cpu-smoke) SMOKE=--cpu-smoke ;;
    --only) ONLY=${2:?--only needs a comma-separated list of stages}; shift ;;
    --results) RESULTS=${2:?--results needs a folder}; shift ;;
    --out) OUT_MD=${2:?--out needs a file}; shift ;;
    --timeout-scale) SCALE=${2:?--timeout-scale needs a number}; shift ;;
    *) echo "gpu_check.sh: unknown argument '$1'; valid: --cpu-smoke, --only STAGES, --results DIR, --out FILE, --timeout-scale X, --help" >&2
       exit 2 ;;
  esac
  shift
done
if ! [[ "$SCALE" =~ ^[0-9]*\.?[0-9]+$ ]] || [ "$(awk "BEGIN{print ($SCALE > 0)}")" != 1 ]; then
  echo "gpu_check.sh: --timeout-scale '$SCALE' is not valid: a positive number" >&2; exit 2
fi
# a results folder holding a results.jsonl (one given; a new temporary folder, made below, holds none): refused before
# the trainer's import (seconds). Without --results, on a machine whose $OUT folder is copied back (a lent GPU
# machine returns at most 8 files: the third H200 run's results folder in $OUT lost its results.jsonl), the
# results go to a temporary folder and $OUT gets results.jsonl after each stage (a run killed mid-way keeps the
# stages before), then the table and gpu_check_results.tgz
COPY_TO=""
if [ -z "$RESULTS" ] && [ -n "${OUT:-}" ] && [ -d "$OUT" ] && [ -w "$OUT" ]; then COPY_TO=$OUT; fi
if [ -n "$RESULTS" ] && [ -e "$RESULTS/results.jsonl" ]; then
  echo "gpu_check.sh: $RESULTS already holds a results.jsonl; give an empty folder to --results" >&2; exit 2
fi
# what every stage imports, with this checkout first on the path, and (without --cpu-smoke) a visible CUDA device:
# one interpreter for both (each start imports torch, seconds); a missing package or no GPU is one line, before
# anything runs
check_python() {
  local err rc needs_cuda=1
  [ -z "$SMOKE" ] || needs_cuda=0
  err=$(GPU_CHECK_NEEDS_CUDA=$needs_cuda "$PY" -c 'import os, sys, torch, hydra, dit_train.trainer.loop
sys.exit(3 if os.environ["GPU_CHECK_NEEDS_CUDA"] == "1" and not torch.cuda.is_available() else 0)' 2>&1)
  rc=$?
  if [ "$rc" -eq 3 ]; then
    echo "gpu_check.sh: no CUDA device is visible to $PY (torch.cuda.is_available() is False); run it on a GPU machine, or --cpu-smoke to check the check on CPU" >&2
    exit 2
  elif [ "$rc" -ne 0 ]; then
    echo "gpu_check.sh: $PY cannot import the trainer: $(printf '%s\n' "$err" | tail -n 1); install what it names first (scripts/setup.sh keeps an installed torch)" >&2
    exit 2
  fi
}
# the stages asked for first (benchmarks.gpu_check imports no torch: an unknown --only is its one line within a
# second); any other failure is the interpreter's, which check_python names
if ! PLAN=$("$PY" -m benchmarks.gpu_check --plan $SMOKE ${ONLY:+--only "$ONLY"} 2>&1); then
  [[ "$PLAN" == "gpu_check: --only "* ]] || check_python
  printf '%s\n' "$PLAN" | tail -n 1 >&2
  exit 2
fi
check_python
read -r BUDGET ESTIMATE_TIMEOUT KILL_GRACE < <("$PY" -m benchmarks.gpu_check --budget $SMOKE)
BUDGET=$(awk "BEGIN{printf \"%d\", $BUDGET * $SCALE}")
start=$(date +%s)
# default: a new temporary folder (with $OUT, copied there: above)
RESULTS=${RESULTS:-$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")}
mkdir -p "$RESULTS"
if [ -z "$OUT_MD" ]; then
  if [ -n "$SMOKE" ]; then OUT_MD="$RESULTS/gpu_check.md"; else OUT_MD=docs/gpu_check.md; fi
fi
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check_work.XXXXXX")  # the stages' run folders, removed at the end
trap 'rm -rf "$WORK"' EXIT
echo "gpu_check: results in $RESULTS"
if [ -z "$SMOKE" ]; then
  timeout 5 nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader \
    > "$RESULTS/nvidia-smi.txt" 2>&1; cat "$RESULTS/nvidia-smi.txt"
fi

# Memory estimates of the stages' configurations, on the CPU while the GPU works (each one thread under its own
# timeout; all at once on the GPU machine, one after another for the CPU smoke test, which shares the CPU with the
# stages). A stage whose estimate has not finished leaves its peak / estimate check pending (judged when the table is
# made). Each leaves estimate_<stage>.json and, when it ends, estimate_<stage>.rc.
estimate() {
  timeout "$ESTIMATE_TIMEOUT" "$PY" -m dit_train.parallel.memory_estimate_cli $2 --json > "$RESULTS/estimate_$1.json" \
    2> "$RESULTS/estimate_$1.log" < /dev/null
  echo $? > "$RESULTS/estimate_$1.rc.tmp" && mv "$RESULTS/estimate_$1.rc.tmp" "$RESULTS/estimate_$1.rc"
}
ESTIMATE_PIDS=()
# The cost model's predictions the stages print beside their step times, counted the same way (one process, no CUDA
# device visible to it: it takes no GPU memory) under the GPU's name as nvidia-smi gives it; a stage that finds its
# prediction not yet counted counts its own (seconds of its timeout, as before this job).
# nvidia-smi absent or failing prints an error, not a name: then no background job (gpu_check.smi_device_name)
if [ -z "$SMOKE" ]; then
  DEVICE_NAME=$("$PY" -m benchmarks.gpu_check --device-name-of "$RESULTS/nvidia-smi.txt")
else
  DEVICE_NAME=CPU
fi
if [ -z "$DEVICE_NAME" ]; then
  echo "gpu_check: nvidia-smi gave no GPU name (nvidia-smi.txt above): no background prediction job, each stage counts its own"
else
  ( CUDA_VISIBLE_DEVICES="" timeout "$ESTIMATE_TIMEOUT" "$PY" -m benchmarks.gpu_check --predictions \
      --device-name "$DEVICE_NAME" --results "$RESULTS" $SMOKE ${ONLY:+--only "$ONLY"} \
      > "$RESULTS/predictions.log" 2>&1 < /dev/null ) &
  ESTIMATE_PIDS+=($!)
fi
JOBS=$("$PY" -m benchmarks.gpu_check --estimates $SMOKE ${ONLY:+--only "$ONLY"}) || exit 2
if [ -n "$SMOKE" ]; then
  ( while IFS=$'\t' read -r key est_args; do [ -z "$key" ] || estimate "$key" "$est_args"; done <<< "$JOBS" ) &
  ESTIMATE_PIDS+=($!)
else
  while IFS=$'\t' read -r key est_args; do
    [ -z "$key" ] || { estimate "$key" "$est_args" & ESTIMATE_PIDS+=($!); }
  done <<< "$JOBS"
fi

PLANNED=""
while IFS=$'\t' read -r name t; do
  t=$(awk "BEGIN{print $t * $SCALE}")
  PLANNED="$PLANNED${PLANNED:+,}$name"
  echo "== $name (timeout $t s)"
  timeout -k "$KILL_GRACE" "$t" "$PY" -m benchmarks.gpu_check --stage "$name" --results "$RESULTS" --timeout "$t" \
    --work-dir "$WORK" $SMOKE \
    > "$RESULTS/$name.log" 2>&1 < /dev/null
  rc=$?
  rm -rf "${WORK:?}"/*  # what a killed stage left
  "$PY" -m benchmarks.gpu_check_table --results "$RESULTS" --ensure "$name" --rc "$rc" --timeout "$t" \
    --log "$RESULTS/$name.log"
  [ "$rc" -eq 0 ] || { echo "   (last lines of $RESULTS/$name.log)"; tail -n 8 "$RESULTS/$name.log" | cut -c1-300 | sed 's/^/   | /'; }
  [ -z "$COPY_TO" ] || cp "$RESULTS/results.jsonl" "$COPY_TO/results.jsonl"
done <<< "$PLAN"

# the estimates still running get what is left of the check's budget (a pending peak / estimate check is judged
# when the table is made), then are stopped: each subshell's `timeout` (which passes it on), then the subshell
until_s=$(( start + BUDGET - 10 ))
for pid in ${ESTIMATE_PIDS[@]+"${ESTIMATE_PIDS[@]}"}; do
  while kill -0 "$pid" 2>/dev/null && [ "$(date +%s)" -lt "$until_s" ]; do sleep 1; done
done
for pid in ${ESTIMATE_PIDS[@]+"${ESTIMATE_PIDS[@]}"}; do pkill -TERM -P "$pid" 2>/dev/null; kill "$pid" 2>/dev/null; done
echo
COMMAND="bash benchmarks/gpu_check.sh${SMOKE:+ $SMOKE}${ONLY:+ --only $ONLY}"
"$PY" -m benchmarks.gpu_check_table --results "$RESULTS" --render --planned "$PLANNED" --out "$OUT_MD" \
  --command "$COMMAND" --date "$(date -u '+%Y-%m-%d %H:%M UTC')"
status=$?
if [ -z "$SMOKE" ] && [ "$OUT_MD" = docs/gpu_check.md ]; then
  cp "$RESULTS/results.jsonl" docs/gpu_check.jsonl; cp docs/gpu_check.md "$RESULTS/gpu_check.md"
fi
if [ -n "$COPY_TO" ]; then
  cp "$OUT_MD" "$COPY_TO/gpu_check.md" 2>/dev/null
  tar czf "$COPY_TO/gpu_check_results.tgz" -C "$RESULTS" . && echo "gpu_check: results.jsonl, gpu_check.md and gpu_check_results.tgz (the results folder) in $COPY_TO"
fi
echo "gpu_check: done in $(( $(date +%s) - start )) s (exit status $status); table in $OUT_MD, logs in $RESULTS"
exit $status
}
