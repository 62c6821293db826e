import math

import pytest
import torch

from dit_train.diffusion.flow import (euler_sample, interpolate, sample_t, validation_loss, validation_t_grid,
                            velocity_loss, velocity_target)


def test_t1_is_pure_noise_t0_is_data():
    x0, eps = torch.randn(4, 1, 8, 8), torch.randn(4, 1, 8, 8)
    assert torch.equal(interpolate(x0, eps, torch.ones(4)), eps)
    assert torch.equal(interpolate(x0, eps, torch.zeros(4)), x0)
    assert torch.equal(velocity_target(x0, eps), eps - x0)


class TrueVelocity(torch.nn.Module):
    """Knows x0 and eps, returns the exact velocity: its loss must be exactly zero."""

    def __init__(self, x0, eps):
        super().__init__()
        self.v = eps - x0

    def forward(self, x, t, **kw):
        return self.v


def test_true_velocity_has_zero_loss_and_wrong_sign_does_not():
    x0, eps = torch.randn(4, 1, 8, 8), torch.randn(4, 1, 8, 8)
    t = torch.rand(4)
    assert velocity_loss(TrueVelocity(x0, eps), x0, t, eps).item() == 0.0
    assert velocity_loss(TrueVelocity(eps, x0), x0, t, eps).item() > 0.1  # x0 - eps is the wrong convention


def test_per_sample_loss_is_each_rows_squared_error_bit_for_bit():
    """The validation loss's per-row terms come from velocity_loss(per_sample=True): equal, bit for bit, to the
    squared error written out (what validation_loss computed before), and their mean is the training loss."""
    g = torch.Generator().manual_seed(0)
    x0, eps, pred = (torch.randn(5, 3, 4, 4, generator=g) for _ in range(3))
    t = torch.rand(5, generator=g)

    class Fixed(torch.nn.Module):
        def forward(self, x, t, **kw):
            return pred

    rows = velocity_loss(Fixed(), x0, t, eps, per_sample=True)
    by_hand = torch.stack([((pred[i] - (eps[i] - x0[i])) ** 2).mean() for i in range(5)])
    assert rows.shape == (5,) and torch.equal(rows, (pred - (eps - x0)).pow(2).flatten(1).mean(1))
    torch.testing.assert_close(rows, by_hand)
    torch.testing.assert_close(rows.mean(), velocity_loss(Fixed(), x0, t, eps))


class PointMassVelocity(torch.nn.Module):
    """Exact velocity field of data concentrated at a point c: v(x, t) = (x - c) / t."""

    def __init__(self, c):
        super().__init__()
        self.c = c

    def forward(self, x, t, **kw):
        return (x - self.c) / t.view(-1, 1, 1, 1)


def test_euler_sampler_lands_on_point_mass():
    c = torch.randn(1, 1, 4, 4)
    noise = torch.randn(3, 1, 4, 4)
    out = euler_sample(PointMassVelocity(c), noise, steps=10)
    assert torch.allclose(out, c.expand_as(out), atol=1e-5)


def test_cfg_combines_conditional_and_unconditional():
    class Model(torch.nn.Module):
        def forward(self, x, t, y=None, drop_mask=None, **kw):
            v = torch.ones_like(x)
            return torch.where(drop_mask.view(-1, 1, 1, 1), torch.zeros_like(v), v) if drop_mask is not None else v

    noise = torch.zeros(2, 1, 2, 2)
    # v = 0 + 3 * (1 - 0) = 3 for one step from t=1 to t=0: x = 0 + (0 - 1) * 3
    out = euler_sample(Model(), noise, y=torch.tensor([0, 1]), steps=1, cfg_scale=3.0)
    assert torch.allclose(out, torch.full_like(out, -3.0))



