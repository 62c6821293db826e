"""Turn a sweep folder into the study's tables and plots — reading run folders only, never re-running anything.

    dit-report SWEEP_DIR [--out SWEEP_DIR]

A run folder is any folder under SWEEP_DIR with a config.yaml written by the trainer; its metrics.jsonl and
summary.json are read. Runs listed in SWEEP_DIR/study.json (written by dit-study) but absent on disk
appear as `missing`; folders without summary.json as `incomplete (step N)`, and with one short of their train.steps
(dit-study's rule) as `incomplete (summary at step N of M)`; where there is a study.json, a run folder it does not
list (strayed into the study's folder) is shown in the Runs table as `not in study.json: not counted` and is in
no other table or plot. In a two-phase study (study.json's lr_selection) the selection seeds, which chose the
learning rates, are counted in the learning-rate scan only (Table 4 and its plot), never in the other means, as in
dit-paired-report; their rows in Runs say so. Nothing is silently dropped or silently added. Records from elsewhere are
checked (dit_train/study/record.py): a linked or non-regular record, or one run in two folders, is refused in one
line; names and study.json text go into report.md escaped as Markdown text.

Writes report.md and PNG plots next to it:
- Table 1 (model x optimizer): best FD (encoder named) and its gain over AdamW, final validation velocity loss,
  mean ± std over finished seeds (the seeds column says how many finished where not all; a non-finite value, a
  diverged seed, is counted beside the mean, not in it; the status names updates the trainer skipped).
- Table 2 (model): optimizer time, step time and logical optimizer communication of each periodic_rowwise K
  relative to muon; active training time to each run's best FD and its reduction against muon.
- Table 3 (model x optimizer): validation loss at equal active training time.
- Then, where the runs give them, learning-rate sensitivity (sweeps that scan lr) and training stability (the peak
  train loss after warm-up), numbered on from 4 in the order shown.
- Other metrics (when runs measured any): each registered metric's best (else last) value per run.
- Runs: one row per folder (status with skipped updates, final val loss, best FD, git commit) — what every table
  number traces to.
- Plots: validation loss vs step and vs active time per size; FD vs active time; stacked per-phase step time.
A value a table cannot give is `n/a (why)`, never nan; a plot is drawn only where there are points (a run's single
point as a marker), with the axis values written out (no offset).
"""

from __future__ import annotations

import argparse
import bisect
import io
import json
import math
import os
import statistics
import sys
from array import array
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from itertools import islice

import yaml

from dit_train.config.errors import ConfigError
from dit_train.config.override_text import shell_command
from dit_train.runs.atomic_io import atomic_write_bytes, describe_os_error, remove_dead_temp_files
from dit_train.runs.json_file import DamagedJSONFile, read_json, read_yaml, refuse_unless_regular
from dit_train.study.record import (RECORD_MAX_BYTES, finished_by_summary, is_int, is_number, md, md_code,
                                    planned_steps, read_study, selection_seeds, summary_step_count)
from dit_train.telemetry.metrics_lines import metrics_lines
from dit_train.trainer.preemption import ctrl_c_exits
from dit_train.plain_text import print_error

PHASES = ("data", "forward", "backward", "optimizer compute", "exposed communication")
WARMUP_ROWS = 2  # the first logged rows include one-off costs (allocation, first NS5); left out of time means


@dataclass
class Run:
    name: str
    model: str
    optimizer: str  # label, e.g. "periodic_rowwise K=3"
    seed: int
    status: str = "finished"
    steps: int = 0
    val_loss: float = math.nan
    best_fd: float = math.nan
    best_fd_step: int | None = None
    best_fd_active_s: float = math.nan
    fd_encoder: str = ""
    fd_counts: str = ""
    optimizer_s: float = math.nan  # mean per step
    step_s: float = math.nan
    comm_bytes: float = math.nan  # logical optimizer bytes per step per rank
    phases: dict = field(default_factory=dict)
    windowed: bool = False  # times are window means over every step (not the logged steps' own values)
    timed_steps: float = 0.0  # steps behind the time means (windowed records only)
    refresh_steps: float = math.nan  # of which periodic refreshes (windowed records only)
    git_commit: str = ""  # from run_info.json: the code that produced this run
    skipped_steps: int = 0  # steps whose update the trainer skipped (non-finite loss or gradient), of `steps`
    metrics: dict = field(default_factory=dict)  # summary.json's registered metrics (dit_train/evaluation/metric.py)
    lr: float = math.nan  # optimizer.lr; part of the label only in sweeps that scan it
    val_curve: list = field(default_factory=list)  # (step, active_s, val_loss)
    fd_curve: list = field(default_factory=list)  # (step, active_s, fd)
    train_curve: list = field(default_factory=list)  # (step, train loss: the logged step's own batch, not a mean)
    warmup_steps: int = 0
    planned_steps: int | None = None  # config.yaml's train.steps
    opt_cfg: dict = field(default_factory=dict)  # config.yaml's optimizer section: checked against study.json
    config_key: str = ""  # config.yaml but for run_dir: two folders with one key are one run counted twice

    @property
    def base(self) -> str:
        """The optimizer label without the lr a scan adds to it ("muon lr=0.004" -> "muon")."""
        return self.optimizer.split(" lr=")[0]


def optimizer_label(opt_cfg: dict) -> str:
    """'periodic_rowwise K=3 (spectral)': K for periodic_rowwise, and the RowNorm scale where the record has one
    (runs recorded before the option existed used the frobenius rule and are labelled without it)."""
    name = opt_cfg.get("name", "?")
    label = f"{name} K={opt_cfg['K']}" if name == "periodic_rowwise" and "K" in opt_cfg else name
    return label + (f" ({opt_cfg['rownorm_scale']})" if opt_cfg.get("rownorm_scale") else "")


def mean(xs):
    xs = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return sum(xs) / len(xs) if xs else math.nan


def weighted_mean(pairs) -> float:
    """sum(w x) / sum(w) over (x, w) pairs whose x is a number (None and NaN are left out). `pairs` is an iterable,
    or a function returning a fresh iterator of them: then nothing is held (two passes, each summed as sum() does)."""
    def kept():
        return ((x, w) for x, w in (pairs() if callable(pairs) else held)
                if x is not None and not (isinstance(x, float) and math.isnan(x)))

    held = None if callable(pairs) else list(pairs)
    total = sum(w for _, w in kept())
    return sum(x * w for x, w in kept()) / total if total else math.nan


