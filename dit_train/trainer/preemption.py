"""Preemption: SIGTERM (scancel, torchrun passing one on), SIGUSR1/SIGUSR2 (Slurm's --signal warnings; USR2 is
submitit's time-limit signal) and SIGINT (Ctrl-C) end the run at the next step boundary with a checkpoint, on
every rank together.

A signal may reach one rank only; each step's loss all-reduce carries this rank's vote (`vote()`), and the run
stops when any rank voted (`agree`). Rank 0's vote weighs RANK0_VOTE, so the sum also tells every rank whether
rank 0 received one: rank 0 alone says `preempted: ...` (once, not once per rank), and another rank adds a line
only when it received a signal and rank 0 still had none when the ranks voted again, after the checkpoint, just
before the stop (its name, which rank 0 cannot know). torchrun passes a signal to every rank at almost the same
moment: one that reached rank 0 just after the vote that started the stop is counted by then, so rank 0's line is
the only one. Evaluations (validation, FD, grids; at the end of a run they can take minutes) vote before every call
of the EMA model and stop there, saying what they skipped. After the checkpoint the signal is handed to the handler
that was installed before ours when that is Python code (submitit's requeue handler); default handlers are not
called. Once a stop is under way, a second signal is only recorded, so the exit code stays the requeue-able one."""

from __future__ import annotations

import functools
import signal
import sys
from typing import NoReturn

from dit_train.config.override_text import shell_override

# set by dit-study for the trainers it starts: their sweep is one group of the study, which says itself how to go on
UNDER_STUDY_ENV = "DIT_TRAIN_UNDER_STUDY"
EXIT_PREEMPTED = 75  # EX_TEMPFAIL: "try again later"; schedulers/wrappers treat it as requeue-able
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what shells expect after Ctrl-C
SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGINT)
RANK0_VOTE = float(2 ** 20)  # above any number of other ranks; the float32 sum stays exact (under 2**24)


def exit_interrupted(line: str) -> NoReturn:
    """Ctrl-C where nothing is checkpointed (before training starts; the other dit-* commands): `line`, saying what
    was left and how to go on, instead of a KeyboardInterrupt traceback, and exit 130 as training's own Ctrl-C."""
    print(line, file=sys.stderr)
    sys.exit(EXIT_INTERRUPTED)


def ctrl_c_exits(line: str):
    """A command's main() whose Ctrl-C is exit_interrupted(line): one line saying what it left, exit 130."""
    def wrap(main):
        @functools.wraps(main)  # keeps its name: tests and console scripts call it as `main`
        def command(*args, **kwargs):
            try:
                return main(*args, **kwargs)
            except KeyboardInterrupt:
                exit_interrupted(line)
        return command
    return wrap


class Preempted(Exception):
    """A stop signal arrived; a checkpoint of the last finished step has been written."""

    def __init__(self, message: str, signal_name: str | None, announce: bool = True):
        super().__init__(message)
        self.exit_code = EXIT_INTERRUPTED if signal_name == "SIGINT" else EXIT_PREEMPTED
        self.announce = announce  # whether this rank prints it (rank 0, or a rank that knows more than rank 0)


class Preemption:
    def __init__(self, rank: int = 0):
        self.rank = rank
        self.signal_name: str | None = None  # the signal this rank received
        self.votes = 0.0  # the ranks' summed votes at the last agreement (rank 0's weighs RANK0_VOTE)
        self._previous: dict = {}

    def __enter__(self) -> "Preemption":
        self._previous = {s: signal.signal(s, self._on_signal) for s in SIGNALS}
        return self

    def __exit__(self, *exc) -> bool:
        for s, handler in self._previous.items():
            if self.signal_name is None or callable(handler):
                signal.signal(s, handler)
            # else (stopping, and the old disposition was to die): ours stays, so a second SIGTERM during the
            # shutdown cannot kill the process before it has exited with the requeue-able code
        return False

    @staticmethod
    def ignore_further_signals() -> None:
        """For a process about to exit after a stop: Python restores default handlers while it finalizes, so a
        late signal would still kill it (exit 143 instead of 75); an ignored one cannot."""
        for s in SIGNALS:
            if s != signal.SIGINT:
                signal.signal(s, signal.SIG_IGN)

    def _on_signal(self, signum, _frame) -> None:
        self.signal_name = self.signal_name or signal.Signals(signum).name

    def vote(self) -> float:
        if self.signal_name is None:
            return 0.0
        return RANK0_VOTE if self.rank == 0 else 1.0

    @property
    def rank0_received(self) -> bool:
        return self.votes >= RANK0_VOTE

    @property
    def other_ranks(self) -> int:
        """How many ranks besides rank 0 had received a signal at the last agreement."""
        return int(self.votes % RANK0_VOTE)

    def agree(self, votes: float) -> None:
        self.votes = float(votes)

    @property
    def requested(self) -> bool:
        return self.votes > 0  # never this rank's own flag alone: the ranks must stop at the same step

    def stop(self, step: int, run_dir: str, skipped: list[str] = (), last_step: bool = False) -> Preempted:
        """Hand the signal over, then the exception that ends the run (raise it). `skipped`: the evaluations the
        signal cut short, named in the message; after the last step the training is complete, and a rerun does
        only the end-of-run work that was skipped."""
        if self.signal_name is not None:
            previous = self._previous.get(signal.Signals[self.signal_name])
            if _is_python_code(previous):
                previous(signal.Signals[self.signal_name].value, None)
        n = self.other_ranks
        elsewhere = "another rank" if n <= 1 else f"{n} other ranks"
        received = f"received {self.signal_name or f'a stop signal (on {elsewhere})'} at step {step}"
        if last_step:
            message = (f"{received}, the last, during the end-of-run work: its checkpoint was written first; "
                       f"skipped {', '.join(skipped)} and summary.json; rerun with train.resume=auto "
                       f"{shell_override('run_dir', run_dir)} to do only them")
        else:
            during = f" during the evaluation (skipped {', '.join(skipped)})" if skipped else ""
            message = (f"{received}{during}; checkpoint written, rerun with train.resume=auto "
                       f"{shell_override('run_dir', run_dir)} to continue")
        if self.rank == 0:
            return Preempted(message, self.signal_name)
        if self.signal_name is not None and not self.rank0_received:  # the signal's name, which rank 0 lacks
            return Preempted(f"rank {self.rank} received {self.signal_name} at step {step} (rank 0 did not; its "
                             f"line says what to do)", self.signal_name)
        return Preempted(message, self.signal_name, announce=False)  # rank 0 says it


def _is_python_code(handler) -> bool:
    """A handler installed by Python code (not SIG_DFL/SIG_IGN, and not Python's own KeyboardInterrupt raiser)."""
    return callable(handler) and handler is not signal.default_int_handler
