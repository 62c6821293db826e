"""The EMA update against a hand computation: decay min(decay, (1 + n) / (10 + n)) after the n-th update."""

import pytest
import torch

from dit_train.ema import EMA


def test_ema_follows_the_warm_up_formula_by_hand():
    model = torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    ema = EMA(model, decay=0.5)
    expected = 1.0
    for n, value in enumerate([3.0, -2.0, 7.0, 0.5, 4.0], start=1):
        with torch.no_grad():
            model.weight.fill_(value)
        ema.update(model)
        d = min(0.5, (1 + n) / (10 + n))  # 2/11, 3/12, 4/13, 5/14, then the cap 0.5
        expected = d * expected + (1 - d) * value
        assert ema.num_updates == n
        assert ema.model.weight.item() == pytest.approx(expected, rel=1e-6), n
    assert ema.model.weight.item() == pytest.approx(3.1839160839, rel=1e-6)  # the same numbers, written out

