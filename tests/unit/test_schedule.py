"""The learning-rate schedule (dit_train/optim/schedule.py) against values worked out by hand: linear warm-up to the
base lr over `warmup` steps (step s gets (s + 1) / warmup), then cosine / linear decay over the remaining steps to
min_ratio at `total`, or constant."""

import math

import pytest
import torch

from dit_train.optim.schedule import build_scheduler, lr_multiplier

TOTAL, WARMUP, MIN = 10, 2, 0.1  # decay over steps 2..10 (8 steps), to 0.1


@pytest.mark.parametrize("kind, step, expected", [
    ("cosine", 0, 0.5), ("cosine", 1, 1.0),  # warm-up: the first step already moves
    ("cosine", 2, 1.0),  # decay starts at the end of warm-up
    ("cosine", 4, MIN + (1 - MIN) * 0.5 * (1 + math.cos(math.pi / 4))),  # progress 2/8
    ("cosine", 6, MIN + (1 - MIN) * 0.5),  # half-way: 0.55
    ("cosine", 10, MIN), ("cosine", 15, MIN),  # min_lr_ratio at the end, and after it
    ("linear", 4, MIN + (1 - MIN) * 0.75), ("linear", 6, 0.55), ("linear", 10, MIN),
    ("constant", 0, 0.5), ("constant", 6, 1.0), ("constant", 10, 1.0),
])
def test_multiplier_by_hand(kind, step, expected):
    assert lr_multiplier(step, TOTAL, WARMUP, kind, MIN) == pytest.approx(expected, rel=1e-12)


def test_no_warmup_starts_at_the_base_lr():
    assert lr_multiplier(0, TOTAL, 0, "cosine", MIN) == 1.0
    assert lr_multiplier(5, TOTAL, 0, "linear", MIN) == pytest.approx(MIN + (1 - MIN) * 0.5)


def test_scheduler_drives_every_groups_lr():
    """build_scheduler scales each group's own base lr; the lr of step s is the one used by the s-th update."""
    w = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([{"params": [w], "lr": 1.0}, {"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 0.2}])
    sched = build_scheduler(opt, TOTAL, WARMUP, "cosine", MIN)
    seen = []
    for _ in range(TOTAL + 1):
        seen.append([g["lr"] for g in opt.param_groups])
        opt.step()
        sched.step()
    assert [a for a, _ in seen] == pytest.approx([lr_multiplier(s, TOTAL, WARMUP, "cosine", MIN) for s in range(11)])
    assert [b / a for a, b in seen] == pytest.approx([0.2] * 11)
    assert seen[0][0] == 0.5 and seen[6][0] == pytest.approx(0.55) and seen[10][0] == pytest.approx(MIN)
