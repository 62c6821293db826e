"""The optimizer's side of a training loop: what the loop tells an optimizer and asks of it (TrainerHooks), and the
timer it measures its phases with (passed in with use_timer, not a global).

MatrixOptimizer implements the hooks; any other torch.optim.Optimizer gets the no-op defaults through hooks_of, so
a loop calls them on every optimizer alike.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import ContextManager, Protocol


class PhaseTimer(Protocol):
    """What the optimizer needs of a timer (dit_train/timing.py's PhaseTimer is one)."""

    def phase(self, name: str) -> ContextManager: ...

    def add_bytes(self, collective: str, nbytes: int) -> None: ...


class NoTimer:
    """Times nothing: the timer of an optimizer no loop gave one."""

    def phase(self, name: str) -> ContextManager:
        return nullcontext()

    def add_bytes(self, collective: str, nbytes: int) -> None:
        pass


class TrainerHooks:
    """Calls a training loop makes on its optimizer besides step/zero_grad; the defaults do nothing."""

    timer: PhaseTimer = NoTimer()

    def use_timer(self, timer: PhaseTimer) -> None:
        """Time the step's phases (momentum, direction, comm, update, adamw) and count collective bytes here."""
        self.timer = timer

    def backward_is_final(self, final: bool) -> None:
        """Gradient accumulation: whether the coming backward is the step's last (the others see partial
        gradients)."""

    def gradients_scaled(self, scaled: bool) -> None:
        """After backward, before step: whether gradient clipping scaled the gradients."""

    def step_info(self) -> dict[str, float]:
        """Scalars about the last step, for the logger."""
        return {}


def hooks_of(optimizer) -> TrainerHooks:
    """The optimizer's hooks: itself where it implements them, the no-op defaults otherwise."""
    return optimizer if isinstance(optimizer, TrainerHooks) else TrainerHooks()
