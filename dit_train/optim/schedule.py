"""Learning-rate schedules as multipliers of each param group's base lr (torch LambdaLR), so every optimizer in
the registry — whose groups all carry an 'lr' — gets the same schedule without knowing about it."""

from __future__ import annotations

import math

from torch.optim.lr_scheduler import LambdaLR

# decay over training progress p in [0, 1] (the names are checked as train.lr_schedule by dit_train.config)
DECAYS = {"cosine": lambda p: 0.5 * (1 + math.cos(math.pi * p)), "linear": lambda p: 1 - p,
          "constant": lambda p: 1.0}


def lr_multiplier(step: int, total: int, warmup: int, kind: str, min_ratio: float) -> float:
    """Linear warmup over `warmup` steps, then cosine/linear decay to min_ratio at `total`, or constant."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if kind == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * DECAYS[kind](progress)


def build_scheduler(optimizer, total_steps: int, warmup_steps: int, kind: str, min_lr_ratio: float) -> LambdaLR:
    return LambdaLR(optimizer, lambda s: lr_multiplier(s, total_steps, warmup_steps, kind, min_lr_ratio))
