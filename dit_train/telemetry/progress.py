"""Progress bars for long work (training steps, sampling, validation, FD): a tqdm bar on stderr when asked for and
stderr is a terminal (a log file or a pipe gets none), and the ways to print beside one without sharing its line."""

from __future__ import annotations

import contextlib
import sys

from dit_train.plain_text import printable


def progress_bar(total: int | None, desc: str, enabled: bool = True, **kwargs):
    """A tqdm bar, or, when not `enabled` or stderr is not a terminal, a disabled one with the same methods."""
    from tqdm import tqdm

    return tqdm(total=total, desc=printable(desc), dynamic_ncols=True, file=sys.stderr,
                disable=None if enabled else True, **kwargs)  # None: off when not a TTY


@contextlib.contextmanager
def model_call_bar(model, total: int, desc: str, enabled: bool = True, leave: bool = True):
    """A bar advanced by every forward call of `model` (an Euler step of a batch, a validation batch at one t),
    closed on leaving, also on an error, so that a message printed next starts on a line of its own."""
    # every call drawn (tqdm draws at most every 0.1 s by default): a call is a whole model forward, and a part
    # shorter than 0.1 s would otherwise leave its bar at 0 when it closes
    bar = progress_bar(total, desc, enabled, unit="call", leave=leave, mininterval=0)

    def count(*_) -> None:  # returns None: a forward hook's return value would replace the model's output
        bar.update(1)

    handle = model.register_forward_hook(count)
    try:
        yield bar
    finally:
        handle.remove()
        bar.close()


@contextlib.contextmanager
def logging_beside_bars(enabled: bool = True):
    """While inside (if `enabled`: a bar is shown), log records printed to the console go through tqdm.write:
    above an active bar, never on its line (log files are untouched)."""
    if not enabled:
        yield
        return
    from tqdm.contrib.logging import logging_redirect_tqdm

    with logging_redirect_tqdm():
        yield


def write(message: str) -> None:
    """print(message) above any active bar, as one line: a name in it from a file or folder (a run's label) can hold
    control characters (plain_text.printable)."""
    from tqdm import tqdm

    tqdm.write(printable(message), file=sys.stdout)
