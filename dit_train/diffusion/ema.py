"""Exponential moving average of the weights; samples and evaluation use it. The decay ramps up as
min(decay, (1 + n) / (10 + n)) so short runs are not dominated by the random initialisation.

Under FSDP2 the EMA model is sharded exactly like the trained model (built by the caller and passed as `shadow`):
every rank averages its own fp32 shards, locally, with no communication; sampling with it gathers blocks like
any FSDP2 forward."""

from __future__ import annotations

import copy

import torch
from torch import nn

from dit_train.parallel.fsdp import held_shard, local


class EMA:
    def __init__(self, model: nn.Module, decay: float, shadow: nn.Module | None = None):
        """`shadow`: an already-built (e.g. FSDP2-sharded) copy of `model`'s architecture to hold the average;
        it is set to `model`'s current weights. Without it the average is a deep copy of `model`."""
        self.decay = decay
        if shadow is None:
            self.model = copy.deepcopy(model).eval().requires_grad_(False)
        else:
            self.model = shadow.eval().requires_grad_(False)
            self.copy_from(model)
        self.num_updates = 0

    @torch.no_grad()
    def copy_from(self, model: nn.Module) -> None:
        for e, p in zip(self.model.parameters(), model.parameters(), strict=True):
            local(e).copy_(local(p))
        for e, b in zip(self.model.buffers(), model.buffers(), strict=True):
            local(e).copy_(local(b))

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        self.num_updates += 1
        d = min(self.decay, (1 + self.num_updates) / (10 + self.num_updates))
        # the local shards as held (held_shard): one dispatched lerp, not a view and a detach per parameter too
        ema_p = [held_shard(p) for p in self.model.parameters()]
        new_p = [held_shard(p) for p in model.parameters()]
        torch._foreach_lerp_(ema_p, new_p, 1.0 - d)

    def state_dict(self) -> dict:
        return {"model": self.model.state_dict(), "num_updates": self.num_updates}

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.num_updates = state["num_updates"]
