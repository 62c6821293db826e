"""Injected faults: preemption signals, kill -9 in the middle of checkpoint writes."""

import json
import multiprocessing
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import ROOT, needs_fashion, run_cli_in_process
from dit_train.runs import checkpoint as ckpt
from dit_train.trainer.preemption import EXIT_PREEMPTED

TINY = ["model.hidden_size=32", "model.depth=1", "model.num_heads=1", "model.patch_size=8",
        "train.batch_size=4", "train.val_samples=4", "train.val_batch_size=4", "train.val_t_points=1",
        "train.sample_every=0", "train.samples_per_class=1", "train.sample_steps=1", "train.progress=false",
        "train.warmup_steps=0", "train.log_every=1", "train.ckpt_every=0"]


def start(run_dir, *extra):
    return subprocess.Popen([sys.executable, "-m", "dit_train", f"run_dir={run_dir}", *TINY, *extra],
                            cwd=str(run_dir.parent), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"})  # 2 shared cores


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
    step = ckpt.read_train_state(saved[0])["step"]
    assert 2 <= step < 400
    # the resume in this process (conftest.run_cli_in_process): the signal is what needs a process of its own
    resumed = run_cli_in_process(f"run_dir={run_dir}", *TINY, "train.steps=400", "train.resume=auto",
                                 f"train.steps={step + 3}", cwd=str(tmp_path), timeout=120)
    assert resumed.returncode == 0, resumed.stderr
    assert json.load(open(run_dir / "summary.json"))["steps"] == step + 3


@needs_fashion
def test_sigterm_during_the_end_of_run_grid_finds_the_final_checkpoint_written_and_stops_the_grid(tmp_path):
    """A long end-of-run sample grid (here 10 images x 200000 Euler steps, minutes): the last step's checkpoint is
    written before it, and a SIGTERM stops it within seconds with the requeue-able code, naming what was skipped
    (before: the grid ran to its end, exit 0, and the checkpoint came after it, lost to the scheduler's SIGKILL)."""
    run_dir = tmp_path / "run"
    end_of_run = ["train.steps=3", "train.val_every=0", "train.sample_every=3", "train.sample_steps=200000"]
    proc = start(run_dir, *end_of_run)
    try:
        t0 = time.time()
        while not ckpt.list_checkpoints(str(run_dir), remove_partial=False):
            assert proc.poll() is None, proc.communicate()
            assert time.time() - t0 < 120, "no checkpoint before the end-of-run grid"
            time.sleep(0.05)
        time.sleep(1.0)  # inside the grid
        proc.send_signal(signal.SIGTERM)
        t_signal = time.time()
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert time.time() - t_signal < 60
    assert proc.returncode == EXIT_PREEMPTED, err
    lines = [ln for ln in err.splitlines() if ln.startswith("preempted:")]
    assert len(lines) == 1 and "received SIGTERM at step 3, the last, during the end-of-run work" in lines[0], err
    assert "skipped sample grid and summary.json; rerun with train.resume=auto" in lines[0]
    assert "Traceback" not in err
    assert "end of run: checkpoint, sample grid (10 images, 200000 steps), summary" in out
    saved = ckpt.list_checkpoints(str(run_dir))
    assert [ckpt.read_train_state(p)["step"] for p in saved] == [3]
    assert not (run_dir / "samples").exists() and not (run_dir / "summary.json").exists()
    # a requeue (here with a shorter grid): nothing is trained again, the skipped end-of-run work is done
    again = run_cli_in_process(f"run_dir={run_dir}", *TINY, *end_of_run[:-1], "train.sample_steps=1",
                               "train.resume=auto", cwd=str(tmp_path), timeout=120)
    assert again.returncode == 0, again.stderr
    assert "finished training at step 3, but its end-of-run work did not complete (no summary.json): running it " \
           "now" in again.stdout
    assert json.load(open(run_dir / "summary.json"))["steps"] == 3 and (run_dir / "samples").is_dir()
    assert [ckpt.read_train_state(p)["step"] for p in ckpt.list_checkpoints(str(run_dir))] == [3]


@needs_fashion
def test_a_requeue_after_a_kill_in_the_end_of_run_work_gives_the_uninterrupted_runs_numbers(tmp_path):
    """A SIGKILL after the last checkpoint and before summary.json (here: the summary and the last metrics rows
    removed by hand, which is what such a kill leaves): the requeue runs the end-of-run validation from the
    checkpoint's EMA weights, and its validation loss is the uninterrupted run's, bit for bit; the study runner
    counts the run as finished only once its summary.json exists."""
    from dit_train.study import run as study_run

    run_dir = tmp_path / "run"
    # the commands in this process (conftest.run_cli_in_process): a kill is what they simulate, not what they do
    cmd = [f"run_dir={run_dir}", *TINY, "train.steps=3", "train.val_every=3"]
    first = run_cli_in_process(*cmd, cwd=str(tmp_path), timeout=120)
    assert first.returncode == 0, first.stderr
    summary = json.load(open(run_dir / "summary.json"))
    assert summary["steps"] == 3 and summary["val_loss"] == summary["val_loss"]  # a number, not NaN
    (run_dir / "summary.json").unlink()
    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows if "val/loss" not in r))
    assert not study_run.finished(str(run_dir), 3)  # a checkpoint at the last step is not enough
    again = run_cli_in_process(*cmd, "train.resume=auto", cwd=str(tmp_path), timeout=120)
    assert again.returncode == 0, again.stderr
    assert "running it now" in again.stdout
    redone = json.load(open(run_dir / "summary.json"))
    assert redone["val_loss"] == summary["val_loss"] and redone["steps"] == 3
    # the training loss too, from the checkpoint's window (before: NaN, no step trained in this process)
    assert redone["train_loss"] == summary["train_loss"] and redone["train_loss_steps"] == 3
    assert study_run.finished(str(run_dir), 3)
    # and a second requeue leaves the finished run as it is
    third = run_cli_in_process(*cmd, "train.resume=auto", cwd=str(tmp_path), timeout=120)
    assert third.returncode == 0 and "already finished at step 3 (train.steps=3); summary.json left unchanged" \
        in third.stdout