def metrics_rows(path: str) -> Iterator[tuple[tuple, dict]]:
    """The rows of metrics.jsonl in file order as ((step, kind), row): a line cut by a crash is dropped, the
    logger's "nan"/"inf" strings are numbers again, a value that is no number a float holds is left out."""
    if not os.path.exists(path):
        return
    for line in metrics_lines(path):  # a FIFO, or a sparse huge file from elsewhere: one line, nothing held
        try:
            r = json.loads(line)
        except (ValueError, RecursionError):  # torn, or beyond the parser (10^4 digits, nested 10^5 deep)
            continue
        if not isinstance(r, dict) or type(r.get("step", 0)) is not int:  # a hand-edited line: not a row
            continue
        r = {k: float(v) if isinstance(v, str) and v.lower() in NON_FINITE else v for k, v in r.items()}
        # a value the tables compute with that is not a number a float holds ("train/loss": "x", 10**400) is
        # left out of the row, as a key the logger did not write (it raised TypeError / OverflowError)
        r = {k: v for k, v in r.items() if k in TEXT_KEYS or is_number(v)}
        if "step" not in r:
            continue
        yield (r["step"], next((k for k in ("train/loss", "val/loss", "fd") if k in r), "other")), r


def row_order(key: tuple) -> tuple:
    return key[0], KINDS.index(key[1])


def read_metrics(path: str) -> list[dict]:
    """metrics.jsonl as rows (metrics_rows), a row written again after a resume replacing the earlier one (per step
    and kind: train, val, fd, other). Every row whole: the reports read RunMetrics instead."""
    rows = dict(metrics_rows(path))
    return [rows[k] for k in sorted(rows, key=row_order)]


NON_FINITE = ("nan", "inf", "-inf", "infinity", "-infinity")
TEXT_KEYS = ("fd_encoder",)  # the one row value the report shows as text
KINDS = ("train/loss", "val/loss", "fd", "other")
# what the reports use of a train row (Run's times and train curve), held as one float column each
TRAIN_COLUMNS = ("train/loss", "active_time_s", "window/steps", "opt/refresh_steps", "time/optimizer", "time/step",
                 "comm_bytes/total", "time/comm", "time/data", "time/forward", "time/backward")
EVAL_KEYS = ("step", "val/loss", "fd", "fd_active_time_s", "active_time_s", "fd_encoder", "fd_num_gen", "fd_num_ref")


class Series(Sequence):
    """(step, value) pairs held as two arrays, 16 bytes a step (a list of tuples of boxed numbers took ~100)."""

    def __init__(self, steps: array, values: array):
        self.steps, self.values = steps, values

    def __len__(self) -> int:
        return len(self.steps)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return Series(self.steps[i], self.values[i])
        return self.steps[i], self.values[i]

    def __iter__(self):
        return zip(self.steps, self.values)

    def __eq__(self, other) -> bool:
        return list(self) == list(other) if isinstance(other, Sequence) else NotImplemented


@dataclass
class RunMetrics:
    """What the reports use of a metrics.jsonl, read once and streamed: train rows as one array per TRAIN_COLUMNS
    key (8 bytes a step, NaN where absent, with 1 byte a step saying whether the row had it), and the few
    validation/FD rows as dicts of EVAL_KEYS. Rows as read_metrics gives them: a row written again after a resume
    replaces the earlier one, in order of step."""
    last_step: int = 0  # the highest step of any row
    skipped_steps: int = 0  # the trainer's count of skipped updates as the last train row logged it
    steps: array = field(default_factory=lambda: array("q"))  # of the train rows, ascending
    columns: dict = field(default_factory=dict)  # key: (values array('d'), present bytearray)
    evals: list = field(default_factory=list)  # rows with val/loss or fd (any kind), in read_metrics' order

    def value(self, key: str, i: int, absent=None):
        """Train row i's value of key, as row.get(key, absent)."""
        values, present = self.columns[key]
        return values[i] if present[i] else absent

    def column(self, key: str, start: int = 0, absent=None) -> Iterator:
        values, present = self.columns[key]
        return (v if p else absent for v, p in zip(islice(values, start, None), islice(present, start, None)))


def read_run_metrics(path: str) -> RunMetrics:
    """metrics.jsonl read once into RunMetrics: memory a few bytes per step per TRAIN_COLUMNS key, not a dict a row."""
    m = RunMetrics()
    steps = array("q")
    columns = {k: (array("d"), bytearray()) for k in TRAIN_COLUMNS}
    evals: dict[tuple, dict] = {}
    nan = math.nan
    top = 0  # the highest train step read so far
    for key, r in metrics_rows(path):
        m.last_step = max(m.last_step, key[0])
        if "val/loss" in r or "fd" in r:
            evals[key] = {k: r[k] for k in EVAL_KEYS if k in r}
        else:
            evals.pop(key, None)  # a row written again without them replaces the one that had them
        if key[1] != "train/loss":
            continue
        if key[0] >= top and is_number(r.get("skipped_steps")):  # the row of the highest step, written last
            top, m.skipped_steps = key[0], int(r["skipped_steps"])
        steps.append(key[0])
        for k, (values, present) in columns.items():
            v = r.get(k)
            values.append(nan if v is None else v)
            present.append(v is not None)
    keep = last_of_each_step(steps)
    if keep is not None:  # a resume wrote some steps again: the later row is the row
        import numpy as np

        steps = array("q", np.frombuffer(steps, dtype=np.int64)[keep].tobytes())
        for k, (v, p) in columns.items():  # one column at a time: the read one is freed as its kept rows land
            columns[k] = (array("d", np.frombuffer(v, dtype=np.float64)[keep].tobytes()),
                          bytearray(np.frombuffer(p, dtype=np.uint8)[keep].tobytes()))
            del v, p
    m.steps, m.columns = steps, columns
    m.evals = [evals[k] for k in sorted(evals, key=row_order)]
    return m


def last_of_each_step(steps: array):
    """Indices (ascending step) of the last row of each step; None when the steps ascend as written (no resume)."""
    import numpy as np  # here: the reports' start does not wait for it

    s = np.frombuffer(steps, dtype=np.int64) if steps else np.zeros(0, dtype=np.int64)
    if s.size < 2 or bool((s[1:] > s[:-1]).all()):
        return None
    order = np.argsort(s, kind="stable")  # equal steps in file order: the last is the later row
    ordered = s[order]
    return order[np.append(ordered[1:] != ordered[:-1], True)]


RECORDS = ("config.yaml", "metrics.jsonl", "summary.json", "run_info.json")


