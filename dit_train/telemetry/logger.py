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
TAIL_CHUNK = 1 << 20  # bytes read at a time, from the end, looking for the last whole row


def open_in_place(path: str, flags: int) -> int:
    from dit_train.runs.in_place_files import open_in_place as checked_open  # it names METRICS_FILE

    return checked_open(path, flags)


def drop_torn_last_line(path: str) -> None:
    """A run killed mid-write leaves a partial last row; appending to it would corrupt the first new row too. Read
    from the end, a chunk at a time (the whole file was read: a sparse metrics.jsonl of a terabyte in a run folder
    from elsewhere filled the memory)."""
    if not os.path.lexists(path):
        return
    with os.fdopen(open_in_place(path, os.O_RDWR), "rb+") as f:
        end = f.seek(0, os.SEEK_END)
        position = end
        while position > 0:
            start = max(0, position - TAIL_CHUNK)
            f.seek(start)
            chunk = f.read(position - start)
            if position == end and chunk.endswith(b"\n"):
                return
            newline = chunk.rfind(b"\n")
            if newline >= 0:
                f.truncate(start + newline + 1)
                return
            position = start
        f.truncate(0)  # no row at all, only a torn one


class MetricLogger:
    def __init__(self, run_dir: str, cfg, enabled: bool = True, resolved_config: dict | None = None):
        self.enabled = enabled
        self.path = os.path.join(run_dir, METRICS_FILE)
        self.wandb = None
        self.echo = None  # a callable(step, metrics) that also shows each row (progress_lines.ProgressLines)
        if not enabled:
            return
        os.makedirs(run_dir, exist_ok=True)
        drop_torn_last_line(self.path)
        self.file = self._open()
        if cfg.wandb.mode != "disabled":  # the mode was checked by dit_train.config before the run started
            from dit_train.telemetry import wandb_run

            self.wandb = wandb_run.start(run_dir, cfg.wandb, resolved_config or {})

    def _open(self):
        """For appending, never through a link or into a FIFO put there after the run folder was checked."""
        return os.fdopen(open_in_place(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT), "a", buffering=1)

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
        if self.echo is not None:
            self.echo(step, metrics)

    @contextlib.contextmanager
    def paused(self):
        """metrics.jsonl closed for the body (which may replace the file), then opened again for appending."""
        if self.enabled:
            self.file.close()
        try:
            yield
        finally:
            if self.enabled:
                self.file = self._open()

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
