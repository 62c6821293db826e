#!/usr/bin/env python
"""What the checkpoint checksums (runs/checkpoint_checksums.py) cost, side by side in one run: a model preset's full
checkpoint (model, AdamW state after one step, EMA: the trainer's tensor_state) saved synchronously with the
checksumming writer and with DCP's plain one, and each loaded whole (ckpt.load into the same models): with its
record (verified) and without one (a checkpoint of before records, read unverified). Repetitions alternate which
goes first; the fastest and the median of each. The page cache is warm for both, so the difference is the hash's own
time; on a cold read the hash pass does the disk read, which DCP's read then finds in the page cache (as long as host
memory holds the rank's share).

    python -m benchmarks.bench_checkpoint_checksums --model dit_s --reps 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed.checkpoint as dcp

from dit_train.runs import checkpoint as ckpt
from dit_train.runs import checkpoint_checksums


def models(preset: str):
    from omegaconf import OmegaConf

    from dit_train.model.dit import build_model

    cfg = OmegaConf.load(os.path.join(os.path.dirname(ckpt.__file__), "..", "conf", "model", f"{preset}.yaml"))
    torch.manual_seed(0)
    model, ema = build_model(cfg), build_model(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()  # its exp_avg / exp_avg_sq exist and are saved
    return model, optimizer, ema


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="dit_s")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    model, optimizer, ema = models(args.model)
    tensors = ckpt.tensor_state(model, optimizer, ema)
    train_state = {"step": 1, "config": {}}
    checksummed = checkpoint_checksums.checksumming_writer
    plain = lambda path: dcp.FileSystemWriter(path, sync_files=True)  # noqa: E731 - the writer before records
    times = {k: [] for k in ("save", "save_plain", "load", "load_plain", "hash")}
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as run_dir:
        for rep in range(args.reps):
            saves = (("save", checksummed), ("save_plain", plain))
            for name, writer in saves if rep % 2 == 0 else saves[::-1]:
                checkpoint_checksums.checksumming_writer = writer
                t0 = time.perf_counter()
                ckpt.save(run_dir, 2 * rep + (name == "save_plain") + 1, tensors, train_state, keep_last=2)
                times[name].append(time.perf_counter() - t0)
            checkpoint_checksums.checksumming_writer = checksummed
            first, second = ckpt.list_checkpoints(run_dir)  # the checksummed save, then the plain one
            assert os.path.isfile(os.path.join(first, checkpoint_checksums.RECORD))
            assert not os.path.exists(os.path.join(second, checkpoint_checksums.RECORD))
            order = (("load", first), ("load_plain", second))
            for name, path in order if rep % 2 == 0 else order[::-1]:  # neither always first
                t0 = time.perf_counter()
                ckpt.load(path, model, optimizer, ema)
                times[name].append(time.perf_counter() - t0)
            ranges = {}
            for (name, off), (length, _) in checkpoint_checksums.read_record(first).items():
                ranges.setdefault(name, []).append((off, length))
            t0 = time.perf_counter()
            checkpoint_checksums.hash_ranges(first, ranges)  # the hashing alone: every byte of the checkpoint once
            times["hash"].append(time.perf_counter() - t0)
        size = ckpt.folder_bytes(first)
    print(f"{args.model}: checkpoint of {size / 2**20:.1f} MiB, {args.reps} repetitions")
    for what in ("save", "load"):
        best, med = (f(times[what]) / f(times[what + "_plain"]) for f in (min, statistics.median))
        print(f"{what} with checksums / without: {best:.2f}x fastest, {med:.2f}x median; hashing every byte alone: "
              f"{min(times['hash']) / min(times[what + '_plain']):.2f}x the fastest {what} without")


if __name__ == "__main__":
    main()