def read_run(folder: str, name: str) -> Run:
    """One run folder; a folder whose records cannot be read is a run with status 'damaged: <why>'. A record that
    is a link or not a regular file is refused (ConfigError): its content comes from elsewhere."""
    for record in RECORDS:
        refuse_unless_regular(os.path.join(folder, record), "read")
    try:
        return _read_run(folder, name)
    except ConfigError:
        raise
    except (OSError, ValueError, KeyError, TypeError, AttributeError, OverflowError, yaml.YAMLError) as e:
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        why = why.replace(os.path.join(folder, ""), "")  # the row names the run: keep the 120 characters for the why
        return Run(name=md(name), model="?", optimizer="?", seed=-1,
                   status=md(f"damaged: {type(e).__name__}: {why[:120]}"))


def _read_run(folder: str, name: str) -> Run:
    cfg = read_yaml(os.path.join(folder, "config.yaml"))
    # names from a record go into report.md as Markdown text (md): no HTML, no forged row or heading
    run = Run(name=md(name), model=md(cfg["model"]["name"]), optimizer=md(optimizer_label(cfg["optimizer"])),
              seed=int(cfg.get("seed", 0)), lr=float(cfg["optimizer"].get("lr", math.nan)),
              warmup_steps=int(cfg.get("train", {}).get("warmup_steps", 0) or 0), planned_steps=planned_steps(cfg),
              opt_cfg=dict(cfg["optimizer"]),
              config_key=json.dumps({k: v for k, v in cfg.items() if k != "run_dir"}, sort_keys=True, default=str))
    metrics = os.path.join(folder, "metrics.jsonl")
    if os.path.isfile(metrics) and os.path.getsize(metrics) > RECORD_MAX_BYTES:
        raise ValueError(f"metrics.jsonl is {os.path.getsize(metrics):,} bytes, more than any run record "
                         f"({RECORD_MAX_BYTES:,}): not read")
    m = read_run_metrics(metrics)
    n = len(m.steps)
    run.train_curve = Series(m.steps, m.columns["train/loss"][0])
    run.steps = m.last_step

    def active_at(step: int) -> float:
        """The active time a train row at `step` logged (NaN if none)."""
        i = bisect.bisect_left(m.steps, step)
        return m.value("active_time_s", i, math.nan) if i < n and m.steps[i] == step else math.nan

    for r in m.evals:
        if "val/loss" in r:
            run.val_curve.append((r["step"], active_at(r["step"]), r["val/loss"]))
        if isinstance(r.get("fd"), (int, float)):
            act = r.get("fd_active_time_s", r.get("active_time_s", active_at(r["step"])))
            run.fd_curve.append((r["step"], act, r["fd"]))
            run.fd_encoder = md(r.get("fd_encoder", run.fd_encoder))
            run.fd_counts = md(f"{r.get('fd_num_gen', '?')} gen / {r.get('fd_num_ref', '?')} ref")
    if run.val_curve:
        run.val_loss = run.val_curve[-1][2]
    if run.fd_curve:  # the best of the finite values; a run whose every FD is non-finite keeps its last
        best = min((c for c in run.fd_curve if math.isfinite(c[2])), key=lambda c: c[2], default=run.fd_curve[-1])
        run.best_fd_step, run.best_fd_active_s, run.best_fd = best
        if not math.isfinite(run.best_fd):  # no time to a best FD: it never had a finite one
            run.best_fd_active_s = math.nan
    start = WARMUP_ROWS if n > WARMUP_ROWS else 0  # the timed train rows: all but the first ones (all if no more)
    # rows with window/steps hold means over every step of their log window: weight them by it. Older records
    # hold the logged step's own values only (which alias with periodic_rowwise's K): one sample per row.
    run.windowed = n > 0 and all(m.columns["window/steps"][1][start:])

    def weights() -> Iterator:
        return m.column("window/steps", start) if run.windowed else (1.0 for _ in range(start, n))

    def avg(key, absent=None):
        return weighted_mean(lambda: zip(m.column(key, start, absent), weights()))

    run.timed_steps = sum(weights()) if run.windowed else 0.0
    if run.windowed and any(m.columns["opt/refresh_steps"][1][start:]):
        run.refresh_steps = sum(m.column("opt/refresh_steps", start, 0.0))
    run.optimizer_s = avg("time/optimizer")
    run.step_s = avg("time/step")
    run.comm_bytes = avg("comm_bytes/total", 0.0) if n else math.nan
    comm = avg("time/comm", 0.0)
    run.phases = {"data": avg("time/data"), "forward": avg("time/forward"), "backward": avg("time/backward"),
                  "optimizer compute": run.optimizer_s - comm, "exposed communication": comm}
    info = os.path.join(folder, "run_info.json")
    if os.path.exists(info):
        run.git_commit = md(str(read_json(info).get("git_commit") or ""))
    summary = os.path.join(folder, "summary.json")
    run.skipped_steps = m.skipped_steps
    if os.path.exists(summary):
        s = read_json(summary)
        done = summary_step_count(s)
        if is_int(s.get("skipped_steps")):  # loop.skip_update's count: steps whose update was not applied
            run.skipped_steps = s["skipped_steps"]
        run.steps = done if done >= 0 else run.steps
        run.metrics = s.get("metrics") if isinstance(s.get("metrics"), dict) else {}
        if is_number(s.get("val_loss")):
            run.val_loss = float(s["val_loss"])
        if not finished_by_summary(done, run.planned_steps):  # dit-study's rule: summary.json at train.steps
            run.status = f"incomplete (summary at step {done} of {run.planned_steps})"
    else:
        run.status = f"incomplete (step {run.steps})"
    return run


NOT_LISTED = "not in study.json: not counted"


def find_runs(sweep_dir: str) -> list[Run]:
    found: dict[str, Run] = {}  # by the folder's own name (Run.name is Markdown-escaped)
    for root, dirs, files in os.walk(sweep_dir):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        if "config.yaml" in files and ("metrics.jsonl" in files or "run_info.json" in files):
            name = os.path.relpath(root, sweep_dir)
            found[name] = read_run(root, name)
    runs = list(found.values())
    refuse_duplicates(runs)
    study = os.path.join(sweep_dir, "study.json")
    refuse_unless_regular(study, "read")
    if os.path.exists(study):
        listed = read_study(study, ("runs",))["runs"]
        # strayed in (another sweep's, a trial run); dit-study lists every run it plans: an empty list is a record
        # written by hand, of the study's commands only
        for name in (found.keys() - {r["name"] for r in listed}) if listed else ():
            found[name].status = NOT_LISTED
        for r in listed:
            if r["name"] not in found:
                label = optimizer_label({"name": r["optimizer"], **({"K": r["K"]} if r.get("K") is not None else {}),
                                         "rownorm_scale": r.get("scale")})
                runs.append(Run(name=md(r["name"]), model=md(r["model"]), optimizer=md(label), seed=r["seed"],
                                status="missing", lr=math.nan if r.get("lr") is None else float(r["lr"])))
    tag_learning_rates([r for r in runs if r.status != NOT_LISTED])
    return runs


