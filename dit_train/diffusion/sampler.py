"""The one sampler behind the training grids, in-training FD, the FD job and inference: EMA weights, Gaussian
noise from a given generator, Euler steps with classifier-free guidance (flow.euler_sample), clamped to [-1, 1].
Under FSDP2 every rank must call it with the same batch sizes (the model call is a collective)."""

from __future__ import annotations

from typing import Callable

import torch

from dit_train.diffusion.flow import euler_sample
from dit_train.parallel.fsdp import autocast

Sampler = Callable[..., torch.Tensor]


def make_sampler(model: torch.nn.Module, model_cfg, device, steps: int, cfg_scale: float,
                 precision: str = "fp32", decode=None) -> Sampler:
    """`sample(labels, generator, context=None, context_mask=None) -> images [B, C, H, W]` for `model` (the EMA
    model in eval mode). Labels are ignored by an unconditional model (model.num_classes = 0). `decode` (a latent
    run's vae.LatentCodec.decode) turns the sampled latents into images."""
    device = torch.device(device)
    shape = (int(model_cfg.in_channels), int(model_cfg.image_size), int(model_cfg.image_size))
    conditional = int(model_cfg.get("num_classes", 0) or 0) > 0

    @torch.no_grad()
    def sample(labels: torch.Tensor, generator: torch.Generator, context=None, context_mask=None) -> torch.Tensor:
        noise = torch.randn((labels.shape[0], *shape), generator=generator, device=device)
        with autocast(precision, device):
            x = euler_sample(model, noise, y=labels.to(device) if conditional else None, steps=int(steps),
                             cfg_scale=float(cfg_scale), context=context, context_mask=context_mask)
        return decode(x) if decode is not None else x.float().clamp(-1, 1)

    return sample
