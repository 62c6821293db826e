"""The training loop's checkpoint saves: synchronous, or asynchronous (train.async_checkpoint) so that a save of
hundreds of GB costs training only the copy of each rank's shards to host memory.

At most one save is in flight: the next save, the end of the run, a preemption and a stop wait for it. A save
becomes a checkpoint (train state, COMPLETE marker, rename, pruning: checkpoint.PendingSave.finish) only after
its write: rank 0 looks after every step (`poll`) and finishes it once done, and `wait` finishes it on every
rank. A run that crashes before then leaves a temp folder without a marker, which resume=auto skips and removes.

An asynchronous save copies this rank's tensors to host memory through one DCP stager kept for the whole run, so
the host buffers are allocated (and on CUDA pinned) at the first save and reused by every later one: a buffer is
free again by the next save, since that save first waits for the one in flight.

Metrics (metrics.jsonl, rank 0): `ckpt/save_s`, the time the save kept training waiting (including a wait for
the previous save), and for an asynchronous save `ckpt/stage_gbps`, the copy to host memory in GB/s (this rank's
tensor bytes over the copy's time), at the save step; `ckpt/write_s` (the write: inside save_s when synchronous, in
the background when not) and `ckpt/bytes`, with `ckpt/step`, at the step where the save is finished.
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
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.utils._pytree import tree_leaves

from dit_train.runs import checkpoint as ckpt
from dit_train.runs.atomic_io import atomic_write_bytes
from dit_train.parallel.backend_env import use_gloo_interface
from dit_train.parallel.fsdp import barrier, local, rank
from dit_train.telemetry.byte_size import format_bytes

log = logging.getLogger("dit_train")


def resolve_async(choice, device: torch.device) -> bool:
    """train.async_checkpoint: auto -> on for CUDA (where a save blocks the GPUs), off on CPU."""
    return device.type == "cuda" if choice == "auto" else bool(choice)


def staging_options(device: torch.device) -> StagingOptions:
    """How an asynchronous save copies tensors on `device` to host memory. CUDA: into pinned (page-locked) buffers,
    which the copy engine fills at the link's rate without a bounce through a pageable staging area, as non-blocking
    copies followed by one synchronize; elsewhere plain copies (pinning needs CUDA). Staging is not itself put in the
    background: the next optimizer step changes the tensors in place, so the copy must be complete when the save
    returns. No shared memory: the write runs in a thread of this process."""
    cuda = device.type == "cuda"
    return StagingOptions(use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=False,
                          use_non_blocking_copy=cuda)


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


def local_bytes(tree) -> int:
    """The bytes of this rank's tensors in a state dict (a DTensor's local shard)."""
    return sum(local(t).numel() * t.element_size() for t in _tensors(tree))


def grace_warning(write_s: float | None, nbytes: int | None, grace_s: float | None) -> str | None:
    """What to say when a checkpoint's write took longer than the time a stop signal leaves before the kill: the
    preemption's own checkpoint (written after the step in progress, and after any save in flight) would be cut
    off, and the run would lose every step since its previous checkpoint."""
    if grace_s is None or write_s is None or write_s <= grace_s:
        return None
    size = f" ({nbytes / 1e9:.1f} GB, {nbytes / 1e9 / write_s:.2f} GB/s)" if nbytes else ""
    return (f"a checkpoint took {write_s:.0f} s to write{size}, "
            f"more than train.stop_grace_s={grace_s:g} s, the time from a stop signal to the kill: a preemption's "
            f"checkpoint would be cut off. Give the job more (torchrun --shutdown-timeout, Slurm --signal=USR1@N) "
            f"and set train.stop_grace_s to it, or write checkpoints faster")


class CheckpointSaver:
    def __init__(self, run_dir: str, keep_last: int, asynchronous: bool, log_metrics: Callable[[int, dict], None],
                 timeout_minutes: float = 10.0, stop_grace_s: float | None = None):
        self.run_dir, self.keep_last, self.asynchronous = run_dir, keep_last, asynchronous
        self.log_metrics = log_metrics
        self.stop_grace_s = stop_grace_s  # train.stop_grace_s: a save that takes longer is warned about, once
        self.warned_grace = False
        self.last_write_s: float | None = None  # rank 0: the last finished save's write, kept in the train state
        # DCP's writer thread runs collectives (plans, write results) while training runs its own: on a group of
        # their own they cannot interleave; gloo, as async_save needs a CPU backend (the default may be NCCL).
        # Its wait for the slowest rank's write is bounded by parallel.timeout_minutes like every other collective.
        # On several nodes gloo must be told the interface the other nodes reach (backend_env.use_gloo_interface).
        self.group = None
        if asynchronous and dist.is_initialized():
            use_gloo_interface()
            self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(minutes=timeout_minutes))
        self.pending: ckpt.PendingSave | None = None
        self.stager: DefaultStager | None = None  # made at the first asynchronous save, for its tensors' device

    def save(self, step: int, tensors: dict, train_state: dict) -> None:
        """Collective. Returns once this save's tensors are written (synchronous) or staged (asynchronous)."""
        t0 = time.perf_counter()
        self.wait(step)
        if self.asynchronous and self.stager is None:
            leaves = _tensors(tensors)
            self.stager = DefaultStager(staging_options(leaves[0].device if leaves else torch.device("cpu")))
        self.pending = ckpt.start_save(self.run_dir, step, tensors, train_state, self.asynchronous, self.group,
                                       self.stager)
        if self.asynchronous:
            self.log_metrics(step, {"ckpt/save_s": time.perf_counter() - t0,
                                    "ckpt/stage_gbps": local_bytes(tensors) / max(self.pending.stage_s, 1e-9) / 1e9})
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
        log.info("saved checkpoint %s (%s, written in %.1f s)", pending.final, format_bytes(metrics["ckpt/bytes"]),
                 metrics["ckpt/write_s"])
        self.last_write_s = metrics["ckpt/write_s"]
        warning = grace_warning(metrics["ckpt/write_s"], metrics["ckpt/bytes"], self.stop_grace_s)
        if warning and not self.warned_grace:
            self.warned_grace = True
            log.warning(warning)
