"""The numbers a run reports about itself besides evaluation: the throughput window between log rows, the recent
training loss, and the summary (summary.json and the closing line)."""

from __future__ import annotations

import json
import math
import os
from collections import deque

import numpy as np

from dit_train.runs.atomic_io import atomic_write_bytes
from dit_train.runs.json_file import read_json


class Throughput:
    """Images and seconds (step + data time) since the last log row, and the last 50 training losses."""

    def __init__(self):
        self.images, self.seconds = 0, 0.0
        self.recent_losses: deque[float] = deque(maxlen=50)

    def add(self, images: int, seconds: float, loss: float) -> None:
        self.images += images
        self.seconds += seconds
        self.recent_losses.append(loss)

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


def write_summary(cfg, state, throughput: Throughput, last_val: dict, params: int, dataset_id: str,
                  is_main: bool) -> dict:
    summary = {
        "steps": state.step,
        "train_loss": float(np.mean(throughput.recent_losses)) if throughput.recent_losses else math.nan,
        "val_loss": last_val.get("val/loss", math.nan),
        "imgs_per_s": state.step * cfg.train.batch_size / max(state.active_time_s, 1e-9),
        "active_time_s": state.active_time_s,
        "skipped_steps": state.skipped_steps,
        "params": params,
        "model": cfg.model.name,
        "optimizer": cfg.optimizer.name,
        "dataset": dataset_id,
        "best_fd": state.best_fd,
    }
    if is_main:
        atomic_write_bytes(json.dumps(summary, indent=2).encode(), os.path.join(cfg.run_dir, "summary.json"))
        print(f"done: steps={summary['steps']} train_loss={_loss(summary['train_loss'])} "
              f"val_loss={_loss(summary['val_loss'])} imgs/s={summary['imgs_per_s']:.1f} "
              f"active_time={summary['active_time_s']:.0f}s run_dir={cfg.run_dir}")
    return summary
