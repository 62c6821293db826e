"""Checkpoints on disk: finding them, writing them atomically, reading weights back for inference and export.

Two formats share one folder, `<run_dir>/checkpoints/`, and one naming scheme (the step, which is also the data
position):
- `step_00001200.pt`: a single-process checkpoint, one torch.save file written atomically (temp file, fsync,
  rename), holding everything needed to continue exactly: step, model, EMA, optimizer, LR schedule, RNG, run time.
- `step_00001200.dcp/`: a sharded (FSDP2) checkpoint, a torch.distributed.checkpoint folder written by every rank
  (see dcp.py): the model, EMA and optimizer tensors in DCP's format (loadable with any number of ranks),
  `trainer.pt` (step, schedule, shared noise generator, run time, config), `rng/rank_NNNNN.pt`, and the marker
  `COMPLETE`, written last. It is written as `step_00001200.dcp.tmp/` and renamed when complete.

Only complete checkpoints are listed; partial ones (temp files/folders of an interrupted save, or a folder without
its marker) are reported and never loaded.
"""

from __future__ import annotations

import glob
import io
import json
import logging
import os
import re
import shutil
import warnings

import torch

log = logging.getLogger(__name__)
CKPT_RE = re.compile(r"^step_(\d{8})\.pt$")
DCP_RE = re.compile(r"^step_(\d{8})\.dcp$")
DCP_MARKER = "COMPLETE"
DCP_TRAINER_STATE = "trainer.pt"


def checkpoint_dir(run_dir: str) -> str:
    return os.path.join(run_dir, "checkpoints")


def dcp_checkpoint_path(run_dir: str, step: int) -> str:
    return os.path.join(checkpoint_dir(run_dir), f"step_{step:08d}.dcp")


def fsync_dir(path: str) -> None:
    fd = os.open(path or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(data: bytes, path: str) -> None:
    """Write to path.tmp-<pid>, fsync it, rename over path, fsync the folder: a crash leaves either the old
    file or the new one, never a torn one."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path))


def write_synced(data: bytes, path: str) -> None:
    """Write and fsync (inside a folder that is itself renamed into place when complete)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def torch_bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def save_checkpoint(state: dict, run_dir: str, step: int, keep_last: int) -> str:
    folder = checkpoint_dir(run_dir)
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"step_{step:08d}.pt")
    atomic_write_bytes(torch_bytes(state), path)
    prune_checkpoints(run_dir, keep_last)
    return path


def prune_checkpoints(run_dir: str, keep_last: int) -> None:
    """Keep the newest `keep_last` complete checkpoints (both formats); 0 keeps all."""
    for old in list_checkpoints(run_dir)[:-keep_last] if keep_last > 0 else []:
        if os.path.isdir(old):
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.remove(old)


def is_dcp_checkpoint(path: str) -> bool:
    """A complete sharded checkpoint folder (its marker is written last)."""
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, DCP_MARKER))


def list_checkpoints(run_dir: str, remove_partial: bool = True) -> list[str]:
    """Complete checkpoints of both formats, oldest first. Leftovers of an interrupted save (temp files and
    folders, never renamed, so never loaded) are reported and, with `remove_partial` (the single process, or
    rank 0 only), removed; a final-named folder without its marker is reported and skipped."""
    folder = checkpoint_dir(run_dir)
    for tmp in glob.glob(os.path.join(folder, "*.tmp-*")) + glob.glob(os.path.join(folder, "*.dcp.tmp")):
        log.warning("ignoring%s partial checkpoint %s (a save was interrupted)",
                    " and removing" if remove_partial else "", tmp)
        if remove_partial:
            try:
                shutil.rmtree(tmp) if os.path.isdir(tmp) else os.remove(tmp)
            except OSError:
                pass
    if not os.path.isdir(folder):
        return []
    found = []
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        if CKPT_RE.match(name) and os.path.isfile(path):
            found.append(path)
        elif DCP_RE.match(name):
            if is_dcp_checkpoint(path):
                found.append(path)
            else:
                log.warning("ignoring incomplete sharded checkpoint %s (no %s marker)", path, DCP_MARKER)
    return sorted(found)


