"""Rectified flow, SD3 convention (t = 1 is pure noise): noising, velocity target, timestep sampling,
the fixed validation grid and the Euler sampler with classifier-free guidance (docs/algorithms.md §1)."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from dit_train import seeds


def interpolate(x0: torch.Tensor, eps: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """x_t = (1 - t) x0 + t eps, with t broadcast over all but the batch dimension."""
    t = t.view(-1, *([1] * (x0.dim() - 1))).to(x0.dtype)
    return (1 - t) * x0 + t * eps


def velocity_target(x0: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    return eps - x0


def sample_t(
    n: int,
    kind: str = "logit_normal",
    mean: float = 0.0,
    std: float = 1.0,
    shift: float = 1.0,
    generator: torch.Generator | None = None,
    device=None,
) -> torch.Tensor:
    """Training timesteps. logit_normal: t = sigmoid(N(mean, std)); uniform: U(0, 1).
    shift > 1 moves mass towards noise (SD3's resolution shift t' = s t / (1 + (s - 1) t))."""
    if kind == "logit_normal":
        t = torch.sigmoid(mean + std * torch.randn(n, generator=generator, device=device))
    elif kind == "uniform":
        t = torch.rand(n, generator=generator, device=device)
    else:
        raise ValueError(f"flow.t_sampling={kind!r} is not valid; choose logit_normal or uniform")
    if shift != 1.0:
        t = shift * t / (1 + (shift - 1) * t)
    return t


def velocity_loss(model, x0, t, eps, **cond) -> torch.Tensor:
    """Mean over elements of (v_theta(x_t, t, cond) - (eps - x0))^2."""
    pred = model(interpolate(x0, eps, t), t, **cond)
    return F.mse_loss(pred.float(), velocity_target(x0, eps).float())


def validation_t_grid(num: int = 8) -> torch.Tensor:
    """num equidistant values strictly inside (0, 1): (i + 0.5) / num."""
    return (torch.arange(num, dtype=torch.float32) + 0.5) / num


def condition_kwargs(y) -> dict:
    """A batch's condition as model keyword arguments: class labels (`y`), or the dict of a text-conditioned
    dataset (`context`, `context_mask`, ...)."""
    return dict(y) if isinstance(y, dict) else {"y": y}


@torch.no_grad()
def validation_loss(model, batches, t_grid: torch.Tensor, seed: int = 0, device="cpu", autocast=contextlib.nullcontext,
                    rank: int = 0, world_size: int = 1, reduce=None) -> dict[str, float]:
    """Velocity loss on a fixed held-out set, a fixed t grid and fixed noise (seed stream `val_noise`, one draw per
    batch), so the number is comparable across runs and optimizers. Returns the overall mean and one value per
    t bin (keys val/loss and val/loss_t0.062 ...).

    The same code for any number of ranks: `batches` are the whole (host) batches; rank r evaluates rows
    tensor_split(batch, world_size)[r] and `reduce` sums the per-rank totals in place (an all-reduce). A rank whose
    slice is empty evaluates one zero-weight row, so every rank makes the same model calls (FSDP2 collectives)."""
    per_t = torch.zeros(len(t_grid) + 1, dtype=torch.float64, device=device)  # last entry: sample count
    for i, (x0, y) in enumerate(batches):
        eps = torch.randn(x0.shape, generator=seeds.generator("val_noise", seed, i)).to(x0.dtype)
        rows = torch.tensor_split(torch.arange(x0.shape[0]), world_size)[rank]
        weight = 1.0 if len(rows) else 0.0
        rows = rows if len(rows) else torch.zeros(1, dtype=torch.long)
        x, e = x0[rows].to(device), eps[rows].to(device)
        cond = {k: v[rows].to(device) for k, v in condition_kwargs(y).items()}
        for j, t_val in enumerate(t_grid.tolist()):
            t = torch.full((x.shape[0],), t_val, device=device)
            with autocast():
                pred = model(interpolate(x, e, t), t, **cond)
            err = (pred.float() - velocity_target(x, e).float()).pow(2).flatten(1).mean(1)
            per_t[j] += weight * err.double().sum()
        per_t[-1] += weight * x.shape[0]
    if reduce is not None:
        reduce(per_t)
    per_t = (per_t[:-1] / per_t[-1].clamp(min=1)).cpu()
    out = {"val/loss": per_t.mean().item()}
    out.update({f"val/loss_t{t:.3f}": v for t, v in zip(t_grid.tolist(), per_t.tolist())})
    return out


@torch.no_grad()
def euler_sample(
    model,
    noise: torch.Tensor,
    y: torch.Tensor | None = None,
    steps: int = 50,
    cfg_scale: float = 1.0,
    context: torch.Tensor | None = None,
    context_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Integrate dx/dt = v from t = 1 (noise) to t = 0 with `steps` Euler steps: x <- x + (t_next - t) v.
    With cfg_scale != 1 the velocity is v_uncond + s (v_cond - v_uncond), the unconditional branch using the null
    label (and a zero text context)."""
    if steps < 1:
        raise ValueError(f"sampling steps={steps} must be >= 1")
    x = noise
    ts = torch.linspace(1.0, 0.0, steps + 1, device=noise.device)
    guided = cfg_scale != 1.0 and (y is not None or context is not None)
    for i in range(steps):
        t = ts[i].expand(x.shape[0])
        if guided:
            drop = torch.cat([torch.zeros(x.shape[0], dtype=torch.bool), torch.ones(x.shape[0], dtype=torch.bool)])
            drop = drop.to(x.device)
            yy = None if y is None else torch.cat([y, y])
            cc = None if context is None else torch.cat([context, context])
            mm = None if context_mask is None else torch.cat([context_mask, context_mask])
            v_c, v_u = model(torch.cat([x, x]), torch.cat([t, t]), y=yy, context=cc, context_mask=mm,
                             drop_mask=drop).chunk(2)
            v = v_u + cfg_scale * (v_c - v_u)
        else:
            v = model(x, t, y=y, context=context, context_mask=context_mask)
        x = x + (ts[i + 1] - ts[i]) * v.to(x.dtype)
    return x
