import torch

from dit_train.flow import (euler_sample, interpolate, sample_t, validation_loss, validation_t_grid,
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


def test_logit_normal_and_uniform_t():
    g = torch.Generator().manual_seed(0)
    t = sample_t(20000, "logit_normal", generator=g)
    assert 0 < t.min() and t.max() < 1 and abs(t.median() - 0.5) < 0.02
    assert (t - 0.5).abs().lt(0.25).float().mean() > 0.6  # mass concentrated mid-way, unlike uniform's 0.5
    u = sample_t(20000, "uniform", generator=g)
    assert abs((u - 0.5).abs().lt(0.25).float().mean() - 0.5) < 0.02
    shifted = sample_t(20000, "uniform", shift=3.0, generator=g)
    assert shifted.mean() > u.mean() + 0.1  # shift moves mass towards noise (t = 1)


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
