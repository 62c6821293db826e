"""A fork's start (train.init_from): the parent checkpoint chosen once, when the fork starts, is the one loaded,
with the parent's model and EMA weights and the EMA's update count (its warm-up decay (1+n)/(10+n) restarted at
n=0 kept ~0.5% of the parent's EMA after 4 steps). A parent still training may prune that checkpoint before it is
read: the parent's newest is then chosen again, a few times, else one line (ForkSourceGone)."""

from __future__ import annotations

import logging
import os

from dit_train.runs import checkpoint as ckpt

log = logging.getLogger("dit_train")

FORK_LOAD_TRIES = 3  # a live parent prunes at most one checkpoint per save: more races than this are not a race


class ForkSourceGone(ckpt.CheckpointError):
    """The parent checkpoint a fork chose was removed (pruned by its still-running run) before it was read."""


def choose_parent_checkpoint(init_from: str) -> str:
    """The parent's newest checkpoint as rank 0 resolves it, the same path on every rank: ranks resolving it each for
    itself could pick two checkpoints of a parent that saved in between, and read their shards from both. Rank 0's
    refusal is every rank's (no rank is left waiting for a path)."""
    import torch.distributed as dist

    from dit_train.parallel.fsdp import broadcast_object

    main = not dist.is_initialized() or dist.get_rank() == 0
    choice = None
    if main:
        try:
            choice = (ckpt.resolve_checkpoint(str(init_from)), None)
        except (FileNotFoundError, ckpt.CheckpointError) as e:
            choice = (None, e)
    path, error = broadcast_object(choice)
    if error is not None:
        raise error
    return path


def pruned_for_every_rank(source: str) -> bool:
    """Whether `source` is gone (pruned), as rank 0 sees it, on every rank: each rank looking for itself while the
    parent removed it could have one rank raise and the others wait in the next choice's broadcast until the
    collective timeout."""
    import torch.distributed as dist

    from dit_train.parallel.fsdp import broadcast_object

    main = not dist.is_initialized() or dist.get_rank() == 0
    return broadcast_object(not ckpt.is_complete(source) if main else None)


def load_fork(init_from: str, source: str, model, ema_model) -> tuple[str, int]:
    """Load `source` (resolved from `init_from` when the fork started) into the models; (the path loaded, its EMA
    update count). A source gone before or while being read is resolved again from `init_from`."""
    for _ in range(FORK_LOAD_TRIES):
        try:
            ckpt.load_weights(source, model, ema_model)
            return source, ckpt.ema_updates_of(source)  # the parent's EMA decay ramp goes on from its count
        except (OSError, ckpt.CheckpointError, ValueError):
            if not pruned_for_every_rank(source):
                raise  # still there: damaged, not pruned; its own error says why
            gone = source  # DCP raises a rank's read error on every rank: all of them choose again, together
            try:
                source = choose_parent_checkpoint(init_from)
            except (FileNotFoundError, ckpt.CheckpointError):
                break
            log.warning("fork source %s was pruned by its run before it was read; forking from its newest, %s",
                        gone, source)
    raise ForkSourceGone(f"train.init_from={init_from}: the checkpoint {gone} was removed before the fork could read "
                         f"it (pruned by its run, still training?) and no newer one could be read after "
                         f"{FORK_LOAD_TRIES} tries; fork again, or from a run that is not pruning")


# what a fork's start writes before it loads its parent (runs/folder.py, the metric log, wandb's record)
START_FILES = ("run_info.json", "config.yaml", ".lock", "metrics.jsonl", "wandb_run.json")


def forget_fork_start(run_dir: str) -> None:
    """A fork whose parent was gone before anything was loaded leaves nothing in its folder: the files its start
    wrote are removed (Hydra's own, .hydra/ and the log, go with the folder: __main__'s remove_stray_hydra_dir).
    Only while the fork has no checkpoint of its own, and an empty metrics.jsonl only."""
    if ckpt.list_checkpoints(run_dir, remove_partial=False, legacy=True):
        return
    for name in START_FILES:
        path = os.path.join(run_dir, name)
        if os.path.isfile(path) and not os.path.islink(path) and (name != "metrics.jsonl" or not os.path.getsize(path)):
            os.remove(path)
    for folder in ("checkpoints",):
        try:
            os.rmdir(os.path.join(run_dir, folder))
        except OSError:
            pass
