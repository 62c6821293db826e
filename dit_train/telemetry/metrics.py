"""The numbers a run reports about itself besides evaluation: the throughput window between log rows, and the
summary (summary.json and the closing line).

Every number in the summary is the run's, across resumes: the step, times, skipped steps, best FD and metric values
and the recent training losses travel in the checkpoint's train state (trainer/state.py), and the validation loss and
the metrics' last values are the end-of-run evaluation's. Only the log rows' throughput and step-time means
(metrics.jsonl) are this process's: the first row after a resume covers the steps since the resume."""

from __future__ import annotations

import json
import math
import os
import numpy as np

from dit_train.runs.atomic_io import atomic_write_bytes
from dit_train.runs.json_file import read_json


class Throughput:
    """Images and seconds (step + data time) since the last log row (of this process: a resume starts it anew)."""

    def __init__(self):
        self.images, self.seconds = 0, 0.0

    def add(self, images: int, seconds: float) -> None:
        self.images += images
        self.seconds += seconds

    def take_rate(self) -> float:
        """Images per second over the window, then start a new window."""
        rate = self.images / max(self.seconds, 1e-9)
        self.images, self.seconds = 0, 0.0
        return rate


def read_summary(path: str) -> dict:
    """A finished run's summary.json ({} when there is none, e.g. a run finished by an earlier version)."""
    try:
        return read_json(path, fix="delete it (the run's numbers are in metrics.jsonl)")
    except FileNotFoundError:
        return {}


def _loss(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{x:.4f}"  # no validation (train.val_every=0), no step logged


def write_summary(cfg, state, last_val: dict, params: int, dataset_id: str, is_main: bool,
                  metrics: dict | None = None) -> dict:
    """summary.json (rank 0) and the `done:` line; `metrics`: the registered metrics' last and best values.
    train_loss is the mean of the last TRAIN_LOSS_WINDOW steps' losses, train_loss_steps how many it covers."""
    losses = state.recent_losses
    summary = {
        "steps": state.step,
        "train_loss": float(np.mean(losses)) if losses else math.nan,
        "train_loss_steps": len(losses),
        "val_loss": last_val.get("val/loss", math.nan),
        "imgs_per_s": state.step * cfg.train.batch_size / max(state.active_time_s, 1e-9),
        "active_time_s": state.active_time_s,
        "skipped_steps": state.skipped_steps,
        "params": params,
        "model": cfg.model.name,
        "optimizer": cfg.optimizer.name,
        "dataset": dataset_id,
        "best_fd": state.best_fd,
        **({"metrics": metrics} if metrics else {}),
    }
    if is_main:
        atomic_write_bytes(json.dumps(summary, indent=2).encode(), os.path.join(cfg.run_dir, "summary.json"))
        # fewer than the run's steps allow: resumed from a checkpoint written before the window travelled in it
        short = len(losses) < min(losses.maxlen, state.step)
        covers = f" (mean of the last {len(losses)} steps only: resumed from an older checkpoint)" if short else ""
        print(f"done: steps={summary['steps']} train_loss={_loss(summary['train_loss'])}{covers} "
              f"val_loss={_loss(summary['val_loss'])} imgs/s={summary['imgs_per_s']:.1f} "
              f"active_time={summary['active_time_s']:.0f}s run_dir={cfg.run_dir}")
    return summary