@pytest.mark.parametrize("cfg_scale", [0.0, 0.5, 3.0])
@pytest.mark.parametrize("condition", ["labels", "text"])
def test_cfg_at_any_scale_for_labels_or_text_alone(cfg_scale, condition):
    """v = v_u + s (v_c - v_u) for every s != 1, also below 1 (0: the unconditional model alone), and for a model
    conditioned on text only (no labels): the null branch is the one with drop_mask set."""
    class Model(torch.nn.Module):
        def forward(self, x, t, y=None, drop_mask=None, context=None, **kw):
            assert (y is None) == (condition == "text") and (context is None) == (condition == "labels")
            v = torch.ones_like(x)
            return torch.where(drop_mask.view(-1, 1, 1, 1), torch.zeros_like(v), v) if drop_mask is not None else v

    kw = {"y": torch.tensor([0, 1])} if condition == "labels" else {"context": torch.randn(2, 3, 4)}
    # one step from t=1 to t=0: x = 0 + (0 - 1) * (0 + s * (1 - 0))
    out = euler_sample(Model(), torch.zeros(2, 1, 2, 2), steps=1, cfg_scale=cfg_scale, **kw)
    assert torch.equal(out, torch.full_like(out, -cfg_scale))

def test_logit_normal_and_uniform_t():
    g = torch.Generator().manual_seed(0)
    t = sample_t(20000, "logit_normal", generator=g)
    assert 0 < t.min() and t.max() < 1 and abs(t.median() - 0.5) < 0.02
    assert (t - 0.5).abs().lt(0.25).float().mean() > 0.6  # mass concentrated mid-way, unlike uniform's 0.5
    u = sample_t(20000, "uniform", generator=g)
    assert abs((u - 0.5).abs().lt(0.25).float().mean() - 0.5) < 0.02
    shifted = sample_t(20000, "uniform", shift=3.0, generator=g)
    assert shifted.mean() > u.mean() + 0.1  # shift moves mass towards noise (t = 1)


@pytest.mark.parametrize("mean, std, shift", [(0.0, 1.0, 1.0), (-0.5, 1.6, 1.0), (0.3, 0.8, 3.0)])
def test_logit_normal_t_has_the_configured_moments(mean, std, shift):
    """logit(t) ~ N(mean, std) (docs/algorithms.md §1), and SD3's shift t' = s t / (1 + (s - 1) t) is exactly
    t' / (1 - t') = s t / (1 - t): logit(t') = logit(t) + log s, the mean moves by log s and the std stays.
    40000 draws: the sample std is within ~0.4% (one standard error) of the true one, so 3% fails a std scaled
    by 0.9 by a wide margin."""
    t = sample_t(40000, "logit_normal", mean, std, shift, generator=torch.Generator().manual_seed(7)).double()
    logit = torch.log(t) - torch.log1p(-t)
    assert abs(logit.mean().item() - (mean + math.log(shift))) < 0.03 * std
    assert abs(logit.std().item() / std - 1) < 0.03


def test_shifted_uniform_t_has_the_shift_maps_distribution():
    """Uniform t shifted by s: P(t' <= a) = P(t <= a / (s - (s - 1) a)) = a / (s - (s - 1) a)."""
    s = 3.0
    t = sample_t(40000, "uniform", shift=s, generator=torch.Generator().manual_seed(8))
    for a in (0.25, 0.5, 0.75, 0.9):
        assert abs(t.le(a).float().mean().item() - a / (s - (s - 1) * a)) < 0.01


def test_validation_loss_is_fixed_and_per_bin():
    x0 = torch.randn(6, 1, 4, 4)
    batches = [(x0[:3], torch.zeros(3, dtype=torch.long)), (x0[3:], torch.zeros(3, dtype=torch.long))]

    class Zero(torch.nn.Module):
        def forward(self, x, t, **kw):
            return torch.zeros_like(x)

    grid = validation_t_grid(4)
    assert torch.allclose(grid, torch.tensor([0.125, 0.375, 0.625, 0.875]))
    a = validation_loss(Zero(), batches, grid, seed=0)
    b = validation_loss(Zero(), batches, grid, seed=0)
    assert a == b and len(a) == 5
    # the zero model's loss is E|eps - x0|^2, independent of t
    assert abs(a["val/loss"] - a["val/loss_t0.125"]) < 1e-6


