"""The reports read a run logged every step (the stability studies: 400,000 steps, ~390 MB of metrics.jsonl) with
memory a few bytes per step per column they use, not a dict per row (which took ~8 GB of RSS)."""

import json
import math
import shutil
import tracemalloc
from pathlib import Path

from dit_train.study import report, stability

N = 50_000  # enough steps that the per-step cost dominates: the bound is 200 bytes a step, a dict ~940
RESUMED = 1_000  # a resume wrote the last steps again: the later rows replace the earlier ones
CONFIG = next(Path(__file__).parents[2].glob("docs/results/optimizer_confirmation_cpu/runs/*/config.yaml"))
# Bytes per train step the reader may hold: the step (8, array 'q') and per TRAIN_COLUMNS key a float (8, array 'd')
# and a presence byte (1): 8 + 11 x 9 = 107. While a resume's rewritten steps are dropped: numpy's sort order, sorted
# steps, mask and kept indices (8 + 8 + 1 + 8), the kept steps (8, as bytes and as array: 16) and one column's kept
# rows (9, twice): 25 + 16 + 18 = 59 more, 166; arrays over-allocate up to 1/16 as they grow: under 200. A dict per
# row (12 keys: a ~650-byte dict and 12 boxed floats of 24) is ~940 bytes a step, over 4 times the bound.
BYTES_PER_STEP = 200


def loss(step: int) -> float:
    return 1.0 + math.sin(step / 7.0) / 10 + (3.0 if 30_000 <= step < 30_020 else 0.0)  # one spike to find


def write_run(folder: Path) -> None:
    folder.mkdir()
    shutil.copy(CONFIG, folder / "config.yaml")
    with open(folder / "metrics.jsonl", "w") as f:
        for step in [*range(1, N + 1), *range(N - RESUMED + 1, N + 1)]:
            row = {"step": step, "train/loss": loss(step), "active_time_s": step * 0.5, "window/steps": 1.0,
                   **{k: 0.001 * (step % 13) for k in ("time/optimizer", "time/step", "time/comm", "time/data",
                                                         "time/forward", "time/backward")}}
            f.write(json.dumps(row) + "\n")
            if step % 5_000 == 0:
                f.write(json.dumps({"step": step, "val/loss": 1.0 / step}) + "\n")


def test_a_run_logged_every_step_is_read_in_bytes_per_step_not_a_dict_per_row(tmp_path):
    write_run(tmp_path / "run")
    tracemalloc.start()
    try:
        run = report.read_run(str(tmp_path / "run"), "run")
        spike, diverged = stability.loss_spike(run.train_curve, 100), stability.diverged(run.train_curve)
        table5 = report.table5([run])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert run.status.startswith("incomplete"), run.status  # read, not damaged: every number below is from the rows
    assert len(run.train_curve) == N and run.train_curve[-1] == (N, loss(N)) and run.steps == N
    assert [s for s, _, _ in run.val_curve] == list(range(5_000, N + 1, 5_000))
    assert stability.logs_every_step(run.train_curve) and diverged is False
    top = max(range(30_000, 30_020), key=loss)  # the spike's highest step, from the formula
    assert spike > 2.0 and f"| {loss(top):.4f} | {top} |" in table5  # the spike, as a list of rows finds it
    assert peak < BYTES_PER_STEP * N, f"{peak / N:.0f} bytes a step (bound {BYTES_PER_STEP})"


