#!/usr/bin/env bash
# GPU check of the trainer on one GPU (scripts/gpu_check.py: every optimizer's step time, MFU and peak memory against
# the estimate at dit_1b3, bf16 NS5 against the GEMM rate, DCP save + resume bit-identical, compile + activation
# checkpointing; then the cost of the step's one host read), about 7 minutes on one H100/H200 (at most 8), within
# 80 GB; the table goes to docs/gpu_check.md (--out).
# Arguments go to gpu_check.py (--cpu-smoke: the same stages on CPU; hydra overrides, e.g. model.depth=8).
#
#   bash scripts/gpu_check.sh                              # one GPU
#   ALL_GPUS=1 bash scripts/gpu_check.sh                   # then the sharded optimizers on every visible GPU (NCCL)
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
PY=${PYTHON:-$(command -v python3 || command -v python)}

if [[ " $* " != *" --cpu-smoke "* ]]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
fi
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"

start=$(date +%s)
status=0
"$PY" scripts/gpu_check.py "$@" || status=$?

# What the one host read left on an ordinary step costs (docs/algorithms.md §7 "Host synchronisation"): the step
# as it is, without the read, and with the per-step reads it replaced, side by side (at most a minute).
if [[ " $* " != *" --cpu-smoke "* ]]; then
  echo; echo "== host reads per step (bench_host_sync) =="
  timeout 60 "$PY" scripts/bench_host_sync.py --model dit_s --batch-size 64 --optimizer muon --steps 10 --rounds 3 \
    || status=$?
fi

# Optional, outside the 8 minutes: the sharded optimizers' communication on every visible GPU. All seven contenders
# share one sharded model there (~90 GB of state at dit_1b3, split over the GPUs), so it needs more than one.
if [ "${ALL_GPUS:-0}" = 1 ]; then
  NGPU=$("$PY" -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)")
  if [ "$NGPU" -gt 1 ]; then
    echo; echo "== sharded optimizers, all $NGPU GPUs (NCCL) =="
    "$PY" scripts/bench_distributed.py --nproc "$NGPU" --preset "${PRESET:-dit_1b3}" --repeats "${REPEATS:-5}" \
      --warmup 2 || status=$?
  else
    echo "ALL_GPUS=1: only $NGPU GPU visible; nothing more to run"
  fi
fi
echo; echo "gpu_check: done in $(( $(date +%s) - start )) s (exit status $status)"
exit $status
