"""The stability endpoints (dit_train/study/stability.py) against an independent computation with numpy: the
10-step running mean by convolution, the running minimum by np.minimum.accumulate."""

import math

import numpy as np
import pytest

from dit_train.study import stability


def reference_spike(losses: np.ndarray, warmup: int) -> float:
    means = np.convolve(losses, np.ones(10) / 10, mode="valid")  # means[i]: steps i+1 .. i+10
    steps = np.arange(10, len(losses) + 1)
    ratio = means / np.minimum.accumulate(means)
    return float(ratio[steps > warmup].max())


def curve(losses) -> list[tuple[int, float]]:
    return [(i + 1, float(x)) for i, x in enumerate(losses)]


@pytest.mark.parametrize("seed", range(4))
def test_the_spike_is_the_largest_rise_of_the_10_step_mean_above_its_running_minimum(seed):
    rng = np.random.default_rng(seed)
    losses = np.exp(-np.linspace(0, 2, 200)) + 0.05 * rng.standard_normal(200) + 0.3
    losses[60:75] += 1.5 * rng.random()  # a spike of random height after the warm-up
    got = stability.loss_spike(curve(losses), warmup_steps=20)
    assert got == pytest.approx(reference_spike(losses, 20), rel=1e-12)
    assert got >= 1.0


def test_a_rise_inside_the_warm_up_is_not_a_spike():
    """The pre-registered spike is measured after the warm-up only: a rise that ends before it (the lr ramp's) is
    not counted, one just after it is (the reference's `steps > warmup`)."""
    losses = np.r_[np.full(10, 1.0), np.full(8, 0.5), np.full(12, 2.0), np.linspace(0.5, 0.2, 70)]
    assert reference_spike(losses, 40) == pytest.approx(1.0)  # the first window past step 40 is already falling
    assert stability.loss_spike(curve(losses), warmup_steps=40) == pytest.approx(1.0)
    assert stability.loss_spike(curve(losses), warmup_steps=20) == pytest.approx(reference_spike(losses, 20))
    assert reference_spike(losses, 20) > 2


def test_a_run_that_only_falls_has_spike_one_and_did_not_diverge():
    losses = np.linspace(1.0, 0.2, 100)
    assert stability.loss_spike(curve(losses), 20) == pytest.approx(1.0)
    assert stability.diverged(curve(losses)) is False


def test_divergence_is_a_non_finite_loss_or_an_end_above_1_5_times_the_lowest_mean():
    recovered = np.r_[np.full(50, 1.0), np.full(20, 0.4), np.full(20, 2.0), np.full(30, 0.35)]
    assert stability.diverged(curve(recovered)) is False
    assert stability.loss_spike(curve(recovered), 20) == pytest.approx(5.0)  # 2.0 / 0.4
    collapsed = np.r_[np.full(50, 1.0), np.full(20, 0.4), np.full(30, 0.61)]  # ends at 1.525x the lowest mean
    assert stability.diverged(curve(collapsed)) is True
    assert stability.diverged(curve(np.r_[np.full(50, 1.0), np.full(20, 0.4), np.full(30, 0.59)])) is False
    nan = np.r_[np.full(30, 1.0), [math.nan], np.full(30, 0.4)]
    assert stability.diverged(curve(nan)) is True and stability.loss_spike(curve(nan), 20) == math.inf


def test_a_run_that_did_not_log_every_step_has_no_stability_endpoint():
    every_tenth = [(s, 1.0) for s in range(10, 201, 10)]
    assert math.isnan(stability.loss_spike(every_tenth, 20)) and stability.diverged(every_tenth) is None
    assert math.isnan(stability.loss_spike(curve(np.ones(25)), 30))  # no full window after the warm-up