def refuse_duplicates(runs: list[Run]) -> None:
    """Two folders with one config (but for run_dir) are one run copied twice: counted as two seeds they narrowed
    every mean ± std of the tables."""
    first: dict[str, Run] = {}
    for r in runs:
        if not r.config_key:  # a damaged folder
            continue
        if r.config_key in first:
            raise ConfigError(f"run folders {first[r.config_key].name!r} and {r.name!r} hold the same run (config.yaml "
                              f"equal but for run_dir: {r.model} {r.optimizer} seed {r.seed}): counted twice it "
                              f"would be an extra seed; remove one of them")
        first[r.config_key] = r


def scans_lr(runs: list[Run]) -> bool:
    """Some optimizer ran at several lrs (a scan). A tuned study runs each optimizer at its own single lr."""
    lrs = defaultdict(set)
    for r in runs:
        if not math.isnan(r.lr):
            lrs[(r.model, r.base)].add(r.lr)
    return any(len(v) > 1 for v in lrs.values())


def tag_learning_rates(runs: list[Run]) -> None:
    """A sweep that scans lr compares optimizers at each lr: the lr joins the label ("muon lr=0.004"). A tuned
    study compares each optimizer at its own lr (Table 1 shows it)."""
    if scans_lr(runs):
        for r in runs:
            if not math.isnan(r.lr):
                r.optimizer += f" lr={r.lr:g}"


def peer(label: str, name: str) -> str:
    """The reference optimizer's label at the same lr: peer("muon lr=0.004", "adamw") == "adamw lr=0.004"."""
    return name + (" lr=" + label.split(" lr=")[1] if " lr=" in label else "")


def fmt(values: list[float], digits: int = 4) -> str:
    """mean ± std over seeds (std only with 2+ values); '—' when nothing is there."""
    vals = [v for v in values if not math.isnan(v)]
    if not vals:
        return "—"
    if len(vals) == 1:
        return f"{vals[0]:.{digits}g}"
    return f"{statistics.mean(vals):.{digits}g} ± {statistics.stdev(vals):.2g}"


def fmt_measured(values: list[float], measured: list[bool], digits: int = 4) -> str:
    """fmt of the finite values, saying how many measured values were not finite (a diverged run's NaN): a seed
    that is not in a mean is counted where the mean is, never dropped unseen."""
    bad = sum(m and not math.isfinite(v) for v, m in zip(values, measured))
    text = fmt([v for v in values if math.isfinite(v)], digits)
    return text + (f" ({bad} of {sum(measured)} non-finite)" if bad else "")


def finite_mean(values: list[float]) -> float:
    return mean([v for v in values if math.isfinite(v)])


def val_measured(r: Run) -> bool:
    """The run logged a validation loss (else val_every=0: no value, not a non-finite one)."""
    return bool(r.val_curve) or math.isfinite(r.val_loss)


def seeds_cell(group: list[Run]) -> str:
    """'2', or '2 (1 finished)': the means of a table are over finished runs only."""
    done = sum(r.status == "finished" for r in group)
    return f"{len(group)}" + ("" if done == len(group) else f" ({done} finished)")


def skipped_text(r: Run) -> str:
    """'5 of 6 updates skipped' where the trainer skipped non-finite updates (loop.skip_update); '' otherwise."""
    return f"{r.skipped_steps} of {r.steps} updates skipped" if r.skipped_steps else ""


def run_status(r: Run) -> str:
    """The status with the skipped updates: a run that skipped most of its updates is finished, and says so."""
    return r.status + (f"; {skipped_text(r)} (non-finite loss or gradient)" if r.skipped_steps else "")


def group_status(group: list[Run]) -> str:
    """The statuses of a table row's runs, then the seeds whose trainer skipped updates."""
    skipped = [f"seed {r.seed}: {skipped_text(r)}" for r in sorted(group, key=lambda r: r.seed) if r.skipped_steps]
    return ", ".join(sorted({r.status for r in group})) + (
        f"; non-finite updates skipped ({', '.join(skipped)})" if skipped else "")


def cell(x: float, template: str, why: str) -> str:
    """x through template (e.g. "{:.1f} ms"), or "n/a (why)" where there is no value: a report shows no nan."""
    return f"n/a ({why})" if math.isnan(x) else template.format(x)


def ratio(a: float, b: float, reference: str) -> str:
    """a / b, or "n/a (why)": no finished run of the reference optimizer, this one not measured, or the reference's
    value 0 (a single process communicates 0 bytes)."""
    if math.isnan(b):
        return f"n/a (no {reference} value)"
    if math.isnan(a):
        return "n/a (not timed)"
    if b == 0:
        return f"n/a ({reference}: 0)"
    return f"{a / b:.3f}"


SIZE_ORDER = ["dit_xs", "dit_s", "dit_m", "dit_1b3", "dit_4b", "dit_9b", "dit_15b"]


def model_order(runs):
    """Presets smallest first; unknown names after them, alphabetically."""
    return sorted({r.model for r in runs}, key=lambda m: (SIZE_ORDER.index(m) if m in SIZE_ORDER else 99, m))


def optimizer_order(labels):
    base = ["adamw", "muon"]
    return [l for l in base if l in labels] + sorted(l for l in labels if l not in base)


def means_note(runs: list[Run]) -> str:
    """Table 1's words on what its means leave out, where the runs give a reason to say it."""
    done = [r for r in runs if r.status == "finished"]
    unfinished = len(runs) > len(done)
    bad = any(val_measured(r) and not math.isfinite(r.val_loss) or r.fd_curve and not math.isfinite(r.best_fd)
              for r in done)
    skipped = any(r.skipped_steps for r in runs)
    return ((" The means are over finished runs only: a row whose seeds did not all finish says in its seeds column "
             "how many did." if unfinished else "")
            + (" A non-finite value (a diverged run) is left out of the mean and counted beside it." if bad else "")
            + (" A status naming skipped updates: the trainer skipped that many steps' updates for a non-finite loss "
               "or gradient (train.max_bad_steps of them in a row stop the run)." if skipped else ""))


def fd_counts_note(runs: list[Run]) -> str:
    """Table 1's words on its FD column: the sample counts to compare, or that no run measured FD (a sweep without
    eval.every_n_steps read 'compare only equal sample counts: )')."""
    counts = sorted({r.fd_counts for r in runs if r.fd_counts})
    if not counts:
        return "no run measured FD: eval.every_n_steps=0, or score the runs afterwards with dit-fd"
    return f"lower is better; encoder named; compare only equal sample counts: {', '.join(counts)}"


