"""The reports read a run logged every step (the stability studies: 400,000 steps, ~390 MB of metrics.jsonl) with
memory a few bytes per step per column they use, not a dict per row (which took ~8 GB of RSS)."""

import json
import math
import shutil
import tracemalloc
from pathlib import Path

from dit_train.study import report, stability

N = 200_000
RESUMED = 1_000  # a resume wrote the last steps again: the later rows replace the earlier ones
CONFIG = next(Path(__file__).parents[2].glob("docs/results/optimizer_confirmation_cpu/runs/*/config.yaml"))
# Bytes per train step the reader may hold: the step (8, array 'q') and per TRAIN_COLUMNS key a float (8, array 'd')
# and a presence byte (1): 8 + 11 x 9 = 107. While a resume's rewritten steps are dropped: numpy's sort order, sorted
# steps, mask and kept indices (8 + 8 + 1 + 8), the kept steps (8, as bytes and as array: 16) and one column's kept
# rows (9, twice): 25 + 16 + 18 = 59 more, 166; arrays over-allocate up to 1/16 as they grow: under 200. A dict per
# row (12 keys: a ~650-byte dict and 12 boxed floats of 24) is ~940 bytes a step, over 4 times the bound.
BYTES_PER_STEP = 200


def loss(step: int) -> float:
    return 1.0 + math.sin(step / 7.0) / 10 + (3.0 if 150_000 <= step < 150_020 else 0.0)  # one spike to find


def write_run(folder: Path) -> None:
    folder.mkdir()
    shutil.copy(CONFIG, folder / "config.yaml")
    with open(folder / "metrics.jsonl", "w") as f:
        for step in [*range(1, N + 1), *range(N - RESUMED + 1, N + 1)]:
            row = {"step": step, "train/loss": loss(step), "active_time_s": step * 0.5, "window/steps": 1.0,
                   **{k: 0.001 * (step % 13) for k in ("time/optimizer", "time/step", "time/comm", "time/data",
                                                         "time/forward", "time/backward")}}
            f.write(json.dumps(row) + "\n")
            if step % 10_000 == 0:
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
    assert [s for s, _, _ in run.val_curve] == list(range(10_000, N + 1, 10_000))
    assert stability.logs_every_step(run.train_curve) and diverged is False
    assert spike > 2.0 and f"| {loss(150_000):.4f} | 150000 |" in table5  # the spike, as a list of rows finds it
    assert peak < BYTES_PER_STEP * N, f"{peak / N:.0f} bytes a step (bound {BYTES_PER_STEP})"
