#!/usr/bin/env bash
# GPU check of the sharded optimizers (docs/bench_distributed.md): the bf16 NS5 speed against the bf16 GEMM rate,
# then scripts/bench_distributed.py unchanged on CUDA/NCCL with one GPU and with every visible GPU.
# Sized to finish in under 5 minutes on one GPU (dit_1b3 has 1.28B matrix parameters).
#
#   bash scripts/gpu_check.sh                      # dit_1b3, full depth
#   PRESET=dit_4b DEPTH=8 bash scripts/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PRESET=${PRESET:-dit_1b3}
DEPTH_ARGS=()
if [ -n "${DEPTH:-}" ]; then DEPTH_ARGS=(--depth "$DEPTH"); fi
REPEATS=${REPEATS:-5}
export PYTHONUNBUFFERED=1
PY=${PYTHON:-$(command -v python3 || command -v python)}

NGPU=$("$PY" -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)")
if [ "$NGPU" -lt 1 ]; then
  echo "gpu_check: no CUDA device visible (torch.cuda.is_available() is False); nothing to check" >&2
  exit 1
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"

start=$(date +%s)
echo; echo "== bf16 NS5 speed (one GPU) =="
"$PY" scripts/bench_distributed.py --ns5-check --preset "$PRESET" ${DEPTH_ARGS[@]+"${DEPTH_ARGS[@]}"} --repeats "$REPEATS"

echo; echo "== sharded optimizers, one GPU (NCCL group of one: no communication) =="
"$PY" scripts/bench_distributed.py --nproc 1 --preset "$PRESET" ${DEPTH_ARGS[@]+"${DEPTH_ARGS[@]}"} --repeats "$REPEATS" --warmup 2

if [ "$NGPU" -gt 1 ]; then
  echo; echo "== sharded optimizers, all $NGPU GPUs (NCCL) =="
  "$PY" scripts/bench_distributed.py --nproc "$NGPU" --preset "$PRESET" ${DEPTH_ARGS[@]+"${DEPTH_ARGS[@]}"} --repeats "$REPEATS" \
    --warmup 2
else
  echo; echo "== all-GPU configuration: only one GPU is visible, so it is the one-GPU run above =="
fi
echo; echo "gpu_check: done in $(( $(date +%s) - start )) s"