def table1(runs: list[Run]) -> str:
    # optimizers at different lrs without a scan (a tuned study): each row says its lr
    show_lr = not scans_lr(runs) and len({r.lr for r in runs if not math.isnan(r.lr)}) > 1
    lines = ["| model | optimizer | " + ("lr | " if show_lr else "") + "seeds | status | best FD | gain vs AdamW | "
             "step of best | final val loss |",
             "| --- | --- | " + ("---: | " if show_lr else "") + "---: | --- | ---: | ---: | ---: | ---: |"]
    by = defaultdict(list)
    for r in runs:
        by[(r.model, r.optimizer)].append(r)
    for model in model_order(runs):
        for opt in optimizer_order({o for m, o in by if m == model}):
            # means over finished runs only: a crashed seed's last value is from another step
            adamw_fd = finite_mean([r.best_fd for r in by.get((model, peer(opt, "adamw")), [])
                                    if r.status == "finished"])
            group = by[(model, opt)]
            done = [r for r in group if r.status == "finished"]
            fds = [r.best_fd for r in done]
            gain = "—"
            own = finite_mean(fds)
            if opt != peer(opt, "adamw") and not math.isnan(own) and not math.isnan(adamw_fd) and adamw_fd:
                gain = f"{(adamw_fd - own) / adamw_fd * 100:+.1f}%"
            enc = next((r.fd_encoder for r in done if r.fd_encoder), "")
            best = fmt_measured(fds, [bool(r.fd_curve) for r in done]) + (f" ({enc})" if enc else "")
            steps = ", ".join(str(r.best_fd_step) for r in done if math.isfinite(r.best_fd)) or "—"
            lr = (", ".join(f"{x:g}" for x in sorted({r.lr for r in group if not math.isnan(r.lr)})) or "—") + " | "
            val = fmt_measured([r.val_loss for r in done], [val_measured(r) for r in done])
            lines.append(f"| {model} | {opt} | {lr if show_lr else ''}{seeds_cell(group)} | {group_status(group)} | "
                         f"{best} | {gain} | {steps} | {val} |")
    return "\n".join(lines)