def write_checkpoints(run_dir: str, start: int, saved) -> None:
    """Save a checkpoint per step from `start` on, reporting each completed save through the pipe `saved`."""
    for step in range(start, start + 1000):
        # ~8 MB of payload whose every value is the step: a torn file could not pass the check
        tensors = {"model": {"w": torch.full((2_000_000,), float(step))}}
        ckpt.save(run_dir, step, tensors, {"step": step}, keep_last=2)
        saved.send(step)


def test_kill_9_during_saves_never_loses_the_newest_complete_checkpoint(tmp_path):
    # each writer is a process of its own (forked from conftest's fork server, which has imported torch), killed
    # with SIGKILL at a random point after its first completed save, often mid-write
    ctx = multiprocessing.get_context("forkserver")
    rng = random.Random(0)
    newest_seen = -1
    for trial in range(20):
        receive, send = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=write_checkpoints, args=(str(tmp_path), newest_seen + 1, send))
        proc.start()
        assert receive.poll(120), f"trial {trial}: no save completed"  # at least one save in this process
        time.sleep(rng.uniform(0.0, 0.3))
        proc.kill()
        proc.join()
        assert proc.exitcode == -signal.SIGKILL
        path = ckpt.list_checkpoints(str(tmp_path))[-1]  # also removes the partial save
        step = ckpt.read_train_state(path)["step"]
        assert torch.all(ckpt.read_tensors(path, "model")["w"] == step), f"trial {trial}: torn checkpoint {path}"
        assert step >= newest_seen  # never goes backwards
        newest_seen = step
        assert not any(".tmp" in f for f in os.listdir(tmp_path / "checkpoints"))  # partial files removed
    assert newest_seen >= 20


OPTIMIZERS = ["adamw", "muon", "periodic_rowwise", "rownorm", "mud"]
SHAPES = [(1, 16), (16, 1), (8, 32), (32, 8), (12, 12)]


def edge_gradient(kind, shape, g):
    if kind == "zero":
        return torch.zeros(shape)
    if kind == "rank1":
        return torch.randn(shape[0], 1, generator=g) @ torch.randn(1, shape[1], generator=g)
    if kind == "huge":
        return torch.randn(shape, generator=g) * 1e30
    if kind == "tiny":
        return torch.randn(shape, generator=g) * 1e-30
    raise ValueError(kind)


@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("kind", ["zero", "rank1", "huge", "tiny"])
def test_edge_case_gradients_give_finite_updates(name, kind):
    """All-zero, rank-1, huge- and tiny-norm gradients on 1xn, nx1, wide, tall and square matrices: every
    optimizer (and so every NS5/RowNorm/MUD path, refresh and non-refresh) keeps the weights finite."""
    from dit_train.optim.registry import build_optimizer

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(i, o, bias=False) for o, i in SHAPES])
    cfg = {"name": name, "lr": 1e-2, "matrix_patterns": ["*"]} if name != "adamw" else {"name": name, "lr": 1e-2}
    opt = build_optimizer(model, cfg)
    if name != "adamw":  # every matrix really takes the matrix update
        assert sum(len(g["params"]) for g in opt.param_groups if g["kind"] == "matrix") == len(SHAPES)
    g = torch.Generator().manual_seed(1)
    for step in range(3):  # periodic_rowwise K=3 crosses a refresh and two RowNorm steps
        for p in model.parameters():
            p.grad = edge_gradient(kind, p.shape, g)
        opt.step()
        for p in model.parameters():
            assert torch.isfinite(p).all(), (name, kind, tuple(p.shape), step)


