"""Single-process checkpoints: one file per save, written atomically (temp file, fsync, rename), the newest
complete one found by name, older ones pruned to `keep_last`. A checkpoint holds everything needed to continue
exactly: step (which is also the data position), model, EMA, optimizer, LR schedule, RNG states, run time."""

from __future__ import annotations

import glob
import io
import logging
import os
import re

import torch

log = logging.getLogger(__name__)
CKPT_RE = re.compile(r"^step_(\d{8})\.pt$")


def checkpoint_dir(run_dir: str) -> str:
    return os.path.join(run_dir, "checkpoints")


def atomic_write_bytes(data: bytes, path: str) -> None:
    """Write to path.tmp-<pid>, fsync it, rename over path, fsync the folder: a crash leaves either the old
    file or the new one, never a torn one."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(state: dict, run_dir: str, step: int, keep_last: int) -> str:
    folder = checkpoint_dir(run_dir)
    os.makedirs(folder, exist_ok=True)
    buf = io.BytesIO()
    torch.save(state, buf)
    path = os.path.join(folder, f"step_{step:08d}.pt")
    atomic_write_bytes(buf.getvalue(), path)
    for old in list_checkpoints(run_dir)[:-keep_last] if keep_last > 0 else []:
        os.remove(old)
    return path


def list_checkpoints(run_dir: str) -> list[str]:
    """Complete checkpoints (final names only), oldest first. Leftover temp files of a crashed save are
    reported and removed: they were never renamed, so they are never loaded."""
    folder = checkpoint_dir(run_dir)
    for tmp in glob.glob(os.path.join(folder, "*.tmp-*")):
        log.warning("ignoring and removing partial checkpoint %s (a save was interrupted)", tmp)
        try:
            os.remove(tmp)
        except OSError:
            pass
    if not os.path.isdir(folder):
        return []
    return sorted(os.path.join(folder, f) for f in os.listdir(folder) if CKPT_RE.match(f))


def load_newest(run_dir: str, map_location="cpu") -> tuple[dict, str] | tuple[None, None]:
    """The newest checkpoint that loads; a damaged one (e.g. disk corruption) is reported and skipped."""
    for path in reversed(list_checkpoints(run_dir)):
        try:
            return torch.load(path, map_location=map_location, weights_only=False), path
        except Exception as e:  # noqa: BLE001 - any unreadable file is skipped, loudly
            log.warning("checkpoint %s is unreadable (%s); trying the previous one", path, e)
    return None, None


def resolve_checkpoint(path: str) -> str:
    """A checkpoint file, or a run folder (its newest complete checkpoint)."""
    if os.path.isfile(path):
        return path
    if os.path.isdir(path):
        found = list_checkpoints(path) or list_checkpoints(os.path.dirname(path.rstrip("/")))
        if found:
            return found[-1]
        raise FileNotFoundError(f"no checkpoints (checkpoints/step_*.pt) under {path!r}")
    raise FileNotFoundError(f"checkpoint path {path!r} does not exist")


def load_for_inference(path: str, device="cpu"):
    """(ema_model, cfg, meta) from a checkpoint file or run folder; meta has step and active_time_s."""
    from omegaconf import OmegaConf

    from .model import build_model

    ckpt = torch.load(resolve_checkpoint(path), map_location="cpu", weights_only=False)
    cfg = OmegaConf.create(ckpt["config"])
    model = build_model(cfg.model)
    model.load_state_dict(ckpt["ema"]["model"])
    meta = {"step": ckpt["step"], "active_time_s": ckpt.get("active_time_s", 0.0), "path": path}
    return model.to(device).eval(), cfg, meta
