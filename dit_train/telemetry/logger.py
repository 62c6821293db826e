"""Metric sinks: JSONL always (metrics.jsonl in the run folder, one object per line, flushed), wandb when
logger.wandb.mode is online/offline (never needs a login for offline/disabled; one wandb run per run folder,
see wandb_run.py). Only rank 0 logs."""

from __future__ import annotations

import contextlib
import json
import math
import os

from dit_train.runs.atomic_io import naming

METRICS_FILE = "metrics.jsonl"


def drop_torn_last_line(path: str) -> None:
    """A run killed mid-write leaves a partial last row; appending to it would corrupt the first new row too."""
    try:
        with open(path, "rb+") as f:
            data = f.read()
            if data and not data.endswith(b"\n"):
                f.truncate(data.rfind(b"\n") + 1)
    except FileNotFoundError:
        pass


class MetricLogger:
    def __init__(self, run_dir: str, cfg, enabled: bool = True, resolved_config: dict | None = None):
        self.enabled = enabled
        self.path = os.path.join(run_dir, METRICS_FILE)
        self.wandb = None
        if not enabled:
            return
        os.makedirs(run_dir, exist_ok=True)
        drop_torn_last_line(self.path)
        self.file = open(self.path, "a", buffering=1)
        if cfg.wandb.mode != "disabled":  # the mode was checked by dit_train.config before the run started
            from dit_train.telemetry import wandb_run

            self.wandb = wandb_run.start(run_dir, cfg.wandb, resolved_config or {})

    def log(self, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        clean = {k: (v if not isinstance(v, float) or math.isfinite(v) else str(v)) for k, v in metrics.items()}
        try:
            self.file.write(json.dumps({"step": step, **clean}) + "\n")
        except OSError as e:  # a full disk: the error names no file
            raise naming(e, self.path) from None
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in metrics.items()}, step=step)

    @contextlib.contextmanager
    def paused(self):
        """metrics.jsonl closed for the body (which may replace the file), then opened again for appending."""
        if self.enabled:
            self.file.close()
        try:
            yield
        finally:
            if self.enabled:
                self.file = open(self.path, "a", buffering=1)

    def log_image(self, step: int, key: str, path: str) -> None:
        if self.enabled and self.wandb is not None:
            import wandb

            self.wandb.log({key: wandb.Image(path)}, step=step)

    def summary(self, summary: dict) -> None:
        """summary.json's values as the wandb run's summary (the JSONL file has them as summary.json already)."""
        if self.enabled and self.wandb is not None:
            self.wandb.summary.update(summary)

    def close(self) -> None:
        if self.enabled:
            try:
                self.file.close()
            except OSError as e:  # the unwritten end of a row that failed on a full disk
                raise naming(e, self.path) from None
            if self.wandb is not None:
                self.wandb.finish()
