"""One timeline per run folder: a run that resumes from step S while the folder holds later steps (train.resume=<an
earlier checkpoint>, or a crash that logged steps past its last checkpoint) starts a branch, and the branch owns the
run from then on. What the abandoned timeline left after step S -- checkpoints, metrics.jsonl rows, sample grids,
summary.json -- is moved aside, never deleted, into `<run_dir>/abandoned/<time>-after-step-<S>/` before training
writes anything. Otherwise train.resume=auto would return to the abandoned newest checkpoint, pruning (keep_last)
would count the abandoned checkpoints and delete the branch's own start, and metrics.jsonl would read 1..30, 11, 12.
"""

from __future__ import annotations

import json
import os
import re
import time

from dit_train.runs import checkpoint as ckpt
from dit_train.runs.atomic_io import atomic_write_bytes, fsync_dir
from dit_train.telemetry.metrics import read_summary
from dit_train.telemetry.metrics_lines import metrics_lines

ABANDONED = "abandoned"
SAMPLE_RE = re.compile(r"^(?:fd_)?step_([0-9]{8})\.png$")  # ASCII digits, as checkpoint.CKPT_RE
NOTE = "ABANDONED.txt"


def _later_files(folder: str, patterns, step: int) -> list[str]:
    """Names in `folder` whose step (group 1 of a pattern) is after `step`, oldest first."""
    names = os.listdir(folder) if os.path.isdir(folder) else []
    later = [n for n in names for p in patterns if (m := p.match(n)) and int(m.group(1)) > step]
    return sorted(later)


def _split_metrics(path: str, step: int) -> tuple[bytes, bytes, list[int]]:
    """(rows to keep, rows after `step`, their steps). A line that is not a JSON row (a torn last line) is kept:
    the logger drops it before appending."""
    try:
        lines = list(metrics_lines(path))  # bounded: a sparse huge file from elsewhere is refused in one line
    except FileNotFoundError:
        return b"", b"", []
    keep, later, steps = [], [], []
    for line in lines:
        try:
            row_step = json.loads(line).get("step")
        except (ValueError, AttributeError, RecursionError):  # torn; not an object; nested 10^5 deep
            row_step = None
        if isinstance(row_step, int) and row_step > step:
            later.append(line)
            steps.append(row_step)
        else:
            keep.append(line)
    return b"".join(keep), b"".join(later), steps


def _summary_after(path: str, step: int) -> str | None:
    """How summary.json belongs to steps after `step` ("steps 30"; "unreadable": it could not say), else None."""
    try:
        steps = read_summary(path).get("steps")
    except (ValueError, AttributeError):  # torn, or not a JSON object: kept, not trusted
        return "unreadable"
    return f"steps {steps}" if isinstance(steps, int) and steps > step else None


def _listed(names: list[str]) -> str:
    return ", ".join(names) if len(names) <= 4 else f"{names[0]} ... {names[-1]} ({len(names)} files)"


def _new_folder(run_dir: str, step: int) -> str:
    what = "before-a-new-start" if step < 0 else f"after-step-{step}"
    base = os.path.join(run_dir, ABANDONED, f"{time.strftime('%Y-%m-%dT%H-%M-%S')}-{what}")
    folder, n = base, 1
    while os.path.exists(folder):
        n += 1
        folder = f"{base}-{n}"
    os.makedirs(folder)
    return folder


def set_aside_before_a_new_start(run_dir: str) -> str | None:
    """A run that starts from step 0 in a folder that has records but no checkpoint (a first attempt that died
    before its first checkpoint and is requeued; a run_dir used again): the earlier attempt's metrics.jsonl rows,
    grids and summary.json go aside as an abandoned timeline. Appended to, metrics.jsonl mixed the two runs."""
    return set_aside_after(run_dir, -1, None)


def set_aside_after(run_dir: str, step: int, resumed_from: str | None) -> str | None:
    """Rank 0, holding the run folder's lock: move everything of `run_dir` that belongs to steps after `step` into a
    new `abandoned/` folder. Returns the one-line account of what was moved, or None when nothing was after `step`.
    `resumed_from` None: a new start (step -1, everything)."""
    checkpoints = _later_files(ckpt.checkpoint_dir(run_dir), (ckpt.CKPT_RE, ckpt.LEGACY_RE), step)
    samples = _later_files(os.path.join(run_dir, "samples"), (SAMPLE_RE,), step)
    metrics_path = os.path.join(run_dir, "metrics.jsonl")
    keep, later_rows, row_steps = _split_metrics(metrics_path, step)
    summary_path = os.path.join(run_dir, "summary.json")
    summary = _summary_after(summary_path, step)
    if not (checkpoints or samples or row_steps or summary):
        return None
    folder = _new_folder(run_dir, step)
    when = time.strftime('%Y-%m-%d %H:%M:%S')
    note = (f"What this run folder held after step {step} when, at {when}, the run resumed from {resumed_from} and "
            f"so abandoned it: the later checkpoints, the metrics.jsonl rows of the later steps, sample grids and "
            f"summary.json. dit_train reads nothing here; to continue that timeline, resume one of its checkpoints "
            f"in a run folder of its own (train.resume=<a checkpoint in here> run_dir=<a new folder>).\n"
            if resumed_from is not None else
            f"What this run folder held, without a checkpoint, when at {when} a new run started in it from step 0: "
            f"the earlier attempt's metrics.jsonl rows, sample grids and summary.json. dit_train reads nothing "
            f"here.\n")
    atomic_write_bytes(note.encode(), os.path.join(folder, NOTE))
    moved = []
    if row_steps:  # the rows first in their own file, then the run's file without them
        atomic_write_bytes(later_rows, os.path.join(folder, "metrics.jsonl"))
        atomic_write_bytes(keep, metrics_path)
        moved.append(f"metrics.jsonl rows of steps {min(row_steps)}-{max(row_steps)} ({len(row_steps)} rows)")
    if summary:
        os.replace(summary_path, os.path.join(folder, "summary.json"))
        moved.append(f"summary.json ({summary})")
    for sub, names in (("samples", samples), ("checkpoints", checkpoints)):
        if names:
            os.makedirs(os.path.join(folder, sub))
            for name in names:
                os.replace(os.path.join(run_dir, sub, name), os.path.join(folder, sub, name))
            fsync_dir(os.path.join(run_dir, sub))
            moved.append(f"{sub} {_listed(names)}")
    fsync_dir(run_dir)
    said = (f"resuming from step {step} abandons what {run_dir} held after it" if resumed_from is not None else
            f"a new run in {run_dir} starts from step 0 but the folder holds an earlier attempt's records, without "
            f"a checkpoint")
    return f"{said}; moved aside to {folder}: " + "; ".join(moved)
