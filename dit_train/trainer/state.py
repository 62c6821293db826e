"""TrainState: everything besides the tensors that a run needs to continue exactly, as JSON values.

The step is also the data position (data/order.py), so (step, weights, optimizer, schedule, training generator)
determine the rest of the run. The training generator is the only random source training draws from after the
weights are initialised (noise, timesteps and condition dropout; validation, grids and FD use their own seed
streams), and it is the same on every rank, so one state serves any number of ranks.
"""

from __future__ import annotations

import base64
from collections import deque
from dataclasses import dataclass, field

import torch


TRAIN_LOSS_WINDOW = 50  # summary.json's train_loss: the mean of the last this many steps' losses
CPU_STATE_BYTES = 5056  # torch.Generator's mt19937 state on the CPU (a CUDA generator's Philox state is 16 bytes)


class DeviceKindChanged(ValueError):
    """A run's checkpoint taken to another device kind (cpu <-> cuda)."""


@dataclass
class TrainState:
    scheduler: object  # torch.optim.lr_scheduler.LRScheduler
    generator: torch.Generator
    ema: object  # dit_train.diffusion.ema.EMA
    step: int = 0
    active_time_s: float = 0.0  # wall time inside training steps (no eval, no checkpointing)
    skipped_steps: int = 0
    best_fd: dict | None = None  # {"fd", "step", "active_time_s"} of the lowest FD so far
    metric_best: dict = field(default_factory=dict)  # registered metric name -> {"value", "step"} (metric.py)
    config: dict = field(default_factory=dict)  # the resolved run config, for export/sampling/FD jobs
    data_fingerprint: dict | None = None  # data/datasets.py: what data the run trains on, checked on resume
    ckpt_write_s: float | None = None  # the write time of the run's last finished checkpoint (rank 0's measure)
    # a latent run's VAE as data.root/latents_info.json records it (config/latents.py: vae_record): dit-sample,
    # dit-export and dit-fd check --vae against it once the latents folder has moved. Absent in older checkpoints
    latents_vae: dict | None = None
    # the last TRAIN_LOSS_WINDOW steps' losses (rank-averaged, the same on every rank), whose mean is the summary's
    # train_loss: here so that a resumed run's summary is the uninterrupted run's. Older checkpoints lack it: such
    # a resume starts it empty, and the summary says how many steps its mean covers (train_loss_steps)
    recent_losses: deque = field(default_factory=lambda: deque(maxlen=TRAIN_LOSS_WINDOW))

    def state_dict(self) -> dict:
        return {"step": self.step, "active_time_s": self.active_time_s, "skipped_steps": self.skipped_steps,
                "best_fd": self.best_fd, "scheduler": self.scheduler.state_dict(),
                "generator": base64.b64encode(self.generator.get_state().numpy().tobytes()).decode(),
                "generator_device": self.generator.device.type,
                "ema_num_updates": self.ema.num_updates, "config": self.config,
                "data_fingerprint": self.data_fingerprint, "ckpt_write_s": self.ckpt_write_s,
                "recent_losses": list(self.recent_losses),
                **({"latents_vae": self.latents_vae} if self.latents_vae else {}),
                **({"metric_best": self.metric_best} if self.metric_best else {})}

    def _lr_from_schedule(self) -> None:
        """Each group's lr as the schedule gives it at the loaded step (what LambdaLR.step sets), not the lr the
        checkpoint's optimizer state holds: the next step uses it, and a crafted one was used as it was."""
        lrs = [base * schedule(self.scheduler.last_epoch)
               for base, schedule in zip(self.scheduler.base_lrs, self.scheduler.lr_lambdas)]
        for group, lr in zip(self.scheduler.optimizer.param_groups, lrs):
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(lr)
            else:
                group["lr"] = lr
        self.scheduler._last_lr = lrs

    def load_state_dict(self, state: dict) -> None:
        """A checkpoint's train state (from elsewhere, maybe crafted): the scheduler takes only the keys of its own
        state (LRScheduler.load_state_dict sets any key as an attribute); anything missing or of the wrong type
        is one line."""
        from dit_train.runs.checkpoint import CheckpointError

        built_base_lrs = list(self.scheduler.base_lrs)  # the config's lr per group (their initial_lr)
        try:
            unknown = set(state["scheduler"]) - set(self.scheduler.state_dict())
            if unknown:
                raise ValueError(f"scheduler state has keys {sorted(unknown)} that this run's scheduler lacks")
            step, active, skipped = int(state["step"]), float(state["active_time_s"]), int(state["skipped_steps"])
            generator = torch.frombuffer(bytearray(base64.b64decode(state["generator"], validate=True)),
                                         dtype=torch.uint8).clone()
            written_on = state.get("generator_device") or ("cpu" if generator.numel() == CPU_STATE_BYTES else "cuda")
            here = self.generator.device.type
            if written_on != here:
                raise DeviceKindChanged(
                    f"the checkpoint was written by a {written_on} run and this run trains on {here}: the training "
                    f"generator's state ({'mt19937' if written_on == 'cpu' else 'Philox'}) does not carry across "
                    f"device kinds, so the run could not continue exactly; resume on {written_on}, or start a new "
                    f"run from its weights with train.init_from=<checkpoint>")
            self.scheduler.load_state_dict(state["scheduler"])
            if self.scheduler.base_lrs != built_base_lrs:
                raise CheckpointError(f"its train state's scheduler has base_lrs={self.scheduler.base_lrs!r}, and "
                                      f"this run's config gives {built_base_lrs!r}: the config is what a run trains "
                                      f"with; resume with the config the checkpoint was written with")
            self._lr_from_schedule()
            recent = state.get("recent_losses", [])
            if not isinstance(recent, list) or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                       for v in recent):
                raise TypeError("recent_losses is not a list of numbers")
            self.generator.set_state(generator)
            self.ema.num_updates = int(state["ema_num_updates"])
        except DeviceKindChanged as e:
            raise CheckpointError(str(e)) from None
        except CheckpointError:
            raise
        except (KeyError, TypeError, ValueError, RuntimeError) as e:
            raise CheckpointError(f"the checkpoint's train state is damaged or not dit_train's "
                                  f"({type(e).__name__}: {e}); use an earlier checkpoint") from None
        self.step, self.active_time_s, self.skipped_steps = step, active, skipped
        self.best_fd = state.get("best_fd")
        self.recent_losses = deque((float(v) for v in recent), maxlen=TRAIN_LOSS_WINDOW)
        self.metric_best = dict(state["metric_best"]) if isinstance(state.get("metric_best"), dict) else {}
        self.ckpt_write_s = state.get("ckpt_write_s") if isinstance(state.get("ckpt_write_s"), (int, float)) else None
        if self.latents_vae is None and isinstance(state.get("latents_vae"), dict):  # resumed from a moved data.root
            self.latents_vae = state["latents_vae"]
