"""The command line as a user meets it: one-line errors, dry runs, multirun sweeps (subprocesses)."""

import os
import subprocess
import sys

import pytest

from conftest import ROOT, compose, needs_fashion
from dit_train.config_check import ConfigError, check_config


def cli(*args, cwd="/tmp", timeout=300):
    return subprocess.run([sys.executable, "-m", "dit_train", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONPATH": ROOT})


def test_unknown_group_option_is_one_line_listing_choices():
    r = cli("optimizer=sgd")
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "optimizer='sgd'" in lines[0]
    assert "adamw, mud, muon, periodic_rowwise, rownorm" in lines[0]


def test_dry_run_every_preset_from_any_directory(tmp_path):
    r = cli("model=dit_15b", "train.dry_run=true", cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert "15,158,211,088 parameters" in r.stdout and "dry run" in r.stdout


BAD = [
    ("train.steps=0", "train.steps=0"),
    ("train.batch_size=-4", "train.batch_size=-4"),
    ("train.lr_schedule=step", "train.lr_schedule='step'"),
    ("train.ema_decay=1.5", "train.ema_decay=1.5"),
    ("train.precision=fp8", "train.precision='fp8'"),
    ("train.grad_clip=-1", "train.grad_clip=-1"),
    ("train.resume=/no/such/run", "train.resume='/no/such/run'"),
    ("optimizer.lr=0", "optimizer.lr=0"),
    ("optimizer.lr=-1e-3", "optimizer.lr=-0.001"),
    ("model.patch_size=3", "model.patch_size=3"),
    ("model.num_heads=5", "model.num_heads=5"),
    ("model.in_channels=3", "model.in_channels=3"),
    ("flow.t_sampling=beta", "flow.t_sampling='beta'"),
    ("flow.t_std=0", "flow.t_std=0"),
    ("train.val_t_points=0", "train.val_t_points=0"),
    ("train.keep_last=-1", "train.keep_last=-1"),
    ("optimizer=periodic_rowwise optimizer.K=0", "optimizer.K=0"),
    ("optimizer=periodic_rowwise optimizer.K=1.5", "optimizer.K=1.5"),
    ("optimizer=muon optimizer.scale=huge", "optimizer.scale='huge'"),
    ("optimizer=muon optimizer.momentum=1.0", "optimizer.momentum=1.0"),
    ("data.name=cifar10", "data.name='cifar10'"),
    ("eval.every_n_steps=10 eval.num_samples=1", "eval.num_samples=1"),
]


@pytest.mark.parametrize("override,expected", BAD)
def test_bad_values_fail_before_heavy_work_with_one_line(override, expected):
    cfg = compose(["run_dir=/tmp/unused", *override.split()])
    with pytest.raises(ConfigError) as e:
        check_config(cfg)
    msg = str(e.value)
    assert "\n" not in msg and expected in msg and ("valid" in msg or "must be" in msg)


def test_batch_not_divisible_by_world_size():
    cfg = compose(["run_dir=/tmp/unused", "train.batch_size=9"])
    with pytest.raises(ConfigError, match="train.batch_size=9 .*divisible by the world size 2"):
        check_config(cfg, world_size=2)


def test_bad_value_on_command_line_is_one_line():
    r = cli("train.steps=0")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "error: train.steps=0 is not valid: expected an integer >= 1"]


@needs_fashion
def test_multirun_sweep_over_lr(tmp_path):
    r = cli("--multirun", "optimizer.lr=1e-3,3e-3", f"hydra.sweep.dir={tmp_path}/sweep",
            "model.hidden_size=32", "model.depth=1", "model.num_heads=1", "model.patch_size=8",
            "train.steps=2", "train.batch_size=4", "train.val_samples=4", "train.val_batch_size=4",
            "train.val_t_points=1", "train.sample_every=0", "train.samples_per_class=1", "train.sample_steps=1",
            "train.progress=false", "train.warmup_steps=0", cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr[-2000:]
    for job in ("0", "1"):
        assert os.path.exists(tmp_path / "sweep" / job / "summary.json")
    assert "lr: 0.003" in (tmp_path / "sweep" / "1" / "config.yaml").read_text()
