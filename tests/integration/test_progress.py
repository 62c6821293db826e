"""Feedback on long work, seen from a terminal (a pseudo-terminal, python's pty): training, its evaluations,
`dit-sample` and `dit-fd` show tqdm bars; a pipe or a log file gets none; a message
printed while a bar is up ('preempted: ...', a log line) starts a line of its own."""

import fcntl
import os
import pty
import select
import signal
import struct
import subprocess
import sys
import termios
import time

import pytest

from conftest import ROOT, needs_fashion
from dit_train.trainer.preemption import EXIT_PREEMPTED

pytestmark = needs_fashion

TINY = ["model.hidden_size=32", "model.depth=1", "model.num_heads=1", "model.patch_size=8", "train.batch_size=4",
        "train.val_samples=4", "train.val_batch_size=4", "train.val_t_points=1", "train.samples_per_class=1",
        "train.warmup_steps=0", "train.log_every=1", "train.ckpt_every=0", "train.progress=true"]
FD = ["--eval-preset", "ci", "--encoder", "dinov2_random", "--reference-split", "val", "--reference-num", "16",
      "--num-samples", "8", "--batch-size", "8", "--sample-steps", "2", "--no-grid"]
# one intra-op thread, as conftest gives each CI worker: a second one on 2 shared cores only adds contention
ENV = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}


def pseudo_terminal() -> tuple[int, int]:
    """(master, slave) of a new 120-column pseudo-terminal."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    return master, slave


def read_terminal(master: int) -> bytes | None:
    """What the terminal received within 0.2 s (b"" if nothing yet); None once every writer has closed it."""
    if not select.select([master], [], [], 0.2)[0]:
        return b""
    try:
        return os.read(master, 1 << 16) or None
    except OSError:  # EIO: every writer has closed the terminal
        return None


def on_terminal(cmd, cwd, signal_when: bytes | None = None, timeout: float = 240) -> tuple[int, str]:
    """Run `cmd` with stdin, stdout and stderr on a 120-column pseudo-terminal; SIGTERM it once its output contains
    `signal_when`. Returns (exit status, everything it wrote, as the terminal received it)."""
    master, slave = pseudo_terminal()
    proc = subprocess.Popen(cmd, stdin=slave, stdout=slave, stderr=slave, cwd=cwd, env=ENV, close_fds=True)
    os.close(slave)
    out, t0 = b"", time.time()
    try:
        while time.time() - t0 < timeout:
            chunk = read_terminal(master)
            if chunk is None:
                break
            out += chunk
            if signal_when is not None and signal_when in out:
                proc.send_signal(signal.SIGTERM)
                signal_when = None
        else:
            raise TimeoutError(out.decode(errors="replace")[-2000:])
        return proc.wait(timeout=60), out.decode(errors="replace")
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)


def main_on_terminal(main, argv) -> tuple[int, str]:
    """main(argv) in this process with sys.stdout and sys.stderr on a 120-column pseudo-terminal: (its return value,
    everything it wrote). For a flag's effect on what a terminal gets; a new Python importing torch is ~3 s here."""
    import contextlib

    master, slave = pseudo_terminal()
    out = b""
    try:
        with open(slave, "w", closefd=True) as tty:
            with contextlib.redirect_stdout(tty), contextlib.redirect_stderr(tty):
                code = main(argv)  # a few hundred bytes: well inside the terminal's buffer, read below
        while chunk := read_terminal(master):  # until nothing more comes, or the terminal is closed
            out += chunk
    finally:
        os.close(master)
    return code, out.decode(errors="replace")


def visible_lines(text: str) -> list[str]:
    """The lines a terminal shows: a carriage return moves back to the line's start, so what follows the last one
    (a bar's redraw, a message that cleared it) is the line's visible beginning."""
    return [line.rstrip("\r").split("\r")[-1] for line in text.split("\n")]


def line_with(text: str, marker: str) -> str:
    """The first visible line with `marker`; for a bar, its last state."""
    lines = [line for line in visible_lines(text) if marker in line]
    assert lines, text[-3000:]
    return lines[0]


def bar(text: str, desc: str) -> str:
    """The last drawing of the bar `desc` (each redraw starts with a carriage return, the bar's name first)."""
    drawn = [part for part in text.replace("\n", "\r").split("\r") if part.startswith(desc)]
    assert drawn, text[-3000:]
    return drawn[-1]


