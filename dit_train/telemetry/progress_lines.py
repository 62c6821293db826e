"""Progress as plain lines where no bar can be drawn (stderr not a terminal: a Slurm log, a pipe, nohup). With
train.progress, rank 0 prints a logged step's line at most once a minute (and the last step's), and each
evaluation's result as it is logged, so that `tail -f slurm-<id>.out` shows a long run moving. Before, such a run
printed nothing between its start-up lines and `done:`, for hours."""

from __future__ import annotations

import math
import time

EVERY_S = 60.0  # a line a minute: a day's run writes ~1,400 lines, not one per logged step
QUIET_PREFIXES = ("ckpt/", "fd_best/", "val/loss_t")  # bookkeeping, and the per-t split of val/loss


class ProgressLines:
    """Called with each row the metric logger writes (step, metrics): prints what a person watching the log
    wants from it. `clock` and `out` for tests."""

    def __init__(self, total_steps: int, first_step: int, every_s: float = EVERY_S, clock=time.monotonic, out=None):
        self.total, self.every_s, self.clock = total_steps, every_s, clock
        self.first_step, self.started = first_step, clock()
        self.last_printed: float | None = None
        self.out = out or (lambda line: print(line, flush=True))

    def __call__(self, step: int, metrics: dict) -> None:
        if "train/loss" in metrics:
            now = self.clock()
            if self.last_printed is not None and now - self.last_printed < self.every_s and step != self.total:
                return
            self.last_printed = now
            self.out(self.step_line(step, metrics, now))
            return
        shown = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
                 and not k.startswith(QUIET_PREFIXES) and k != "active_time_s"}
        if shown:
            self.out(f"step {step}: " + ", ".join(f"{k} {_number(v)}" for k, v in shown.items()))

    def step_line(self, step: int, metrics: dict, now: float) -> str:
        parts = [f"step {step}/{self.total} ({100 * step / self.total:.1f}%)",
                 f"loss {_number(metrics['train/loss'])}"]
        if "imgs_per_s" in metrics:
            parts.append(f"imgs/s {metrics['imgs_per_s']:.1f}")
        done, elapsed = step - self.first_step, now - self.started
        if 0 < done and step < self.total and elapsed > 0:  # from this process's own pace (a resume starts anew)
            parts.append(f"eta {_duration((self.total - step) * elapsed / done)}")
        return ", ".join(parts)


def _number(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) and math.isfinite(value) else str(value)


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s"
