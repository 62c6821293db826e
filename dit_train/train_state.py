"""TrainState: everything besides the tensors that a run needs to continue exactly, as JSON values.

The step is also the data position (data/order.py), so (step, weights, optimizer, schedule, training generator)
determine the rest of the run. The training generator is the only random source training draws from after the
weights are initialised (noise, timesteps and condition dropout; validation, grids and FD use their own seed
streams), and it is the same on every rank, so one state serves any number of ranks.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field

import torch


@dataclass
class TrainState:
    scheduler: object  # torch.optim.lr_scheduler.LRScheduler
    generator: torch.Generator
    ema: object  # dit_train.ema.EMA
    step: int = 0
    active_time_s: float = 0.0  # wall time inside training steps (no eval, no checkpointing)
    skipped_steps: int = 0
    best_fd: dict | None = None  # {"fd", "step", "active_time_s"} of the lowest FD so far
    config: dict = field(default_factory=dict)  # the resolved run config, for export/sampling/FD jobs
    data_fingerprint: dict | None = None  # data/__init__.py: what data the run trains on, checked on resume

    def state_dict(self) -> dict:
        return {"step": self.step, "active_time_s": self.active_time_s, "skipped_steps": self.skipped_steps,
                "best_fd": self.best_fd, "scheduler": self.scheduler.state_dict(),
                "generator": base64.b64encode(self.generator.get_state().numpy().tobytes()).decode(),
                "ema_num_updates": self.ema.num_updates, "config": self.config,
                "data_fingerprint": self.data_fingerprint}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])
        self.active_time_s = float(state["active_time_s"])
        self.skipped_steps = int(state["skipped_steps"])
        self.best_fd = state["best_fd"]
        self.scheduler.load_state_dict(state["scheduler"])
        raw = bytearray(base64.b64decode(state["generator"]))
        self.generator.set_state(torch.frombuffer(raw, dtype=torch.uint8).clone())
        self.ema.num_updates = int(state["ema_num_updates"])
