"""Per-step timings averaged over a log window, so that logged numbers describe every step and not one sample.

Why: timers used to be read on logged steps only. With periodic_rowwise and log_every a multiple of K the logged
steps were never refresh steps (log_every 10, K = 5: every logged step has t % 5 = 4), so the logged optimizer
time was RowNorm's only. Here every step's timings (read once per log window, deferred_steps.py) are summed,
and a log row gets window means (docs/algorithms.md §7):

- `time/<phase>`, `comm_bytes/<collective>`: mean over all steps of the window (a phase absent on a step counts 0);
- `window/steps`: the window's number of steps (the weight of the row's means);
- `opt/refresh_steps`, `opt/rownorm_steps`: refresh (NS5) and between (RowNorm) steps in the window, for
  optimizers with a periodic schedule (a step skipped as non-finite is neither);
- `time/<phase>_refresh`, `time/<phase>_rownorm` for the phases in PER_KIND: the mean over that kind's steps,
  present when the window had such a step.
Cost: a few dict additions per step on the host.
"""

from __future__ import annotations

from collections import defaultdict

PER_KIND = ("time/optimizer", "time/direction", "time/comm", "time/step")
KIND_NAMES = {True: "refresh", False: "rownorm"}


class StepWindow:
    def __init__(self):
        self._reset()

    def _reset(self) -> None:
        self.steps = 0
        self.sums: dict[str, float] = defaultdict(float)
        self.kind_steps = {True: 0, False: 0}
        self.kind_sums = {True: defaultdict(float), False: defaultdict(float)}
        self.scheduled = False  # some step of the window reported opt/refresh

    def add(self, values: dict[str, float], refresh: float | None = None) -> None:
        """One step's timings and byte counts; `refresh` is the step's opt/refresh (None: no schedule/skipped)."""
        self.steps += 1
        for k, v in values.items():
            self.sums[k] += v
        if refresh is None:
            return
        kind = bool(refresh)
        self.scheduled = True
        self.kind_steps[kind] += 1
        for k in PER_KIND:
            if k in values:
                self.kind_sums[kind][k] += values[k]

    def take(self) -> dict[str, float]:
        """The window's means and counts (see the module docstring), then start a new window."""
        if self.steps == 0:
            return {}
        out = {k: v / self.steps for k, v in self.sums.items()}
        out["window/steps"] = float(self.steps)
        if self.scheduled:
            for kind, name in KIND_NAMES.items():
                n = self.kind_steps[kind]
                out[f"opt/{name}_steps"] = float(n)
                if n:
                    out.update({f"{k}_{name}": v / n for k, v in self.kind_sums[kind].items()})
        self._reset()
        return out