@pytest.fixture(scope="module")
def stopped_in_the_grid(tmp_path_factory):
    """3 steps, end-of-run validation and a sample grid of 200000 Euler steps, SIGTERM once the grid's bar is up."""
    folder = tmp_path_factory.mktemp("progress")
    code, out = on_terminal([sys.executable, "-m", "dit_train", f"run_dir={folder / 'run'}", *TINY, "train.steps=3",
                             "train.val_every=3", "train.sample_every=3", "train.sample_steps=200000"], str(folder),
                            signal_when=b"sample grid:")
    return folder / "run", code, out


def test_training_and_its_end_of_run_evaluations_show_bars(stopped_in_the_grid):
    _, code, out = stopped_in_the_grid
    assert code == EXIT_PREEMPTED, out[-3000:]
    assert "| 3/3 [" in bar(out, "train:")
    assert "| 1/1 [" in bar(out, "validation loss:")  # one batch at one t: the EMA model's calls
    assert "/200000 [" in bar(out, "sample grid:")


def test_preempted_is_a_line_of_its_own_after_an_evaluation_bar(stopped_in_the_grid):
    _, _, out = stopped_in_the_grid
    assert line_with(out, "preempted:").startswith("preempted: received SIGTERM at step 3"), out[-3000:]


def test_preempted_is_a_line_of_its_own_after_the_training_bar(tmp_path):
    """Before: 'train:   3%|...| 12/400 [...]preempted: received SIGTERM ...' on one line."""
    code, out = on_terminal([sys.executable, "-m", "dit_train", f"run_dir={tmp_path / 'run'}", *TINY,
                             "train.steps=400", "train.val_every=0", "train.sample_every=0"], str(tmp_path),
                            signal_when=b"/400 [")
    assert code == EXIT_PREEMPTED, out[-3000:]
    assert line_with(out, "preempted:").startswith("preempted: received SIGTERM at step"), out[-3000:]
    assert not line_with(out, "saved checkpoint").startswith("train:")  # a log line during the bar: above it


@pytest.mark.parametrize("job", ["sample", "fd"])
def test_sample_and_fd_jobs_show_a_bar_on_a_terminal_and_none_in_a_pipe(stopped_in_the_grid, job, tmp_path, capfd,
                                                                       monkeypatch):
    from dit_train.evaluation.fd.job import main as fd_main
    from dit_train.sample import main as sample_main

    run, _, _ = stopped_in_the_grid
    if job == "sample":
        module, args, desc = "dit_train.sample", [str(run), "--steps", "3", "--grid", str(tmp_path / "grid.png")], \
            "sample:"
    else:
        module, args, desc = "dit_train.evaluation.fd.job", [str(run), "--out", str(tmp_path), "--cache-dir",
                                                             str(tmp_path / "cache"), "--force", *FD], \
            "FD dit_s adamw lr=0.002 seed=0 step 3:"  # the run labelled by its config
    cmd = [sys.executable, "-m", module, *args]
    code, out = on_terminal(cmd, str(tmp_path))
    assert code == 0, out[-3000:]
    assert "100%" in bar(out, desc)
    if job == "fd":
        assert "100%" in bar(out, "reference statistics (dinov2_random):")
        assert line_with(out, "[fd] dit_s adamw lr=0.002 seed=0 (folder run) step 3: FD=").startswith("[fd]")
    # stderr not a terminal (pytest's capture: a file), in this process; a new Python importing torch is ~3 s
    monkeypatch.chdir(tmp_path)
    capfd.readouterr()
    if job == "sample":
        assert sample_main(args) == 0
    else:
        assert fd_main(args)
    piped = capfd.readouterr()
    assert desc not in piped.err + piped.out and "%|" not in piped.err, piped.err
    if job == "sample":  # the flag is the same for both; on a terminal, as this process's stdout and stderr
        for flags in ([], ["--no-progress"]):  # without the flag the same terminal gets the bar: it is a terminal
            code, out = main_on_terminal(sample_main, [*args, *flags])
            assert code == 0 and (desc in out and "100%" in bar(out, desc)) == (not flags), out[-3000:]
            assert flags or "%|" in out, out[-3000:]
