"""The training loop's checkpoint saves: synchronous, or asynchronous (train.async_checkpoint) so that a save of
hundreds of GB costs training only the copy of each rank's shards to host memory.

At most one save is in flight: the next save, the end of the run, a preemption and a stop wait for it. A save
becomes a checkpoint (train state, COMPLETE marker, rename, pruning: checkpoint.PendingSave.finish) only after
its write: rank 0 looks after every step (`poll`) and finishes it once done, and `wait` finishes it on every
rank. A run that crashes before then leaves a temp folder without a marker, which resume=auto skips and removes.

Metrics (metrics.jsonl, rank 0): `ckpt/save_s`, the time the save kept training waiting (including a wait for
the previous save), at the save step; `ckpt/write_s` (the write: inside save_s when synchronous, in the
background when not) and `ckpt/bytes`, with `ckpt/step`, at the step where the save is finished.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import time
from typing import Callable

import torch
import torch.distributed as dist

from . import checkpoint as ckpt
from .atomic_io import atomic_write_bytes
from .parallel import barrier, rank

log = logging.getLogger("dit_train")


def resolve_async(choice, device: torch.device) -> bool:
    """train.async_checkpoint: auto -> on for CUDA (where a save blocks the GPUs), off on CPU."""
    return device.type == "cuda" if choice == "auto" else bool(choice)


class CheckpointSaver:
    def __init__(self, run_dir: str, keep_last: int, asynchronous: bool, log_metrics: Callable[[int, dict], None],
                 timeout_minutes: float = 30.0):
        self.run_dir, self.keep_last, self.asynchronous = run_dir, keep_last, asynchronous
        self.log_metrics = log_metrics
        # DCP's writer thread runs collectives (plans, write results) while training runs its own: on a group of
        # their own they cannot interleave; gloo, as async_save needs a CPU backend (the default may be NCCL).
        # Its wait for the slowest rank's write is bounded by parallel.timeout_minutes like every other collective.
        self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(minutes=timeout_minutes)) \
            if asynchronous and dist.is_initialized() else None
        self.pending: ckpt.PendingSave | None = None

    def save(self, step: int, tensors: dict, train_state: dict) -> None:
        """Collective. Returns once this save's tensors are written (synchronous) or staged (asynchronous)."""
        t0 = time.perf_counter()
        self.wait(step)
        self.pending = ckpt.start_save(self.run_dir, step, tensors, train_state, self.asynchronous, self.group)
        if self.asynchronous:
            self.log_metrics(step, {"ckpt/save_s": time.perf_counter() - t0})
        else:
            self._finish(step, save_started=t0)
            barrier()

    def poll(self, step: int) -> None:
        """Not collective: rank 0 finishes a save whose write has succeeded (a failed one is left to `wait`, which
        every rank calls at the same step, so that all raise together)."""
        p = self.pending
        if p is not None and rank() == 0 and p.done() and p.future.exception() is None:
            self._finish(step)

    def wait(self, step: int) -> None:
        """Collective: the save in flight, if any, written and finished on every rank."""
        if self.pending is not None:
            self._finish(step)
        barrier()

    def record_train_state(self, step: int, train_state: dict) -> None:
        """Collective: replace the train state of this run's checkpoint of `step` (the last one is written before
        the end-of-run evaluations, whose FD can change the best FD it holds). Atomic: the old or the new file."""
        self.wait(step)
        if rank() == 0:
            atomic_write_bytes(json.dumps(train_state).encode(),
                               os.path.join(ckpt.checkpoint_path(self.run_dir, step), ckpt.TRAIN_STATE))
        barrier()

    def _finish(self, step: int, save_started: float | None = None) -> None:
        pending, self.pending = self.pending, None
        metrics = pending.finish(self.keep_last)
        if not metrics:  # not rank 0
            return
        if save_started is not None:  # a synchronous save: one row with the whole save's time
            metrics["ckpt/save_s"] = time.perf_counter() - save_started
        self.log_metrics(step, {**metrics, "ckpt/step": pending.step})
        log.info("saved checkpoint %s (%.2f GB, written in %.1f s)", pending.final, metrics["ckpt/bytes"] / 1e9,
                 metrics["ckpt/write_s"])
