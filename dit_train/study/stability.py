"""The stability endpoints of a run, read from its train losses when it logs every step (train.log_every: 1), as
conf/experiment/rownorm_scale_stability_dit_m.yaml pre-registers them.

Each logged train loss is one step's own batch, so single values are noisy; they are smoothed over WINDOW steps:
    m(s) = mean of the train losses of steps s-WINDOW+1 .. s                                   (s >= WINDOW)
    max loss spike = max over s > warm-up of  m(s) / min over s' <= s of m(s')   (>= 1; 1 = never rose)
    diverged       = a non-finite train loss at any step, or  m(last) / min over all s of m(s) > DIVERGED_RATIO
                     (the loss rose and did not come back down by the end of the run)
A run with a non-finite loss has spike = inf. A run that did not log every step has neither (NaN, None): a rise
inside its unlogged steps could not be seen.
"""

from __future__ import annotations

import math

WINDOW = 10  # steps in each mean
DIVERGED_RATIO = 1.5  # final mean over the lowest mean above which a run has diverged


def logs_every_step(curve: list[tuple[int, float]]) -> bool:
    """Whether the (step, loss) curve has every step from 1 to its last."""
    steps = [s for s, _ in curve]
    return bool(steps) and steps == list(range(1, len(steps) + 1))


def window_means(curve: list[tuple[int, float]]) -> list[tuple[int, float]]:
    losses = [loss for _, loss in curve]
    return [(curve[i][0], sum(losses[i - WINDOW + 1:i + 1]) / WINDOW) for i in range(WINDOW - 1, len(curve))]


def loss_spike(curve: list[tuple[int, float]], warmup_steps: int) -> float:
    """The max loss spike (above); NaN without every step logged or without a full window after the warm-up."""
    if not logs_every_step(curve):
        return math.nan
    if not all(math.isfinite(loss) for _, loss in curve):
        return math.inf
    spike, lowest = math.nan, math.inf
    for step, m in window_means(curve):
        lowest = min(lowest, m)
        if step > warmup_steps:
            spike = max(spike, m / lowest) if math.isfinite(spike) else m / lowest
    return spike


def diverged(curve: list[tuple[int, float]]) -> bool | None:
    """Whether the run diverged (above); None without every step logged or without one full window."""
    if not logs_every_step(curve) or len(curve) < WINDOW:
        return None
    if not all(math.isfinite(loss) for _, loss in curve):
        return True
    means = [m for _, m in window_means(curve)]
    return means[-1] / min(means) > DIVERGED_RATIO
