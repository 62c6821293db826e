"""Exponential moving average of the weights; samples and evaluation use it. The decay ramps up as
min(decay, (1 + n) / (10 + n)) so short runs are not dominated by the random initialisation."""

from __future__ import annotations

import copy

import torch
from torch import nn


class EMA:
    def __init__(self, model: nn.Module, decay: float):
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"train.ema_decay={decay} must be in [0, 1)")
        self.decay = decay
        self.model = copy.deepcopy(model).eval().requires_grad_(False)
        self.num_updates = 0

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        self.num_updates += 1
        d = min(self.decay, (1 + self.num_updates) / (10 + self.num_updates))
        ema_p = [p for p in self.model.parameters()]
        new_p = [p.detach() for p in model.parameters()]
        torch._foreach_lerp_(ema_p, new_p, 1.0 - d)

    def state_dict(self) -> dict:
        return {"model": self.model.state_dict(), "num_updates": self.num_updates}

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.num_updates = state["num_updates"]