@needs_fashion
@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_full_disk_during_a_save_is_one_line_naming_the_path_and_keeps_the_previous_checkpoint(
        tmp_path, small_tmpfs, asynchronous):
    """A real 1.2 MB file system: the first checkpoint (~0.8 MB) fits, the second does not (before: a DCP
    traceback, the synchronous one not saying ENOSPC). The command runs in this process (a full disk seen by a
    process of its own: test_a_full_disk_while_logging_metrics_is_one_line_naming_metrics_jsonl)."""
    run_dir = small_tmpfs("1200k") / "run"
    r = run_cli_in_process(f"run_dir={run_dir}", *TINY, "train.steps=3", "train.ckpt_every=1", "train.keep_last=1",
                           f"train.async_checkpoint={str(asynchronous).lower()}", cwd=str(run_dir.parent),
                           timeout=240)
    err = r.stderr
    lines = err.strip().splitlines()
    assert r.returncode == 1 and "Traceback" not in err, err
    assert lines[-1] == f"error: No space left on device (ENOSPC): '{run_dir}/checkpoints/step_00000002.dcp.tmp' " \
                        "(in create_stream)", err
    saved = ckpt.list_checkpoints(str(run_dir))
    assert [os.path.basename(p) for p in saved] == ["step_00000001.dcp"]
    assert ckpt.read_train_state(saved[0])["step"] == 1 and ckpt.read_tensors(saved[0], "ema")
    assert os.listdir(run_dir / "checkpoints") == ["step_00000001.dcp"]  # the partial save removed


@needs_fashion
def test_a_checkpoint_cut_short_inside_a_shard_file_is_one_line(tmp_path, small_tmpfs):
    """The save fails inside torch's zip writer, which reports it as a RuntimeError ("unexpected pos ..."), not as
    the OSError behind it: a file system smaller than the first shard gave a 90-line traceback (a hostile-file-system
    trial). Now the OSError, read from the file system, in one line; the partial save is removed."""
    disk = small_tmpfs("300k")
    run_dir = disk / "run"
    r = subprocess.run([sys.executable, "-m", "dit_train", f"run_dir={run_dir}", *TINY, "train.steps=1"],
                       cwd=disk, capture_output=True, text=True, timeout=240, env={**os.environ, "PYTHONPATH": ROOT})
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert r.stderr.strip().splitlines()[-1].startswith(
        f"error: No space left on device (ENOSPC): '{run_dir}/checkpoints/step_00000001.dcp.tmp'"), r.stderr[-3000:]
    assert os.listdir(run_dir / "checkpoints") == []


def test_a_shard_at_the_file_size_limit_is_named_as_efbig(tmp_path):
    """The same RuntimeError where a shard reached the file-size limit (ulimit -f) rather than a full disk."""
    import resource

    from dit_train.runs.checkpoint import _out_of_space

    previous = resource.getrlimit(resource.RLIMIT_FSIZE)
    limit = 50_000_000
    try:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, previous[1]))
        assert _out_of_space(str(tmp_path)) is None
        with open(tmp_path / "__0_0.distcp", "wb") as f:
            f.truncate(limit)  # sparse: as far as a write could go
        found = _out_of_space(str(tmp_path))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, previous)
    assert found.errno == 27 and "the file-size limit, ulimit -f, is 50,000,000 bytes" in found.strerror


@needs_fashion
def test_a_full_disk_while_logging_metrics_is_one_line_naming_metrics_jsonl(tmp_path, small_tmpfs):
    from conftest import fill_disk

    disk = small_tmpfs("400k")
    run_dir = disk / "run"
    proc = start(run_dir, "train.steps=100000")
    try:
        wait_for_step(run_dir, 2, proc)
        fill_disk(disk)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 1 and "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"error: No space left on device (ENOSPC): '{run_dir}/metrics.jsonl'"), err


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_at_the_worst_moment_of_a_save_lets_it_finish(tmp_path, monkeypatch, signum):
    """SIGTERM or Ctrl-C after the tensors are written and before the COMPLETE marker (the moment a stop that
    raised there would leave a checkpoint without its marker): the signal is recorded, the save completes, and the
    previous checkpoint is still there."""
    from dit_train.trainer.preemption import Preemption

    run_dir = str(tmp_path / "run")
    tensors = {"ema": {"w": torch.ones(3)}}
    ckpt.save(run_dir, 1, tensors, {"step": 1, "config": {}}, keep_last=0)
    real = ckpt.write_synced

    def signalled(data, path):
        if path.endswith(ckpt.MARKER):
            os.kill(os.getpid(), signum)
        real(data, path)

    monkeypatch.setattr(ckpt, "write_synced", signalled)
    with Preemption() as preemption:
        ckpt.save(run_dir, 2, tensors, {"step": 2, "config": {}}, keep_last=0)
    assert preemption.signal_name == signal.Signals(signum).name
    assert [os.path.basename(p) for p in ckpt.list_checkpoints(run_dir)] == ["step_00000001.dcp", "step_00000002.dcp"]