def table2(runs: list[Run]) -> str:
    lines = ["| model | optimizer | optimizer time / step | vs muon | step time | vs muon | optimizer comm bytes / step "
             "| vs muon | active time to best FD | vs muon |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    by = defaultdict(list)
    for r in runs:
        if r.status == "finished":
            by[(r.model, r.optimizer)].append(r)
    for model in model_order(runs):
        for opt in optimizer_order({o for m, o in by if m == model}):
            ref = by.get((model, peer(opt, "muon")), [])
            ref_opt, ref_step = mean([r.optimizer_s for r in ref]), mean([r.step_s for r in ref])
            ref_comm, ref_act = mean([r.comm_bytes for r in ref]), mean([r.best_fd_active_s for r in ref])
            g = by[(model, opt)]
            o, s = mean([r.optimizer_s for r in g]), mean([r.step_s for r in g])
            c, a = mean([r.comm_bytes for r in g]), mean([r.best_fd_active_s for r in g])
            reference = peer(opt, "muon")
            red = (f"n/a (no {reference} value)" if math.isnan(ref_act) or not ref_act else "n/a (no FD)"
                   if math.isnan(a) else f"{(1 - a / ref_act) * 100:+.1f}%")
            lines.append(f"| {model} | {opt} | {cell(o * 1000, '{:.1f} ms', 'not timed')} | "
                         f"{ratio(o, ref_opt, reference)} | "
                         f"{cell(s * 1000, '{:.1f} ms', 'not timed')} | {ratio(s, ref_step, reference)} | "
                         f"{cell(c, '{:.0f}', 'not timed')} | {ratio(c, ref_comm, reference)} | "
                         f"{cell(a, '{:.0f} s', 'no FD')} | {red} |")
    return "\n".join(lines)


def timing_note(runs: list[Run]) -> str:
    """How the times of Table 2 were averaged, per kind of record."""
    done = [r for r in runs if r.status == "finished"]
    windowed = [r for r in done if r.windowed]
    old = [r for r in done if not r.windowed]
    notes = []
    if windowed:
        shares = defaultdict(lambda: [0.0, 0.0])
        for r in windowed:
            if not math.isnan(r.refresh_steps) and r.timed_steps:
                shares[r.optimizer][0] += r.refresh_steps
                shares[r.optimizer][1] += r.timed_steps
        share = ("; refresh steps among the timed steps: " + ", ".join(
            f"{o} {n:.0f} of {t:.0f}" for o, (n, t) in sorted(shares.items()))) if shares else ""
        notes.append(f"{len(windowed)} run(s) log window means over every step: their times are those means "
                     f"weighted by each window's step count{share}.")
    if old:
        notes.append(f"{len(old)} run(s) were recorded before window means (no window/steps): their times are "
                     f"means of the logged steps' own values, which alias with periodic_rowwise's K (with "
                     f"log_every a multiple of K no refresh step is timed).")
    return " ".join(notes)


def value_at(curve: list, t: float) -> float:
    """The curve's value at active time t, linear between logged points; NaN outside the logged span."""
    pts = sorted((a, v) for _, a, v in curve if not math.isnan(a))
    for (a0, v0), (a1, v1) in zip(pts, pts[1:]):
        if a0 <= t <= a1:
            return v0 if a1 == a0 else v0 + (v1 - v0) * (t - a0) / (a1 - a0)
    return pts[0][1] if len(pts) == 1 and pts[0][0] == t else math.nan


def spans(curve: list, t: float) -> bool:
    """The curve has validation points at active times on both sides of t (or at t)."""
    times = [a for _, a, _ in curve if not math.isnan(a)]
    return bool(times) and min(times) <= t <= max(times)


def table3(runs: list[Run]) -> str:
    """Validation loss at equal active time: the budget is the shortest finished run's last validation point."""
    lines = ["| model | optimizer | time budget | step reached | val loss at budget | gain vs AdamW |",
             "| --- | --- | ---: | ---: | ---: | ---: |"]
    by = defaultdict(list)
    for r in runs:
        if r.status == "finished" and r.val_curve:
            by[(r.model, r.optimizer)].append(r)
    for model in model_order(runs):
        group_runs = [r for (m, _), g in by.items() if m == model for r in g]
        ends = [r.val_curve[-1][1] for r in group_runs if not math.isnan(r.val_curve[-1][1])]
        if not ends:
            continue
        budget = min(ends)
        at = {o: [value_at(r.val_curve, budget) for r in g] for (m, o), g in by.items() if m == model}
        for opt in optimizer_order(set(at)):
            adamw = peer(opt, "adamw")
            ref, own = finite_mean(at.get(adamw, [])), finite_mean(at[opt])
            # a run validated on both sides of the budget whose value there is not finite (it diverged)
            measured = [spans(r.val_curve, budget) for r in by[(model, opt)]]
            steps = [value_at([(s, a, float(s)) for s, a, _ in r.val_curve], budget) for r in by[(model, opt)]]
            none = "no validation by the budget"  # a run whose first validation point comes later
            if opt == adamw or adamw not in at:
                gain = "—"
            elif math.isnan(own) or math.isnan(ref):
                why = "non-finite" if math.isnan(own) and any(measured) else none
                gain = f"n/a ({why}{'' if math.isnan(own) else ' for AdamW'})"
            else:
                gain = f"{(ref - own) / ref * 100:+.1f}%"
            val = fmt_measured(at[opt], measured) if not math.isnan(own) or any(measured) else f"n/a ({none})"
            lines.append(f"| {model} | {opt} | {budget:.3g} s | {cell(mean(steps), '{:.0f}', none)} | {val} | "
                         f"{gain} |")
    if len(lines) == 2:  # a header over no rows said nothing
        return "No finished run has a validation point (train.val_every=0, or none reached)."
    return "\n".join(lines)


def table4(runs: list[Run]) -> str:
    """Learning-rate sensitivity (sweeps that scan lr): best FD / final val loss per optimizer at each lr."""
    if not scans_lr(runs):
        return ""
    lrs = sorted({r.lr for r in runs if not math.isnan(r.lr)})
    lines = ["| model | optimizer | " + " | ".join(f"lr={lr:g}" for lr in lrs)
             + " | best lr by FD | best lr by val loss |",
             "| --- | --- | " + " | ".join("---:" for _ in lrs) + " | ---: | ---: |"]
    by = defaultdict(list)
    for r in runs:
        if r.status == "finished":
            by[(r.model, r.base, r.lr)].append(r)
    for model in model_order(runs):
        for opt in optimizer_order({o for m, o, _ in by if m == model}):
            cells, fd_at, val_at = [], {}, {}
            for lr in lrs:
                g = by.get((model, opt, lr), [])
                fd_at[lr], val_at[lr] = finite_mean([r.best_fd for r in g]), finite_mean([r.val_loss for r in g])
                cells.append(f"{fmt_measured([r.best_fd for r in g], [bool(r.fd_curve) for r in g])} / "
                             f"{fmt_measured([r.val_loss for r in g], [val_measured(r) for r in g])}" if g else "—")
            best = [min((lr for lr in lrs if not math.isnan(d[lr])), key=d.get, default=None) for d in (fd_at, val_at)]
            lines.append(f"| {model} | {opt} | " + " | ".join(cells) + " | "
                         + " | ".join("—" if b is None else f"{b:g}" for b in best) + " |")
    return "\n".join(lines)


def table5(runs: list[Run]) -> str:
    """Per run: the highest train loss logged after warm-up (a spike or a collapse shows here, where the final
    values may have recovered), its step, and the lowest train loss logged before it."""
    lines = ["| model | optimizer | seed | peak train loss after warm-up | at step | lowest before it | "
             "final train loss |", "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for model in model_order(runs):
        for opt in optimizer_order({r.optimizer for r in runs if r.model == model}):
            for r in sorted((r for r in runs if r.model == model and r.optimizer == opt), key=lambda r: r.seed):
                # streamed, not listed: a run logged every step has hundreds of thousands of points
                after = (c for c in r.train_curve if c[0] > r.warmup_steps)
                step, peak = max(after, key=lambda c: c[1], default=(None, None))
                if step is None:
                    continue
                low = min((c[1] for c in r.train_curve if c[0] < step), default=None)
                low = "—" if low is None else f"{low:.4f}"
                lines.append(f"| {model} | {opt} | {r.seed} | {peak:.4f} | {step} | {low} | "
                             f"{r.train_curve[-1][1]:.4f} |")
    return "\n".join(lines) if len(lines) > 2 else ""


def status_table(runs: list[Run], chose: Sequence[int] = ()) -> str:
    """One row per run folder: every number in the tables above is a mean of these. A run of a selection seed
    (`chose`) says that it is counted in the learning-rate scan only."""
    lines = ["| run | status | steps | final val loss | best FD (step) | active time to best FD | git commit |",
             "| --- | --- | ---: | ---: | ---: | ---: | --- |"]
    for r in sorted(runs, key=lambda r: r.name):
        best = f"{r.best_fd:.4g} ({r.best_fd_step})" if not math.isnan(r.best_fd) else \
            "non-finite" if r.fd_curve else "—"
        act = "—" if math.isnan(r.best_fd_active_s) or math.isnan(r.best_fd) else f"{r.best_fd_active_s:.1f} s"
        val = ("non-finite" if val_measured(r) else "—") if math.isnan(r.val_loss) else f"{r.val_loss:.4g}"
        status = run_status(r) + ("; selection seed: counted in the lr scan only"
                                  if r.seed in chose and r.status != NOT_LISTED else "")
        lines.append(f"| {r.name} | {status} | {r.steps} | {val} | {best} | {act} | "
                     f"{r.git_commit[:10] or '—'} |")
    return "\n".join(lines)


def metrics_table(runs: list[Run]) -> str:
    """One row per run, one column per registered metric (dit_train/evaluation/metric.py): its best value (step), else its
    last; '' when no run measured any."""
    names = sorted({name for r in runs for name in r.metrics})
    if not names:
        return ""

    def value(r: Run, name: str) -> str:
        m = r.metrics.get(name) or {}
        for kind in ("best", "last"):
            if isinstance(m.get(kind), dict) and is_number(m[kind].get("value")):
                return f"{float(m[kind]['value']):.4g} ({kind}, step {md(m[kind].get('step', '?'))})"
        return "n/a (not measured)"

    lines = [f"| run | {' | '.join(md(n) for n in names)} |", f"| --- |{' ---: |' * len(names)}"]
    lines += [f"| {r.name} | {' | '.join(value(r, n) for n in names)} |" for r in sorted(runs, key=lambda r: r.name)]
    return "\n".join(lines)


def plots(runs: list[Run], out_dir: str, scan_runs: list[Run] | None = None) -> list[str]:
    """The PNGs of `runs`; the lr-sensitivity plot of `scan_runs` where given (a two-phase study's selection seeds)."""
    import matplotlib

    matplotlib.use("Agg")
    # no '+4.354e2' above an axis: values close together (one FD point per run) read as written; names from the
    # records drawn as written, never parsed as mathtext (a model named '$\\notacommand{x}$' raised ValueError)
    with matplotlib.rc_context({"axes.formatter.useoffset": False, "text.parse_math": False}):
        return _plots(runs, out_dir, scan_runs)


def finite_points(pts: list, xi: int) -> list:
    """The (step, active time, value) points with a finite x (column xi) and value: what a plot can draw (an inf
    from a crafted record made matplotlib's ticker overflow)."""
    return [p for p in pts if math.isfinite(p[xi]) and math.isfinite(p[2])]  # inf: no axis can hold it


def _plots(runs: list[Run], out_dir: str, scan_runs: list[Run] | None = None) -> list[str]:
    import matplotlib.pyplot as plt

    written = []
    models = model_order(runs)
    done = [r for r in runs if r.val_curve or r.fd_curve]
    if not done:
        return written
    # colour per optimizer, line style per lr (when the sweep scans lr)
    colors = {o: f"C{i}" for i, o in enumerate(optimizer_order({r.base for r in runs + (scan_runs or [])}))}
    dashes = ("-", "--", ":", "-.", (0, (5, 1, 1, 1, 1, 1)), (0, (1, 4)))
    styles = {lr: dashes[i % len(dashes)] for i, lr in enumerate(sorted({r.lr for r in runs}))}
    scan = scans_lr(runs)

    def legend(ax):
        if scan:  # colour = optimizer, line style = lr: one key each instead of one entry per curve
            from matplotlib.lines import Line2D

            shown = {r.base for r in done}
            handles = [Line2D([], [], color=c, label=o) for o, c in colors.items() if o in shown]
            handles += [Line2D([], [], color="grey", linestyle=st, label=f"lr={lr:g}") for lr, st in styles.items()
                        if not math.isnan(lr)]
            ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
        elif ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)

    def curves(kind, xi, fname, ylabel, xlabel):
        drawn = {r.name: finite_points(r.val_curve if kind == "val" else r.fd_curve, xi) for r in done}
        shown = [m for m in models if any(drawn[r.name] for r in done if r.model == m)]
        if not shown:  # no plot without data
            return
        fig, axes = plt.subplots(1, len(shown), figsize=(5 * len(shown), 4), squeeze=False)
        for ax, model in zip(axes[0], shown):
            for r in (r for r in done if r.model == model):
                pts = drawn[r.name]
                if pts:
                    style = styles.get(r.lr, "-") if " lr=" in r.optimizer else "-"
                    ax.plot([p[xi] for p in pts], [p[2] for p in pts], color=colors[r.base],
                            linestyle=style, alpha=0.8, marker="o" if len(pts) == 1 else None,
                            label=f"{r.optimizer}" if r.seed == min(x.seed for x in done if x.model == model
                                                                     and x.optimizer == r.optimizer) else None)
            ax.set_title(model)
            ax.set_xlabel(xlabel)
            ax.set_ylabel(ylabel)
            legend(ax)
        fig.tight_layout()
        path = os.path.join(out_dir, fname)
        save_figure(fig, path)
        plt.close(fig)
        written.append(path)

    curves("val", 0, "val_loss_vs_step.png", "validation velocity loss", "step")
    curves("val", 1, "val_loss_vs_active_time.png", "validation velocity loss", "active training time (s)")
    curves("fd", 1, "fd_vs_active_time.png", "FD", "active training time (s)")
    if scan_runs is not None:  # a two-phase study: its lr scan is the selection seeds'
        if scans_lr(scan_runs):
            written.append(lr_plot(scan_runs, model_order(scan_runs), colors, out_dir, plt))
    elif scan:
        written.append(lr_plot(runs, models, colors, out_dir, plt))

    if all(math.isnan(r.step_s) for r in runs if r.status == "finished"):
        return written  # no run timed its phases (train.timing=false): no empty bar chart
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models):
        opts = optimizer_order({r.optimizer for r in runs if r.model == model and r.status == "finished"})
        bottom = [0.0] * len(opts)
        for i, phase in enumerate(PHASES):
            vals = [mean([r.phases.get(phase) for r in runs if r.model == model and r.optimizer == o
                          and r.status == "finished"]) for o in opts]
            vals = [0.0 if math.isnan(v) else v * 1000 for v in vals]
            ax.bar(range(len(opts)), vals, bottom=bottom, label=phase, color=f"C{i}")
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax.set_xticks(range(len(opts)), opts, rotation=30, ha="right", fontsize=7)
        ax.set_ylabel("ms per step")
        ax.set_title(model)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.tight_layout()
    path = os.path.join(out_dir, "step_time_phases.png")
    save_figure(fig, path)
    plt.close(fig)
    written.append(path)
    return written


