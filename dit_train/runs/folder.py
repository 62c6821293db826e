"""The run folder before training writes to it: the resume decision and its config check, then (rank 0) the
folder, its one-writer lock, the removal of dead writers' temp files, setting aside what an abandoned timeline left
after the step the run resumes from (timeline.py), and the provenance files (run_info.json,
config.yaml, and Hydra's deferred `.hydra/` record of the command)."""

from __future__ import annotations

import logging
import os
import time

from dit_train.runs import checkpoint as ckpt
from dit_train.telemetry import wandb_run
from dit_train.runs.atomic_io import remove_stale_temp_files
from dit_train.config import ConfigError
from dit_train.runs.hydra_files import write_hydra_files
from dit_train.parallel.fsdp import DistInfo, broadcast_object
from dit_train.runs.resume_policy import check_resume
from dit_train.runs.provenance import write_run_info
from dit_train.runs.in_place_files import refuse_writes_outside
from dit_train.runs.lock import RunFolderBusy, RunLock
from dit_train.runs.timeline import set_aside_after, set_aside_before_a_new_start

log = logging.getLogger("dit_train")


def fresh_start_line(cfg) -> str:
    """What train.resume=auto does in a folder without checkpoints: start there (a requeued job's first start
    relies on it), said so that a misspelled run_dir is not a silent new run."""
    what = (f"starting a fork of train.init_from={cfg.train.init_from} there" if cfg.train.init_from
            else "starting a new run there")
    return f"train.resume=auto: no checkpoint in {ckpt.checkpoint_dir(cfg.run_dir)}; {what}"


def prepare_run_folder(cfg, dist: DistInfo) -> RunLock | None:
    """Before anything is written: the resume decision and its config check, then (rank 0) the folder, its
    lock, the removal of dead writers' temp files, what was after the resumed step set aside, and the provenance
    files. Any refusal reaches every rank."""
    lock, error, resumed_from = None, None, None
    if dist.is_main:
        try:
            refuse_writes_outside(cfg.run_dir)  # first: the resume decision lists checkpoints/, never through a link
            resumed_from = check_resume(cfg)
            record = os.path.join(cfg.run_dir, wandb_run.RECORD)
            if cfg.logger.wandb.mode != "disabled" and os.path.exists(record):
                wandb_run.read_identity(record)  # a damaged one is refused before anything is written
            os.makedirs(cfg.run_dir, exist_ok=True)
            lock = RunLock(cfg.run_dir).acquire()
        except Exception as e:  # noqa: BLE001 - handed to every rank, raised as it is on rank 0
            if lock is not None:
                lock.release()
            lock, error = None, e
    hand_over_refusal(error, dist)
    if dist.world_size > 1:
        check_one_folder_on_every_rank(cfg.run_dir, lock, dist)
    if dist.is_main:
        try:
            if resumed_from is None and cfg.train.resume == "auto":  # a misspelled run_dir trained a new run silently
                log.info(fresh_start_line(cfg))  # once the folder is this run's: a second writer says only its line
            for stale in remove_stale_temp_files(cfg.run_dir):
                log.warning("removed %s, left by a writer that died mid-write", stale)
            moved = None
            if resumed_from is None:
                moved = set_aside_before_a_new_start(cfg.run_dir)
            elif ckpt.is_complete(resumed_from):
                moved = set_aside_after(cfg.run_dir, ckpt.read_train_state(resumed_from)["step"], resumed_from)
            if moved:
                log.warning(moved)
            write_run_info(cfg, cfg.run_dir)
            write_hydra_files(cfg, cfg.run_dir)
        except Exception as e:  # noqa: BLE001 - handed to every rank, raised as it is on rank 0
            if lock is not None:
                lock.release()
            error = e
    hand_over_refusal(error, dist)
    return lock


def hand_over_refusal(error: Exception | None, dist: DistInfo) -> None:
    """Rank 0's refusal (or None) reaches every rank: rank 0 raises it as it is, the others a refusal quoting it."""
    message = broadcast_object(None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise error
    if message is not None:  # the other ranks exit as rank 0 does: a busy folder is not a bad command
        refusal = RunFolderBusy if message.startswith(f"{RunFolderBusy.__name__}: ") else ConfigError
        raise refusal(f"rank 0 refused the run folder: {message}")


SHARED_FOLDER_WAIT_S = 20  # how long a rank may take to see rank 0's lock file before run_dir counts as not shared


def check_one_folder_on_every_rank(run_dir: str, lock: RunLock | None, dist: DistInfo) -> None:
    """Every rank must see rank 0's run folder: each writes its checkpoint shards there and rank 0 completes the
    checkpoint. A run_dir on a node-local path (/tmp, a local scratch disk) is another, empty folder on every other
    node: the run went on, its checkpoints marked COMPLETE on rank 0 without the other nodes' shards, and only a
    resume failed. Each rank reads rank 0's lock file (its holder line: host, pid, start time); one that does not
    find it within SHARED_FOLDER_WAIT_S (rank 0 flushes the file first; a network file system's client cache may
    show a new file late) is refused in one line, on rank 0 (the other ranks exit with it, quiet), before anything
    is written."""
    import torch.distributed as tdist

    from dit_train.runs.lock import LOCK_NAME

    if dist.is_main:  # on the file server before anyone looks (NFS shows other clients what was flushed)
        os.fsync(lock.fd)
    line = broadcast_object(os.pread(lock.fd, 512, 0) if dist.is_main else None)
    deadline = time.monotonic() + SHARED_FOLDER_WAIT_S
    while True:  # the ranks in step: a client's cached view of the folder (NFS: up to a minute) may lag
        try:
            os.listdir(run_dir)  # a fresh look at the folder, not a cached "no such file"
            with open(os.path.join(run_dir, LOCK_NAME), "rb") as f:
                sees = f.read(512) == line
        except OSError:
            sees = False
        seen = [None] * dist.world_size
        tdist.all_gather_object(seen, sees)
        blind = [r for r, ok in enumerate(seen) if not ok]
        if not blind:
            return
        if time.monotonic() > deadline:
            break
        time.sleep(1.0)
    if lock is not None:
        lock.release()
    ranks = ", ".join(map(str, blind[:8])) + (f" and {len(blind) - 8} more" if len(blind) > 8 else "")
    raise RunFolderNotShared(
        f"run_dir={run_dir} is not one folder on every rank: rank(s) {ranks} do not see rank 0's {LOCK_NAME} "
        f"there (a node-local path?); every rank writes its checkpoint shards into run_dir, so give a run_dir on a "
        f"file system every node mounts", quiet=not dist.is_main)


class RunFolderNotShared(ConfigError):
    """A run_dir some ranks see as another folder than rank 0's; `quiet` on the ranks other than 0 (one line)."""

    def __init__(self, message: str, quiet: bool = False):
        super().__init__(message)
        self.quiet = quiet
