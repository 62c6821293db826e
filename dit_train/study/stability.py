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
from collections import deque
from collections.abc import Iterator, Sequence

WINDOW = 10  # steps in each mean
DIVERGED_RATIO = 1.5  # final mean over the lowest mean above which a run has diverged


def logs_every_step(curve: Sequence[tuple[int, float]]) -> bool:
    """Whether the (step, loss) curve has every step from 1 to its last."""
    return len(curve) > 0 and all(s == i for i, (s, _) in enumerate(curve, 1))


def window_means(curve: Sequence[tuple[int, float]]) -> Iterator[tuple[int, float]]:
    """(step, mean of the WINDOW losses up to it), streamed: a curve logged every step holds no list of them. Each
    mean is sum() of the window's losses in order, as a slice of them summed."""
    window: deque = deque(maxlen=WINDOW)
    for step, loss in curve:
        window.append(loss)
        if len(window) == WINDOW:
            yield step, sum(window) / WINDOW


def loss_spike(curve: Sequence[tuple[int, float]], warmup_steps: int) -> float:
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


def diverged(curve: Sequence[tuple[int, float]]) -> bool | None:
    """Whether the run diverged (above); None without every step logged or without one full window."""
    if not logs_every_step(curve) or len(curve) < WINDOW:
        return None
    if not all(math.isfinite(loss) for _, loss in curve):
        return True
    last = lowest = None
    for _, m in window_means(curve):
        last = m
        lowest = m if lowest is None or m < lowest else lowest  # min()'s rule: the first of equals, NaN kept
    return last / lowest > DIVERGED_RATIO