def banner(study: dict) -> str:
    """study.json's `banner`: what a reader must know first about a published study (that a later one supersedes
    it, or what it cannot show), added to the record after it ran."""
    return f"> **Read first.** {md(study['banner'])}" if study.get("banner") else ""


def provenance(study: dict, runs: list[Run]) -> str:
    """The sweep commands (study.json keeps every invocation) and the commits that produced the run folders."""
    calls = study.get("invocations") or ([study] if "command" in study else [])
    lines = [f"- `{md_code(c.get('command'))}` at git commit `{md_code(c.get('git_commit'))}`"
             + (f" ({md(c['started'])})" if c.get("started") else "") for c in calls]
    commits = defaultdict(int)
    for r in runs:
        if r.git_commit:
            commits[r.git_commit] += 1
    used = ", ".join(f"`{c}` ({n} run{'' if n == 1 else 's'})"
                     for c, n in sorted(commits.items(), key=lambda kv: -kv[1]))
    return ("Sweep commands:\n" + "\n".join(lines) + "\n\n" if lines else "") + (
        f"Run folders produced at git commit {used} (each run's commit is in the Runs table)." if used else "")


def lr_plot(runs: list[Run], models: list[str], colors: dict, out_dir: str, plt) -> str:
    """Best FD and final validation loss against lr, one line per optimizer (mean over seeds)."""
    fig, axes = plt.subplots(2, len(models), figsize=(5 * len(models) + 2, 7), squeeze=False)
    for col, model in enumerate(models):
        mine = [r for r in runs if r.model == model and r.status == "finished"]
        for opt in optimizer_order({r.base for r in mine}):
            lrs = sorted({r.lr for r in mine if r.base == opt})
            for row, (attr, ylabel) in enumerate((("best_fd", "best FD"), ("val_loss", "final validation loss"))):
                ys = [mean([getattr(r, attr) for r in mine if r.base == opt and r.lr == lr])
                      for lr in lrs]
                axes[row][col].plot(lrs, ys, marker="o", color=colors[opt], label=opt)
                axes[row][col].set_xscale("log")
                axes[row][col].set_xlabel("learning rate")
                axes[row][col].set_ylabel(ylabel)
                axes[row][col].set_title(model)
        axes[0][col].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.tight_layout()
    path = os.path.join(out_dir, "lr_sensitivity.png")
    save_figure(fig, path)
    plt.close(fig)
    return path


