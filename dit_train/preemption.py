"""Preemption: SIGTERM (scancel, torchrun passing one on) and SIGUSR1/SIGUSR2 (Slurm's --signal warnings; USR2 is
submitit's time-limit signal) end the run at the next step boundary with a checkpoint, on every rank together.

A signal may reach one rank only; each step's loss all-reduce carries this rank's vote (`vote()`), and the run
stops when any rank voted (`agree`). After the checkpoint the signal is handed to the handler that was installed
before ours when that is Python code (submitit's requeue handler); default handlers are not called."""

from __future__ import annotations

import signal

EXIT_PREEMPTED = 75  # EX_TEMPFAIL: "try again later"; schedulers/wrappers treat it as requeue-able
SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)


class Preempted(Exception):
    """A stop signal arrived; a checkpoint of the last finished step has been written."""


class Preemption:
    def __init__(self):
        self.signal_name: str | None = None  # the signal this rank received
        self.votes = 0.0  # ranks that have received one, as agreed at the last step
        self._previous: dict = {}

    def __enter__(self) -> "Preemption":
        self._previous = {s: signal.signal(s, self._on_signal) for s in SIGNALS}
        return self

    def __exit__(self, *exc) -> bool:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        return False

    def _on_signal(self, signum, _frame) -> None:
        self.signal_name = signal.Signals(signum).name

    def vote(self) -> float:
        return float(self.signal_name is not None)

    def agree(self, votes: float) -> None:
        self.votes = float(votes)

    @property
    def requested(self) -> bool:
        return self.votes > 0  # never this rank's own flag alone: the ranks must stop at the same step

    def stop(self, step: int, run_dir: str) -> Preempted:
        """Hand the signal over, then the exception that ends the run (raise it)."""
        if self.signal_name is not None:
            previous = self._previous.get(signal.Signals[self.signal_name])
            if callable(previous):
                previous(signal.Signals[self.signal_name].value, None)
        return Preempted(f"received {self.signal_name or 'a stop signal (on another rank)'} at step {step}; "
                         f"checkpoint written, rerun with train.resume=auto run_dir={run_dir} to continue")
