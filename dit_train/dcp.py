"""Sharded checkpoints of a training run with torch.distributed.checkpoint (DCP).

What is saved (folder layout in checkpoint.py):
- tensors, through DCP, each rank writing its own shards: `model` and `optimizer` from
  torch.distributed.checkpoint.state_dict.get_state_dict (parameter-name keyed, so they reshard: a checkpoint
  written by N ranks loads on M ranks, or on one process without FSDP), `ema` the same way;
- `trainer.pt` (rank 0): step (= data position), LR schedule, the noise generator (identical on every rank),
  EMA update count, run time, skipped steps, best FD, the resolved config, the world size;
- `rng/rank_NNNNN.pt` (every rank): that rank's torch/numpy/python/CUDA RNG states. Restored when the same rank
  exists again; with a different world size the training noise still continues exactly (it comes from the
  shared generator in trainer.pt), and the per-rank generators, which training does not draw from, start fresh.

Atomic: everything goes into `step_N.dcp.tmp/`; after every rank has finished, rank 0 writes trainer.pt and the
COMPLETE marker (fsynced) and renames the folder to `step_N.dcp`.
"""

from __future__ import annotations

import logging
import os
import shutil
import warnings

import torch
import torch.distributed as dist
from torch import nn

from . import checkpoint as ckpt
from .parallel import barrier

log = logging.getLogger("dit_train")


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def sharded_state(model: nn.Module, optimizer, ema_model: nn.Module) -> dict:
    """The DCP state dict: parameter-name keyed model/optimizer/EMA tensors (DTensor shards under FSDP2, plain
    tensors otherwise). Materialises the optimizer state of a fresh optimizer (a zero-lr step on zero gradients,
    torch's own recipe) so that loading has somewhere to put it."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optimizer": optim_sd, "ema": get_model_state_dict(ema_model)}


def save(run_dir: str, step: int, tensors: dict, trainer_state: dict, rng: dict, keep_last: int) -> str:
    """Collective: every rank calls it with its own `tensors` (see sharded_state) and `rng`; rank 0's
    `trainer_state` is written. Returns the final folder."""
    import torch.distributed.checkpoint as dcp

    rank, world = _rank(), _world()
    final = ckpt.dcp_checkpoint_path(run_dir, step)
    tmp = final + ".tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(os.path.join(tmp, "rng"), exist_ok=True)
    barrier()
    dcp.save(tensors, storage_writer=dcp.FileSystemWriter(tmp, sync_files=True), no_dist=not dist.is_initialized())
    ckpt.write_synced(ckpt.torch_bytes(rng), os.path.join(tmp, "rng", f"rank_{rank:05d}.pt"))
    barrier()  # every shard and RNG file is on disk
    if rank == 0:
        ckpt.write_synced(ckpt.torch_bytes({**trainer_state, "world_size": world}),
                          os.path.join(tmp, ckpt.DCP_TRAINER_STATE))
        for sub in ("rng", ""):
            ckpt.fsync_dir(os.path.join(tmp, sub))
        ckpt.write_synced(ckpt.marker_bytes(step, world), os.path.join(tmp, ckpt.DCP_MARKER))
        ckpt.fsync_dir(tmp)
        old = None
        if os.path.exists(final):  # the same step saved again: move the old one aside first
            old = final + ".old.tmp"
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(tmp, final)
        ckpt.fsync_dir(os.path.dirname(final))
        if old:
            shutil.rmtree(old, ignore_errors=True)
        ckpt.prune_checkpoints(run_dir, keep_last)
    barrier()
    return final


def load(path: str, model: nn.Module, optimizer, ema_model: nn.Module) -> tuple[dict, dict | None]:
    """Collective under a process group. Loads model, optimizer and EMA in place (resharding as needed) and
    returns (trainer_state, this rank's RNG states or None when the checkpoint has no file for this rank)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    state = sharded_state(model, optimizer, ema_model)
    with warnings.catch_warnings():  # a single process without a group: "assuming ... a single process"; it is
        warnings.filterwarnings("ignore", message=".*single process.*")
        dcp.load(state, checkpoint_id=path, no_dist=not dist.is_initialized())
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    set_model_state_dict(ema_model, state["ema"])
    trainer_state = ckpt.read_dcp_trainer_state(path)
    rng_path = os.path.join(path, "rng", f"rank_{_rank():05d}.pt")
    rng = torch.load(rng_path, map_location="cpu", weights_only=False) if os.path.exists(rng_path) else None
    if trainer_state.get("world_size") != _world():
        log.info("checkpoint %s was written by %s ranks, loading on %d: resharded", path,
                 trainer_state.get("world_size"), _world())
    return trainer_state, rng


def load_full_into(state: dict, model: nn.Module, optimizer, ema_model: nn.Module) -> None:
    """A single-process checkpoint (torch.save'd trainer state) into a sharded model: every rank reads the full
    tensors (memory-mapped) and keeps its shards. The optimizer state is keyed by position in the file; it is
    re-keyed by parameter name through this optimizer's identical parameter order."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                         set_optimizer_state_dict)

    full = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, state["model"], options=full)
    set_model_state_dict(ema_model, state["ema"]["model"], options=full)
    names = {id(p): n for n, p in model.named_parameters()}
    saved = state["optimizer"]
    if len(saved["param_groups"]) != len(optimizer.param_groups):
        raise ValueError(f"checkpoint optimizer has {len(saved['param_groups'])} parameter groups, this one "
                         f"{len(optimizer.param_groups)}: it was written with a different optimizer config")
    index_to_name, groups = {}, []
    for g_saved, g_now in zip(saved["param_groups"], optimizer.param_groups):
        if len(g_saved["params"]) != len(g_now["params"]):
            raise ValueError("checkpoint optimizer groups differ in size from this optimizer's")
        fqns = [names[id(p)] for p in g_now["params"]]
        index_to_name.update(zip(g_saved["params"], fqns))
        groups.append({**g_saved, "params": fqns})
    by_name = {"state": {index_to_name[i]: s for i, s in saved["state"].items()}, "param_groups": groups}
    set_optimizer_state_dict(model, optimizer, by_name, options=full)