def build_report(sweep_dir: str, out_dir: str | None = None) -> str:
    out_dir = out_dir or sweep_dir
    os.makedirs(out_dir, exist_ok=True)
    every = find_runs(sweep_dir)
    remove_dead_temp_files(out_dir, OUTPUTS)
    if not every:
        raise ConfigError(f"no run folders (config.yaml + metrics.jsonl) under {sweep_dir!r}")
    runs = [r for r in every if r.status != NOT_LISTED]
    strays = len(every) - len(runs)
    study = {}
    if os.path.exists(os.path.join(sweep_dir, "study.json")):
        study = read_study(os.path.join(sweep_dir, "study.json"))
    # a two-phase study (dit-study's lr_scan): the seeds that chose the lrs are the scan's, never evaluation rows
    # (as in dit-paired-report); at the selected lr they had been averaged with the evaluation seeds
    chose = selection_seeds(study) if "lr_selection" in study else []
    scan_runs = [r for r in runs if r.seed in chose]
    runs = [r for r in runs if r.seed not in chose]
    images = plots(runs, out_dir, scan_runs if chose else None)
    n_done = sum(r.status == "finished" for r in runs)
    n_scan = len(scan_runs)
    command = shell_command(["dit-report", sweep_dir, *([] if out_dir == sweep_dir else ["--out", out_dir])])
    parts = [
        f"# Study report: {md(study.get('experiment', os.path.basename(os.path.abspath(sweep_dir))))}",
        banner(study),
        f"Built by `{command}` "
        f"from {len(runs)} runs ({n_done} finished)" + (f"; {strays} run folder(s) that study.json does not list "
                                                          f"are shown under Runs and counted nowhere" if strays else "")
        + (f"; {n_scan} selection-seed run(s) (seed{'s' if len(chose) > 1 else ''} {', '.join(map(str, chose))}, "
           f"which chose the learning rates) are not counted in any mean but the learning-rate scan's"
           if n_scan else "") + ".",
        provenance(study, runs),
        md(study.get("notes", "")),
        *numbered_tables([
            ("quality", f"Best FD over the run's evaluations ({fd_counts_note(runs)}), its gain over AdamW, and the "
             "final validation velocity loss (fixed t grid, fixed noise, held-out split). Mean ± std over seeds."
             + means_note(runs),
             table1(runs), True),
            ("cost relative to Muon", "Means per step after the first log rows. Communication is the logical "
             "optimizer bytes per step per rank (0 in single-process runs). Active time is wall time inside training "
             "steps (no evaluation/checkpoints). " + timing_note(runs), table2(runs), True),
            ("equal active time", "Validation velocity loss when every run has had the same active training time: "
             "the budget is the shortest finished run's last validation point for that size; values are linear "
             "between validation points (the step reached is interpolated the same way). Mean ± std over seeds.",
             table3(runs), True),
            ("learning-rate sensitivity", "Best FD / final validation loss at each learning rate (mean over seeds"
             + (f" {', '.join(map(str, chose))}: the selection seeds, whose scan chose the learning rates; the other "
                "tables are over the evaluation seeds only)." if chose else
                "); the other tables compare optimizers at the same lr."),
             table4(scan_runs if chose else runs), False),
            ("training stability", "The highest train loss logged after the learning-rate warm-up (each the logged "
             "step's own batch, not a window mean: one batch's noise is in it), with the lowest logged before it: a "
             "peak far above that low is a spike, and a final value near the peak a collapse that did not recover.",
             table5(runs), False),
        ]),
        *(["## Other metrics",
           "Registered metrics (dit_train/evaluation/metric.py) as each run's summary.json records them: the best value by the "
           "metric's own order, else the last.", t6] if (t6 := metrics_table(runs)) else []),
        "## Plots",
        "\n".join(f"![{os.path.basename(p)}]({os.path.basename(p)})" for p in images),
        "## Runs",
        status_table(every, chose),
    ]
    text = "\n\n".join(p for p in parts if p) + "\n"
    atomic_write_bytes(text.encode(), os.path.join(out_dir, "report.md"))
    return text


OUTPUTS = ("report.md", "val_loss_vs_step.png", "val_loss_vs_active_time.png", "fd_vs_active_time.png",
           "lr_sensitivity.png", "step_time_phases.png")  # what a report writes; their dead writers' temp files go


def numbered_tables(tables: list[tuple[str, str, str, bool]]) -> list[str]:
    """Headings, notes and tables of (title, note, table, always shown): a table with nothing to show is left out
    (no lr scan, no warm-up recorded) and the ones shown are numbered 1, 2, 3, ... as they appear."""
    shown = [(title, note, table) for title, note, table, always in tables if always or table]
    return [part for n, (title, note, table) in enumerate(shown, 1) for part in (f"## Table {n} — {title}", note, table)]


def save_figure(fig, path: str) -> None:
    """A plot written as report.md is: through a temp name and a rename, so a link planted at its name in a sweep
    folder from elsewhere is replaced, never written through (savefig opened the name and overwrote the link's
    target)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    atomic_write_bytes(buf.getvalue(), path)


@ctrl_c_exits("dit-report: interrupted; report.md is written whole or not at all: rerun the same command")
def main(argv=None) -> int:
    """The command: bad input is one line and exit status 2, as in every dit-* command."""
    p = argparse.ArgumentParser(prog="dit-report", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("sweep_dir")
    p.add_argument("--out", default=None, help="folder for report.md and plots (default: the sweep folder)")
    args = p.parse_args(argv)
    try:
        if not os.path.isdir(args.sweep_dir):
            raise ConfigError(f"sweep folder {args.sweep_dir!r} does not exist")
        build_report(args.sweep_dir, args.out)
    except (ConfigError, DamagedJSONFile) as e:
        print_error(str(e))
        return 2
    except OSError as e:  # a read-only output folder, a full disk: one line (report.md is whole or absent)
        print_error(describe_os_error(e))
        return 2
    print(f"wrote {os.path.join(args.out or args.sweep_dir, 'report.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
