"""The trainer's clipping in two parts (global_grad_norm, then clip_grads_ only where clip_scaled says the factor is
below 1) against torch.nn.utils.clip_grad_norm_ in one call: the same norm and the same gradients, bit for bit."""

import math

import pytest
import torch

from conftest import needs_fashion
from dit_train.parallel.fsdp import DistInfo, clip_grads_, clip_scaled, global_grad_norm
from dit_train.trainer import loop


def params_with_grads(scale: float, seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(shape, generator=g)) for shape in ((7, 5), (13,), (3, 4, 2))]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * scale
    params.append(torch.nn.Parameter(torch.zeros(2)))  # no gradient: left out, as torch leaves it out
    return params


@pytest.mark.parametrize("scale,max_norm", [(10.0, 1.0), (1e-3, 1.0), (1.0, math.inf)])
def test_split_clipping_matches_torch_bit_for_bit(scale, max_norm):
    ours, ref = params_with_grads(scale), params_with_grads(scale)
    total = global_grad_norm(ours)
    if clip_scaled(total, max_norm):
        clip_grads_(ours, max_norm, total)
    expected = torch.nn.utils.clip_grad_norm_(ref, max_norm)
    assert torch.equal(total, expected)
    for a, b in zip(ours, ref):
        assert (a.grad is None) == (b.grad is None)
        if a.grad is not None:
            assert torch.equal(a.grad, b.grad)


def test_only_a_norm_over_the_limit_scales():
    assert bool(clip_scaled(global_grad_norm(params_with_grads(10.0)), 1.0))
    assert not bool(clip_scaled(global_grad_norm(params_with_grads(1e-3)), 1.0))
    assert not bool(clip_scaled(global_grad_norm(params_with_grads(10.0)), math.inf))  # grad_clip=0


def test_clip_grads_scales_to_the_limit():
    params = params_with_grads(10.0)
    clip_grads_(params, 1.0, global_grad_norm(params))
    assert global_grad_norm(params).item() == pytest.approx(1.0, rel=1e-5)


@needs_fashion
@pytest.mark.parametrize("grad_clip,scaled_steps", [(1e6, 0), (0.0, 0), (1e-6, 4)])
def test_the_trainer_scales_only_steps_whose_norm_is_over_the_limit(tiny_cfg, monkeypatch, grad_clip, scaled_steps):
    calls = []
    monkeypatch.setattr(loop, "clip_grads_", lambda *a: calls.append(a) or clip_grads_(*a))
    tiny_cfg.train.update({"steps": 4, "grad_clip": grad_clip, "val_every": 0, "ckpt_every": 0})
    loop.Trainer(tiny_cfg, DistInfo()).fit()
    assert len(calls) == scaled_steps