def reference_run(path: str, warmup_rows: int = report.WARMUP_ROWS) -> dict:
    """What the reports took of metrics.jsonl before the columns, from read_metrics' rows (a dict per row)."""
    rows = report.read_metrics(path)
    train = [r for r in rows if "train/loss" in r]
    active_at = {r["step"]: r["active_time_s"] for r in train if "active_time_s" in r}
    val = [(r["step"], active_at.get(r["step"], math.nan), r["val/loss"]) for r in rows if "val/loss" in r]
    fd = [(r["step"], r.get("fd_active_time_s", r.get("active_time_s", active_at.get(r["step"], math.nan))), r["fd"])
          for r in rows if "fd" in r]
    timed = train[warmup_rows:] or train
    windowed = bool(timed) and all("window/steps" in r for r in timed)
    weights = [r["window/steps"] if windowed else 1.0 for r in timed]

    def avg(key, absent=None):
        pairs = [(r.get(key, absent), w) for r, w in zip(timed, weights)]
        pairs = [(x, w) for x, w in pairs if x is not None and not math.isnan(x)]
        total = sum(w for _, w in pairs)
        return sum(x * w for x, w in pairs) / total if total else math.nan

    return {"train_curve": [(r["step"], r["train/loss"]) for r in train], "val_curve": val, "fd_curve": fd,
            "steps": max((r["step"] for r in rows), default=0), "windowed": windowed,
            "timed_steps": sum(weights) if windowed else 0.0, "optimizer_s": avg("time/optimizer"),
            "step_s": avg("time/step"), "comm_bytes": avg("comm_bytes/total", 0.0) if timed else math.nan,
            "data": avg("time/data"), "comm": avg("time/comm", 0.0)}


def nan_equal(a, b) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(nan_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(nan_equal, a, b))
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


def test_the_columns_give_what_the_rows_gave_on_resumes_gaps_and_damage(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    shutil.copy(CONFIG, folder / "config.yaml")
    rows = [{"step": 1, "train/loss": 2, "time/step": 0.5, "window/steps": 1, "active_time_s": 1},  # ints
            {"step": 2, "train/loss": "nan", "time/step": "inf", "window/steps": 2, "comm_bytes/total": 10},
            {"step": 3, "train/loss": 1.5, "time/step": 0.25, "time/comm": "x", "window/steps": 3},  # "x" dropped
            {"step": 4, "train/loss": 1.25, "time/step": 0.125, "time/data": 0.1, "window/steps": 4, "val/loss": 0.9,
             "active_time_s": 4.5},  # a train row with a validation
            {"step": 4, "val/loss": 0.8, "fd": 30.0, "fd_encoder": "inception", "fd_num_gen": 8},
            {"step": 5, "train/loss": 1.0, "time/step": 0.2, "window/steps": 5, "time/comm": "nan", "active_time_s": 6},
            {"step": 6, "train/loss": 9.0, "time/step": 9.0, "window/steps": 6},
            {"step": 4, "train/loss": 1.125, "time/step": 0.1, "window/steps": 4, "active_time_s": 4},  # a resume
            {"step": 5, "train/loss": 1.0625, "window/steps": 5, "opt/refresh_steps": 2, "active_time_s": 5.5},
            {"step": 5, "val/loss": 0.7, "fd": 25.0, "fd_active_time_s": 5.25},
            {"step": 7, "ckpt/step": 7}]
    lines = [json.dumps(r) for r in rows]
    lines.insert(3, '{"step": 3, "train/loss": 1.4')  # cut by a crash
    (folder / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    run, ref = report.read_run(str(folder), "run"), reference_run(str(folder / "metrics.jsonl"))
    got = {"train_curve": list(run.train_curve), "val_curve": run.val_curve, "fd_curve": run.fd_curve,
           "steps": run.steps, "windowed": run.windowed, "timed_steps": run.timed_steps,
           "optimizer_s": run.optimizer_s, "step_s": run.step_s, "comm_bytes": run.comm_bytes,
           "data": run.phases["data"], "comm": run.phases["exposed communication"]}
    assert nan_equal(got, ref), (got, ref)  # a logged int 2 is held as 2.0: the report's formats write both alike
    assert ref["train_curve"][3:] == [(4, 1.125), (5, 1.0625), (6, 9.0)] and ref["steps"] == 7
    assert run.refresh_steps == 2.0 and run.fd_encoder == "inception" and run.best_fd == 25.0
