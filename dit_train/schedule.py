"""Learning-rate schedules as multipliers of each param group's base lr (torch LambdaLR), so every optimizer in
the registry — whose groups all carry an 'lr' — gets the same schedule without knowing about it."""

from __future__ import annotations

import math

from torch.optim.lr_scheduler import LambdaLR

SCHEDULES = ("cosine", "constant", "linear")


def lr_multiplier(step: int, total: int, warmup: int, kind: str, min_ratio: float) -> float:
    """Linear warmup over `warmup` steps, then cosine/linear decay to min_ratio at `total`, or constant."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if kind == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if kind == "cosine":
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    if kind == "linear":
        return min_ratio + (1 - min_ratio) * (1 - progress)
    raise ValueError(f"train.lr_schedule={kind!r} is not valid; choose one of {', '.join(SCHEDULES)}")


def build_scheduler(optimizer, total_steps: int, warmup_steps: int, kind: str, min_lr_ratio: float) -> LambdaLR:
    return LambdaLR(optimizer, lambda s: lr_multiplier(s, total_steps, warmup_steps, kind, min_lr_ratio))
