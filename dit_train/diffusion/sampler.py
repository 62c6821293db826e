"""The one sampler behind the training grids, in-training FD, the FD job and inference: EMA weights, Gaussian
noise from a given generator, Euler steps with classifier-free guidance (flow.euler_sample), clamped to [-1, 1].
Under FSDP2 every rank must call it with the same batch sizes (the model call is a collective)."""

from __future__ import annotations

from typing import Callable

import torch

from dit_train.diffusion.flow import euler_sample
from dit_train.parallel.fsdp import autocast

Sampler = Callable[..., torch.Tensor]


def noise_shape(model_cfg) -> tuple[int, int, int]:
    """[C, H, W] of one sample in the space the model works in (pixels, or a latent run's latents)."""
    return int(model_cfg.in_channels), int(model_cfg.image_size), int(model_cfg.image_size)


def as_latents(x: torch.Tensor) -> torch.Tensor:
    """The `decode` of a sampler whose latents are decoded later (by one rank, or all at once): float32 and never
    clamped, since latents are not confined to [-1, 1] as pixels are."""
    return x.float()


def make_sampler(model: torch.nn.Module, model_cfg, device, steps: int, cfg_scale: float,
                 precision: str = "fp32", decode=None) -> Sampler:
    """`sample(labels, generator, context=None, context_mask=None, noise=None) -> images [B, C, H, W]` for `model`
    (the EMA model in eval mode); `noise` (drawn by the caller, e.g. once for several calls) replaces the draw from
    `generator`. Labels are ignored by an unconditional model (model.num_classes = 0). `decode` turns the final x
    into the output: a latent run's vae.LatentCodec.decode (images), `as_latents`, or by default pixels clamped to
    [-1, 1]."""
    device = torch.device(device)
    shape = noise_shape(model_cfg)
    conditional = int(model_cfg.get("num_classes", 0) or 0) > 0

    @torch.no_grad()
    def sample(labels: torch.Tensor, generator: torch.Generator | None, context=None, context_mask=None,
               noise: torch.Tensor | None = None) -> torch.Tensor:
        if noise is None:
            noise = torch.randn((labels.shape[0], *shape), generator=generator, device=device)
        with autocast(precision, device):
            x = euler_sample(model, noise.to(device), y=labels.to(device) if conditional else None, steps=int(steps),
                             cfg_scale=float(cfg_scale), context=context, context_mask=context_mask)
        return decode(x) if decode is not None else x.float().clamp(-1, 1)

    return sample
