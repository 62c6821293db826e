"""The EMA update against a hand computation: decay min(decay, (1 + n) / (10 + n)) after the n-th update."""

import pytest
import torch

from dit_train.diffusion.ema import EMA


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



def test_a_given_shadow_starts_from_the_models_weights():
    """The FSDP2 path builds the average's module itself (`shadow`, freshly initialised): EMA sets it to the
    model's weights and buffers, so the first updates average from the model, not from the shadow's own init."""
    torch.manual_seed(0)
    model, shadow = torch.nn.BatchNorm1d(3), torch.nn.BatchNorm1d(3)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([1.0, 2.0, 3.0]))
        model.running_mean.fill_(5.0)
    ema = EMA(model, decay=0.9, shadow=shadow)
    assert ema.model is shadow and not ema.model.training
    assert torch.equal(shadow.weight, model.weight) and torch.equal(shadow.running_mean, model.running_mean)
    ema.update(model)  # unchanged weights stay put
    assert torch.equal(shadow.weight, model.weight)
