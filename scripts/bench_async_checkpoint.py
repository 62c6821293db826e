#!/usr/bin/env python
"""How long a checkpoint save keeps training waiting, synchronous against asynchronous (train.async_checkpoint),
side by side in one run: the same state (`--mb` MB of fp32 tensors, on CUDA when there is one) saved with
checkpoint.start_save + PendingSave.finish, the trainer's own path (the async save through one stager with the
trainer's staging options, so from the second save on its host buffers are reused, pinned on CUDA). For the async
save the blocking part is start_save (the copy to host memory, also shown in GB/s); the write is then waited for, as
the next save would.

Each repetition saves synchronously, then asynchronously, into a temporary folder; the table shows medians.

    python scripts/bench_async_checkpoint.py --mb 512 --reps 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.distributed.checkpoint.staging import DefaultStager

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from dit_train.runs import checkpoint as ckpt  # noqa: E402
from dit_train.runs.checkpoint_saver import local_bytes, staging_options  # noqa: E402

TARGET = 0.5  # async blocking time / sync blocking time should be below this


def state(mb: int, device: torch.device) -> dict:
    n = mb * 2**20 // 4 // 8
    return {"model": {f"w{i}": torch.randn(n, device=device) for i in range(8)}}


def timed_save(run_dir: str, step: int, tensors: dict, asynchronous: bool, stager) -> tuple[float, float, float]:
    """(blocking seconds, total seconds, staging GB/s: 0 for a synchronous save)."""
    t0 = time.perf_counter()
    pending = ckpt.start_save(run_dir, step, tensors, {"step": step}, asynchronous, stager=stager)
    blocking = time.perf_counter() - t0 if asynchronous else None
    pending.finish(keep_last=1)
    total = time.perf_counter() - t0
    gbps = local_bytes(tensors) / pending.stage_s / 1e9 if asynchronous else 0.0
    return (blocking if asynchronous else total), total, gbps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=512)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tensors = state(args.mb, device)
    stager = DefaultStager(staging_options(device))
    rows = {False: [], True: []}
    with tempfile.TemporaryDirectory() as run_dir:
        for rep in range(args.reps):
            for asynchronous in (False, True):
                rows[asynchronous].append(timed_save(run_dir, 2 * rep + asynchronous + 1, tensors, asynchronous,
                                                     stager))
    med = {a: [statistics.median(row[i] for row in r) for i in range(3)] for a, r in rows.items()}
    print(f"{args.mb} MB on {device.type}, median of {args.reps}")
    print(f"{'save':<6} {'blocking s':>11} {'total s':>9} {'stage GB/s':>11}")
    for a, name in ((False, "sync"), (True, "async")):
        print(f"{name:<6} {med[a][0]:>11.3f} {med[a][1]:>9.3f} {med[a][2] if a else float('nan'):>11.2f}")
    ratio = med[True][0] / med[False][0]
    print(f"async blocking / sync blocking = {ratio:.3f} (target < {TARGET}): {'met' if ratio < TARGET else 'NOT met'}")


if __name__ == "__main__":
    main()
