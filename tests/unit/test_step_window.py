"""Logged timings are window means over every step (dit_train/telemetry/step_window.py, docs/algorithms.md §7): they must not
alias with periodic_rowwise's refresh period (log_every 10 and K = 5 used to log RowNorm steps only)."""

import json
import os

import pytest

from conftest import compose, needs_fashion
from dit_train.telemetry.step_window import StepWindow
from dit_train.telemetry.clocks import StepTimes
from dit_train.trainer.loop import run


def test_window_means_counts_and_per_kind_means():
    w = StepWindow()
    w.add({"time/optimizer": 4.0, "time/step": 5.0, "comm_bytes/total": 100.0}, refresh=1.0)
    w.add({"time/optimizer": 1.0, "time/step": 2.0}, refresh=0.0)
    w.add({"time/optimizer": 1.0, "time/step": 2.0}, refresh=0.0)
    w.add({"time/step": 0.5}, refresh=None)  # a skipped step: no optimizer, no kind
    out = w.take()
    assert out["window/steps"] == 4 and out["opt/refresh_steps"] == 1 and out["opt/rownorm_steps"] == 2
    assert out["time/optimizer"] == pytest.approx(6.0 / 4) and out["time/step"] == pytest.approx(9.5 / 4)
    assert out["comm_bytes/total"] == pytest.approx(25.0)  # a step without the collective sent 0 bytes
    assert out["time/optimizer_refresh"] == 4.0 and out["time/optimizer_rownorm"] == 1.0
    assert out["time/step_rownorm"] == 2.0 and "time/comm_refresh" not in out
    assert w.take() == {}  # a new, empty window


def test_window_of_an_unscheduled_optimizer_has_no_kind_counts():
    w = StepWindow()
    w.add({"time/optimizer": 2.0})
    assert w.take() == {"time/optimizer": 2.0, "window/steps": 1.0}


@needs_fashion
def test_k5_run_logged_every_10_steps_times_its_refresh_steps(tmp_path, monkeypatch):
    """Every window of 10 steps holds 2 refresh steps (t = 0, 5 / 10, 15), and time/optimizer is the mean of the 10
    per-step values read from the timer (StepTimes.read, once per step), not the logged step's."""
    per_step = []
    read = StepTimes.read

    def recording(self):
        out = read(self)
        per_step.append(out)
        return out

    monkeypatch.setattr(StepTimes, "read", recording)
    cfg = compose([f"run_dir={tmp_path / 'run'}", "optimizer=periodic_rowwise", "optimizer.K=5",
                   "model.hidden_size=32", "model.depth=2", "model.num_heads=2", "model.patch_size=8",
                   "train.steps=20", "train.batch_size=8", "train.warmup_steps=2", "train.log_every=10",
                   "train.val_every=20", "train.val_samples=16", "train.val_batch_size=8", "train.val_t_points=2",
                   "train.sample_every=0", "train.ckpt_every=20", "train.progress=false"])
    run(cfg)
    with open(os.path.join(cfg.run_dir, "metrics.jsonl")) as f:
        rows = [r for r in map(json.loads, f) if "train/loss" in r]
    assert [r["step"] for r in rows] == [10, 20]
    assert len(per_step) == 20
    for i, r in enumerate(rows):
        assert r["window/steps"] == 10 and r["opt/refresh_steps"] == 2 and r["opt/rownorm_steps"] == 8
        window = per_step[10 * i: 10 * i + 10]
        assert r["time/optimizer"] == pytest.approx(sum(s["time/optimizer"] for s in window) / 10, rel=1e-9)
        assert r["time/optimizer_refresh"] > 0 and r["time/optimizer_rownorm"] > 0  # both kinds timed (their order is load-dependent)
