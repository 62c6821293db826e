"""Injected faults: preemption signals, kill -9 in the middle of checkpoint writes."""

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from conftest import ROOT, needs_fashion
from dit_train import checkpoint as ckpt
from dit_train.train import EXIT_PREEMPTED

TINY = ["model.hidden_size=32", "model.depth=1", "model.num_heads=1", "model.patch_size=8",
        "train.batch_size=4", "train.val_samples=4", "train.val_batch_size=4", "train.val_t_points=1",
        "train.sample_every=0", "train.samples_per_class=1", "train.sample_steps=1", "train.progress=false",
        "train.warmup_steps=0", "train.log_every=1", "train.ckpt_every=0"]


def start(run_dir, *extra):
    return subprocess.Popen([sys.executable, "-m", "dit_train", f"run_dir={run_dir}", *TINY, *extra],
                            cwd=str(run_dir.parent), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": ROOT})


def wait_for_step(run_dir, step, proc, timeout=120):
    path = run_dir / "metrics.jsonl"
    t0 = time.time()
    while time.time() - t0 < timeout:
        if path.exists() and any(json.loads(l).get("step", 0) >= step for l in path.read_text().splitlines()):
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    raise TimeoutError


@needs_fashion
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_preemption_signal_checkpoints_exits_requeueable_and_resumes(tmp_path, sig):
    run_dir = tmp_path / "run"
    proc = start(run_dir, "train.steps=400")
    wait_for_step(run_dir, 2, proc)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_PREEMPTED, err
    assert f"received {sig.name}" in err and "train.resume=auto" in err
    saved = ckpt.list_checkpoints(str(run_dir))
    assert len(saved) == 1
    step = torch.load(saved[0], weights_only=False)["step"]
    assert 2 <= step < 400
    resumed = subprocess.run([sys.executable, "-m", "dit_train", f"run_dir={run_dir}", *TINY, "train.steps=400",
                              "train.resume=auto", f"train.steps={step + 3}"], cwd=str(tmp_path),
                             capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT}, timeout=120)
    assert resumed.returncode == 0, resumed.stderr
    assert json.load(open(run_dir / "summary.json"))["steps"] == step + 3


WRITER = textwrap.dedent("""
    import sys, torch
    from dit_train import checkpoint as ckpt
    run_dir, start = sys.argv[1], int(sys.argv[2])
    for step in range(start, start + 1000):
        # ~8 MB of payload whose every value is the step: a torn file could not pass the check
        state = {"step": step, "w": torch.full((2_000_000,), float(step))}
        ckpt.save_checkpoint(state, run_dir, step, keep_last=2)
        print(step, flush=True)
""")


def test_kill_9_during_saves_never_loses_the_newest_complete_checkpoint(tmp_path):
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    rng = random.Random(0)
    newest_seen = -1
    for trial in range(20):
        proc = subprocess.Popen([sys.executable, str(script), str(tmp_path), str(newest_seen + 1)],
                                stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": ROOT})
        proc.stdout.readline()  # at least one save completed in this process
        time.sleep(rng.uniform(0.0, 0.3))  # then die at a random point, often mid-write
        proc.kill()
        proc.wait()
        state, path = ckpt.load_newest(str(tmp_path))
        assert state is not None
        assert torch.all(state["w"] == state["step"]), f"trial {trial}: torn checkpoint {path}"
        assert state["step"] >= newest_seen  # never goes backwards
        newest_seen = state["step"]
        assert not any(".tmp" in f for f in os.listdir(tmp_path / "checkpoints"))  # partial files removed
    assert newest_seen >= 20
