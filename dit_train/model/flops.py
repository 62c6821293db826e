"""Model FLOPs of a training step, the numerator of MFU: counted by torch's FlopCounterMode on a forward and
backward of the model built on the meta device (no memory, no arithmetic), so it follows the architecture as
built (per-image adaLN modulation, qk-norm, attention) instead of a 6 N T formula. Activation-checkpointing
recomputation is not counted: model FLOPs, not hardware FLOPs (the usual MFU convention)."""

from __future__ import annotations

import torch
from torch.utils.flop_counter import FlopCounterMode

from dit_train.model.dit import build_model


def training_flops_per_image(model_cfg) -> int:
    """Forward + backward FLOPs of one class-conditional image of `model_cfg` (a Hydra `model` node)."""
    model = build_model(model_cfg, device="meta")
    size, channels = model_cfg.image_size, model_cfg.in_channels
    x = torch.zeros(1, channels, size, size, device="meta")
    t = torch.zeros(1, device="meta")
    y = torch.zeros(1, dtype=torch.long, device="meta")
    with FlopCounterMode(display=False) as counter:
        model(x, t, y=y).float().square().mean().backward()
    return counter.get_total_flops()