def load_newest(run_dir: str, map_location="cpu") -> tuple[dict, str] | tuple[None, None]:
    """The newest single-process checkpoint file that loads; a damaged one (e.g. disk corruption) is reported
    and skipped. (Sharded checkpoints are loaded by the trainer, see dcp.py.)"""
    for path in reversed(list_checkpoints(run_dir)):
        if not path.endswith(".pt"):
            continue
        try:
            return torch.load(path, map_location=map_location, weights_only=False), path
        except Exception as e:  # noqa: BLE001 - any unreadable file is skipped, loudly
            log.warning("checkpoint %s is unreadable (%s); trying the previous one", path, e)
    return None, None


def resolve_checkpoint(path: str) -> str:
    """A checkpoint (file or sharded folder), or a run folder / its checkpoints folder (the newest complete
    checkpoint in it)."""
    path = str(path)
    if os.path.isfile(path) or is_dcp_checkpoint(path):
        return path
    if os.path.isdir(path):
        if DCP_RE.match(os.path.basename(path.rstrip("/"))):
            raise FileNotFoundError(f"sharded checkpoint {path!r} is incomplete (no {DCP_MARKER} marker): its save "
                                    f"was interrupted; use an earlier checkpoint")
        found = list_checkpoints(path, remove_partial=False) or \
            list_checkpoints(os.path.dirname(path.rstrip("/")), remove_partial=False)
        if found:
            return found[-1]
        raise FileNotFoundError(f"no checkpoints (checkpoints/step_*.pt or step_*.dcp) under {path!r}")
    raise FileNotFoundError(f"checkpoint path {path!r} does not exist")


def read_dcp_trainer_state(path: str) -> dict:
    return torch.load(os.path.join(path, DCP_TRAINER_STATE), map_location="cpu", weights_only=False)


def read_dcp_tensors(path: str, prefix: str) -> dict[str, torch.Tensor]:
    """Consolidated (full, CPU) tensors of one part of a sharded checkpoint (`prefix` "ema", "model" or
    "optimizer"), keyed without the prefix. Needs no process group: any number of ranks wrote it, one reads it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(path)
    meta = reader.read_metadata()
    head = prefix + "."
    out = {k: torch.empty(m.size, dtype=m.properties.dtype)
           for k, m in meta.state_dict_metadata.items()
           if k.startswith(head) and isinstance(m, TensorStorageMetadata)}
    if not out:
        raise KeyError(f"sharded checkpoint {path!r} holds no '{prefix}' tensors")
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message=".*single process.*")
        dcp.load(out, storage_reader=reader, no_dist=True)
    return {k[len(head):]: v for k, v in out.items()}


def load_ema_weights(path: str) -> tuple[dict[str, torch.Tensor], dict, dict]:
    """(EMA state dict of full CPU tensors, run config as a dict, meta) from a checkpoint file, a sharded
    checkpoint folder or a run folder. meta has step, active_time_s, path and format ('pt' or 'dcp')."""
    path = resolve_checkpoint(path)
    if is_dcp_checkpoint(path):
        state = read_dcp_trainer_state(path)
        weights = read_dcp_tensors(path, "ema")
        fmt = "dcp"
    else:
        state = torch.load(path, map_location="cpu", weights_only=False)
        weights = state["ema"]["model"]
        fmt = "pt"
    meta = {"step": state["step"], "active_time_s": state.get("active_time_s", 0.0), "path": path, "format": fmt}
    return weights, state["config"], meta


def load_for_inference(path: str, device="cpu"):
    """(ema_model, cfg, meta) from a checkpoint file, a sharded checkpoint folder or a run folder; meta has step
    and active_time_s. Sharded checkpoints are consolidated on the fly (no process group needed)."""
    from omegaconf import OmegaConf

    from .model import build_model

    weights, config, meta = load_ema_weights(path)
    cfg = OmegaConf.create(config)
    model = build_model(cfg.model)
    model.load_state_dict(weights)
    meta["path"] = path
    return model.to(device).eval(), cfg, meta


def marker_bytes(step: int, world_size: int) -> bytes:
    return json.dumps({"step": step, "world_size": world_size, "format": "dcp-v1"}).encode()