def test_the_trainer_draws_training_times_from_the_configured_flow():
    """Trainer.global_batch_noise hands flow.t_mean / t_std / shift to sample_t: logit(t) of a large batch has the
    configured mean (+ log shift) and std, and the label-dropout rate is model.class_dropout_prob."""
    from types import SimpleNamespace

    from conftest import compose
    from dit_train.trainer.loop import Trainer

    cfg = compose(["run_dir=/tmp/unused", "flow.t_mean=0.4", "flow.t_std=1.5", "flow.shift=2.0",
                   "model.class_dropout_prob=0.25"])
    trainer = SimpleNamespace(cfg=cfg, dist=SimpleNamespace(world_size=2, rank=1, device="cpu"),
                              state=SimpleNamespace(generator=torch.Generator().manual_seed(0)))
    t, eps, drop = Trainer.global_batch_noise(trainer, torch.zeros(20000, 1))
    logit = (torch.log(t) - torch.log1p(-t)).double()
    assert t.shape == eps.shape[:1] == drop.shape == (20000,)
    assert abs(logit.mean().item() - (0.4 + math.log(2.0))) < 0.05 and abs(logit.std().item() / 1.5 - 1) < 0.03
    assert abs(drop.float().mean().item() - 0.25) < 0.02


def test_validation_loss_over_more_ranks_than_rows_equals_one_process():
    """Rank r evaluates tensor_split(batch, world)[r]; a rank with no rows evaluates one row at weight 0 (so every
    rank makes the same model calls) and must add nothing, to the loss or to the count. 4 ranks over batches of
    3 and 2 rows: the summed totals (what the all-reduce gives each rank) yield the single-process numbers."""
    x0 = torch.randn(5, 1, 4, 4, generator=torch.Generator().manual_seed(9))
    batches = [(x0[:3], torch.zeros(3, dtype=torch.long)), (x0[3:], torch.zeros(2, dtype=torch.long))]

    class Scaled(torch.nn.Module):
        def forward(self, x, t, **kw):
            return 0.5 * x

    grid, world = validation_t_grid(2), 4
    single = validation_loss(Scaled(), batches, grid, seed=3)
    totals = {}
    for rank in range(world):  # first pass: each rank's totals, as it would hand them to the all-reduce
        validation_loss(Scaled(), batches, grid, seed=3, rank=rank, world_size=world,
                        reduce=lambda t, rank=rank: totals.__setitem__(rank, t.clone()))
    summed = sum(totals.values())
    for rank in range(world):
        out = validation_loss(Scaled(), batches, grid, seed=3, rank=rank, world_size=world,
                              reduce=lambda t: t.copy_(summed))
        assert out == pytest.approx(single, rel=1e-6)


class ConstantVelocity(torch.nn.Module):
    """v = -1.5 everywhere (so the Euler sampler ends at noise + 1.5); records each call's batch size and labels."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def forward(self, x, t, y=None, **kw):
        self.calls.append((x.shape[0], y))
        return torch.full_like(x, -1.5)


def test_sampler_clamps_pixels_to_the_image_range_but_never_latents():
    from omegaconf import OmegaConf

    from dit_train.diffusion.sampler import as_latents, make_sampler

    cfg = OmegaConf.create({"in_channels": 1, "image_size": 4, "num_classes": 3})
    noise = torch.randn(2, 1, 4, 4, generator=torch.Generator().manual_seed(0))
    labels = torch.tensor([0, 2])
    end = noise + 1.5  # x(0) = x(1) - integral of v over [0, 1]
    assert end.max() > 1 and end.min() < 1  # some values beyond the pixel range, some inside it
    pixels = make_sampler(ConstantVelocity(), cfg, "cpu", 4, 2.5)(labels, None, noise=noise)
    torch.testing.assert_close(pixels, end.clamp(-1, 1), rtol=0, atol=1e-6)
    latents = make_sampler(ConstantVelocity(), cfg, "cpu", 4, 2.5, decode=as_latents)(labels, None, noise=noise)
    torch.testing.assert_close(latents, end, rtol=0, atol=1e-6)


def test_sampler_gives_an_unconditional_model_no_labels_and_no_guidance_batch():
    """model.num_classes = 0: the labels are not passed, and with cfg_scale != 1 there is nothing to guide, so
    each step is one call on the batch itself (not a doubled conditional/unconditional batch)."""
    from omegaconf import OmegaConf

    from dit_train.diffusion.sampler import make_sampler

    model = ConstantVelocity()
    cfg = OmegaConf.create({"in_channels": 1, "image_size": 4, "num_classes": 0})
    out = make_sampler(model, cfg, "cpu", 3, 2.5)(torch.tensor([0, 1]), torch.Generator().manual_seed(0))
    assert out.shape == (2, 1, 4, 4)
    assert model.calls == [(2, None)] * 3
