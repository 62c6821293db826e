"""dit-study's runner passes a stop signal sent to it alone on to the trainer process (a real child process)."""

import os
import signal
import sys
import threading
import time

from dit_train.study import run as study_run
from dit_train.trainer.preemption import EXIT_PREEMPTED


def test_a_stop_signal_to_the_runner_alone_reaches_the_trainer(tmp_path):
    """`kill RUNNER_PID`: the trainer gets the signal (and exits 75 after its checkpoint) instead of running on."""
    ready = tmp_path / "ready"
    child = ("import signal, sys, time, pathlib\n"
             "signal.signal(signal.SIGTERM, lambda *a: sys.exit(75))\n"
             f"pathlib.Path({str(ready)!r}).touch()\n"
             "time.sleep(60)\nsys.exit(0)\n")

    def signal_the_runner():
        deadline = time.monotonic() + 30
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=signal_the_runner, daemon=True).start()
    previous = signal.getsignal(signal.SIGTERM)
    started = time.monotonic()
    assert study_run.run_trainer([sys.executable, "-c", child]) == EXIT_PREEMPTED
    assert time.monotonic() - started < 30
    assert signal.getsignal(signal.SIGTERM) is previous  # the runner's own handlers are back


def test_the_trainers_dit_study_starts_know_they_run_under_it(tmp_path, capfd):
    """UNDER_STUDY_ENV: a trainer of a dit-study group leaves the advice after a stop signal to dit-study (its own
    line for the group's sweep would continue that group alone)."""
    UNDER_STUDY_ENV = "DIT_TRAIN_UNDER_STUDY"  # dit_train.trainer.preemption.UNDER_STUDY_ENV

    child = f"import os, sys; sys.exit(0 if os.environ.get({UNDER_STUDY_ENV!r}) == '1' else 3)"
    assert study_run.run_trainer([sys.executable, "-c", child]) == 0
