"""What each training step measured, kept unread until the loop needs the numbers, then read in one go.

Why: reading a device value on the host (`.item()`, a CUDA synchronisation) makes the CPU wait for the GPU, so it
cannot queue the next kernels while the GPU works. Ordinary steps therefore keep their loss and gradient norm as
device tensors and their timings as clock marks (timing.py); a log row, an evaluation, a checkpoint, a stop or
the last step reads every pending step at once (one wait, one device-to-host copy) and hands the numbers over
step by step, in order, so the window means still cover every step (step_window.py) and the values are the ones
a per-step read would have given.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dit_train.telemetry.clocks import StepTimes


@dataclass
class PendingStep:
    loss: torch.Tensor  # 0-d, on the device
    grad_norm: torch.Tensor
    data_start: object  # clock marks: the wait for the batch began / the step began / the step ended
    start: object
    end: object
    phases: StepTimes
    refresh: float | None  # the step's opt/refresh (None: no periodic schedule, or skipped)


@dataclass
class StepNumbers:
    loss: float
    grad_norm: float
    step_time: float
    data_time: float
    phases: dict[str, float]
    refresh: float | None


class DeferredSteps:
    # a run that neither logs, evaluates nor saves for this many steps is still read now and then, so the pending
    # tensors and CUDA events stay bounded
    MAX_PENDING = 1000

    def __init__(self, clock):
        self.clock = clock
        self.pending: list[PendingStep] = []

    def add(self, step: PendingStep) -> None:
        self.pending.append(step)

    @property
    def full(self) -> bool:
        return len(self.pending) >= self.MAX_PENDING

    def read(self) -> list[StepNumbers]:
        """Every pending step's numbers, oldest first (one wait and one copy to the host); then none is pending."""
        steps, self.pending = self.pending, []
        if not steps:
            return []
        self.clock.wait()
        device = steps[0].loss.device
        values = torch.stack([t.float().to(device) for s in steps for t in (s.loss, s.grad_norm)]).tolist()
        return [StepNumbers(values[2 * i], values[2 * i + 1], self.clock.seconds(s.start, s.end),
                            self.clock.seconds(s.data_start, s.start), s.phases.read(), s.refresh)
                for i, s in enumerate(steps)]
