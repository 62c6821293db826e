"""train.async_checkpoint=true on CPU (DCP's async_save: staged to host memory, written by a thread; on 2 ranks its
collectives run on a gloo group of their own): what is saved is the state at the save step even when the next steps
change the tensors before the write; a save is a checkpoint only after its write; a preempted run leaves its newest
checkpoint complete; a crash before the write has finished leaves no marker; and the run equals a synchronous one
bit for bit, on 1 process and on 2 ranks. The staging buffers are reused from save to save (pinned on CUDA only).

Writes are held back by a gate on the file-system writer (the background thread waits on it), so "in flight" is a
state the tests set up, not a race they hope to win."""

import json
import os
import threading

import pytest
import torch
import torch.distributed.checkpoint as dcp

from conftest import compose, gloo_group, needs_fashion, spawn_ranks, stop_signal_during_step
from dit_train.runs import checkpoint as ckpt
from dit_train.runs.checkpoint_saver import resolve_async
from dit_train.parallel.fsdp import DistInfo
from dit_train.trainer.preemption import Preempted
from dit_train.trainer.loop import Trainer

pytestmark = needs_fashion


def read_metrics(run_dir) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def losses(run_dir) -> dict[int, float]:
    return {r["step"]: r["train/loss"] for r in read_metrics(run_dir) if "train/loss" in r}


def hold_writes(monkeypatch, gate: threading.Event, which: str = "") -> None:
    """Writes into a folder whose name contains `which` wait for `gate` (in DCP's writer thread for async saves)."""
    original = dcp.FileSystemWriter.write_data

    def gated(self, *args, **kwargs):
        if which in str(self.path):
            assert gate.wait(timeout=120), "a test gate was never opened"
        return original(self, *args, **kwargs)

    monkeypatch.setattr(dcp.FileSystemWriter, "write_data", gated)


def before_step(trainer, step: int, action) -> None:
    """Run action() as `trainer` begins its step `step` (1-based)."""
    original = trainer.train_step

    def wrapped(*args, **kwargs):
        if trainer.state.step == step - 1:
            action()
        return original(*args, **kwargs)

    trainer.train_step = wrapped


def optimizer_tensors(trainer) -> dict:
    names = {p: n for n, p in trainer.model.named_parameters()}
    return {(names[p], k): v.clone() for p, st in trainer.optimizer.state.items() for k, v in st.items()
            if torch.is_tensor(v)}


def markers(run_dir) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), run_dir) for d, _, files in os.walk(run_dir)
                  for f in files if f == ckpt.MARKER)


def test_auto_is_on_for_cuda_only_the_key_is_checked_and_may_change_on_resume():
    assert resolve_async("auto", torch.device("cuda", 0)) and not resolve_async("auto", torch.device("cpu"))
    assert resolve_async(True, torch.device("cpu")) and not resolve_async(False, torch.device("cuda", 0))
    from omegaconf import OmegaConf

    from dit_train.config import ConfigError, validate
    from dit_train.runs.resume_policy import config_changes

    with pytest.raises(ConfigError, match=r"train.async_checkpoint='yes' is not valid: choose auto \(on for CUDA"):
        validate(compose(["run_dir=/tmp/unused", "train.async_checkpoint=yes"]))
    now = OmegaConf.to_container(compose(["run_dir=/tmp/unused", "train.async_checkpoint=true"]), resolve=True)
    recorded_before_the_key = OmegaConf.to_container(compose(["run_dir=/tmp/unused"]), resolve=True)
    del recorded_before_the_key["train"]["async_checkpoint"]
    assert config_changes(recorded_before_the_key, now) == []  # how a checkpoint is written is not the experiment


def test_the_save_is_what_the_step_left_even_when_later_steps_change_it_before_the_write(tiny_cfg, monkeypatch):
    tiny_cfg.train.async_checkpoint = True
    trainer = Trainer(tiny_cfg, DistInfo())
    x, y = trainer.evaluation.val_batches[0]
    trainer.train_step(x, {"y": y})  # the optimizer has state
    trainer.state.step = 1
    saved = {part: {k: v.clone() for k, v in sd.items()} for part, sd in
             (("model", trainer.model.state_dict()), ("ema", trainer.ema.model.state_dict()))}
    saved_opt = optimizer_tensors(trainer)
    gate = threading.Event()
    hold_writes(monkeypatch, gate)
    try:
        trainer.save()
        assert trainer.saver.pending is not None and not trainer.saver.pending.done()
        trainer.saver.poll(1)
        assert ckpt.list_checkpoints(tiny_cfg.run_dir, remove_partial=False) == [] and markers(tiny_cfg.run_dir) == []
        trainer.train_step(x, {"y": y})  # weights, optimizer moments and EMA change in place before the write
        trainer.state.step = 2
        assert not torch.equal(saved["model"]["final_layer.linear.weight"],
                               trainer.model.state_dict()["final_layer.linear.weight"])
    finally:
        gate.set()
    trainer.saver.wait(2)
    [path] = ckpt.list_checkpoints(tiny_cfg.run_dir)
    assert ckpt.read_train_state(path)["step"] == 1  # the train state is the save step's too
    fresh_cfg = tiny_cfg.copy()
    fresh_cfg.run_dir = tiny_cfg.run_dir + "_fresh"  # a new run: the first one's folder has a checkpoint now
    fresh = Trainer(fresh_cfg, DistInfo())
    ckpt.load(path, fresh.model, fresh.optimizer, fresh.ema.model)
    for part, module in (("model", fresh.model), ("ema", fresh.ema.model)):
        for k, v in module.state_dict().items():
            assert torch.equal(v, saved[part][k]), (part, k)
    loaded = optimizer_tensors(fresh)
    assert loaded.keys() == saved_opt.keys() and loaded
    for k, v in loaded.items():
        assert torch.equal(v, saved_opt[k]), k
    rows = [r for r in read_metrics(tiny_cfg.run_dir) if any(k.startswith("ckpt/") for k in r)]
    assert [r["step"] for r in rows] == [1, 2]
    assert set(rows[0]) == {"step", "ckpt/save_s", "ckpt/stage_gbps"}  # the blocking part, at the save step
    assert rows[0]["ckpt/stage_gbps"] > 0
    assert rows[1]["ckpt/step"] == 1 and rows[1]["ckpt/write_s"] > 0 and \
        rows[1]["ckpt/bytes"] == ckpt.folder_bytes(path)  # the write, where it was seen finished
    trainer.logger.close()
    fresh.logger.close()


def state_of(module) -> dict:
    return {k: v.clone() for k, v in module.state_dict().items()}


def test_preempted_while_a_save_is_in_flight_leaves_complete_checkpoints_and_resumes_bit_for_bit(
        tiny_cfg, tmp_path, monkeypatch):
    """6 steps straight with synchronous saves == async saves every 2 steps, SIGTERM during step 3 while step 2's
    save is still being written, resume: same weights, EMA, losses."""
    straight_cfg = tiny_cfg.copy()
    straight_cfg.run_dir = str(tmp_path / "straight")
    straight_cfg.train.ckpt_every = 0
    straight_cfg.train.async_checkpoint = False
    straight = Trainer(straight_cfg, DistInfo())
    straight.fit()

    cut_cfg = tiny_cfg.copy()
    cut_cfg.run_dir = str(tmp_path / "cut")
    cut_cfg.train.ckpt_every = 2
    cut_cfg.train.async_checkpoint = True
    first = Trainer(cut_cfg, DistInfo())
    gate = threading.Event()
    hold_writes(monkeypatch, gate, which="step_00000002")
    in_flight = []
    stop_signal_during_step(first, 3)  # the signal arrives during step 3 ...
    before_step(first, 3, lambda: (in_flight.append(first.saver.pending is not None and  # ... step 2 still writing
                                                    not first.saver.pending.done()), gate.set()))
    try:
        with pytest.raises(Preempted, match="step 3"):
            first.fit()
    finally:
        gate.set()
    assert in_flight == [True]
    # the preemption save waited for step 2's, then was itself finished before the run ended
    assert [os.path.basename(p) for p in ckpt.list_checkpoints(cut_cfg.run_dir)] == \
        ["step_00000002.dcp", "step_00000003.dcp"]
    cut_cfg.train.resume = "auto"
    second = Trainer(cut_cfg, DistInfo())
    second.fit()
    assert second.state.step == 6
    for a, b in ((straight.model, second.model), (straight.ema.model, second.ema.model)):
        for k, v in state_of(a).items():
            assert torch.equal(v, b.state_dict()[k]), k
    assert losses(straight_cfg.run_dir) == losses(cut_cfg.run_dir)
    rows = read_metrics(cut_cfg.run_dir)
    assert [r["step"] for r in rows if set(r) == {"step", "ckpt/save_s", "ckpt/stage_gbps"}] == [2, 3, 4, 6]  # async
    assert [r["ckpt/step"] for r in rows if "ckpt/write_s" in r] == [2, 3, 4, 6]  # every save finished
    assert all("ckpt/save_s" in r and "ckpt/bytes" in r for r in read_metrics(straight_cfg.run_dir)
               if "ckpt/write_s" in r)  # synchronous: one row per save


def test_a_crash_before_the_write_finishes_leaves_no_marker_and_resume_skips_it(tiny_cfg, monkeypatch, caplog):
    tiny_cfg.train.ckpt_every = 2
    tiny_cfg.train.async_checkpoint = True
    trainer = Trainer(tiny_cfg, DistInfo())
    gate = threading.Event()
    hold_writes(monkeypatch, gate, which="step_00000004")

    def crash():
        raise RuntimeError("simulated crash")

    before_step(trainer, 5, crash)
    try:
        with pytest.raises(RuntimeError, match="simulated crash"):
            trainer.fit()
        folder = ckpt.checkpoint_dir(tiny_cfg.run_dir)
        assert sorted(os.listdir(folder)) == ["step_00000002.dcp", "step_00000004.dcp.tmp"]
    finally:
        gate.set()
    trainer.saver.pending.future.result()  # the write itself completes after the crash ...
    assert markers(tiny_cfg.run_dir) == [os.path.join("checkpoints", "step_00000002.dcp", ckpt.MARKER)]  # ... unmarked
    tiny_cfg.train.resume = "auto"
    resumed = Trainer(tiny_cfg, DistInfo())
    resumed.fit()
    assert "step_00000004.dcp.tmp" in caplog.text  # reported and removed
    assert [r["step"] for r in read_metrics(tiny_cfg.run_dir) if "train/loss" in r] == [2, 4, 4, 6]  # from step 2


# 2 ranks: 12 images per step, FSDP2 shards; steps 1-4, a save every 2 steps
TWO_RANKS = ["model.hidden_size=32", "model.depth=2", "model.num_heads=2", "model.patch_size=8", "train.steps=4",
             "train.batch_size=12", "train.warmup_steps=2", "train.log_every=1", "train.val_every=0",
             "train.val_samples=4", "train.val_batch_size=4", "train.val_t_points=1", "train.sample_every=0",
             "train.ckpt_every=2", "train.keep_last=0", "train.progress=false", "train.samples_per_class=1",
             "train.sample_steps=1", "optimizer=adamw"]


def _two_rank_runs(rank, world, port, root):
    """A synchronous straight run; an async run whose step-2 save is held until step 3 begins, when rank 1 alone
    receives SIGTERM; its resume=auto continuation."""
    with gloo_group(rank, world, port):
        from dit_train.trainer import loop as train
        from dit_train.trainer.loop import run

        run(compose(TWO_RANKS + [f"run_dir={root}/straight", "train.async_checkpoint=false"]))
        gate, original_step, original_write = threading.Event(), train.Trainer.train_step, dcp.FileSystemWriter.write_data

        def step(self, *args, **kwargs):
            if self.state.step == 2:
                assert self.saver.pending is not None and not self.saver.pending.done()  # step 2's save in flight
                gate.set()
                if rank == 1:  # the signal reaches one rank; the step's all-reduce carries its vote
                    self.preemption.signal_name = "SIGTERM"
            return original_step(self, *args, **kwargs)

        def write(self, *args, **kwargs):
            if "step_00000002" in str(self.path):
                assert gate.wait(timeout=120)
            return original_write(self, *args, **kwargs)

        train.Trainer.train_step, dcp.FileSystemWriter.write_data = step, write
        try:
            with pytest.raises(Preempted, match="step 3"):
                run(compose(TWO_RANKS + [f"run_dir={root}/cut", "train.async_checkpoint=true"]))
        finally:
            gate.set()
            train.Trainer.train_step, dcp.FileSystemWriter.write_data = original_step, original_write
        run(compose(TWO_RANKS + [f"run_dir={root}/cut", "train.async_checkpoint=true", "train.resume=auto"]))


def test_two_ranks_preempted_with_a_save_in_flight_resume_as_a_synchronous_run(tmp_path):
    spawn_ranks(_two_rank_runs, 2, (str(tmp_path),))
    straight, cut = tmp_path / "straight", tmp_path / "cut"
    assert [os.path.basename(p) for p in ckpt.list_checkpoints(str(cut))] == \
        ["step_00000002.dcp", "step_00000003.dcp", "step_00000004.dcp"]
    assert losses(cut) == losses(straight) and sorted(losses(cut)) == [1, 2, 3, 4]
    last = lambda run_dir: os.path.join(ckpt.checkpoint_dir(str(run_dir)), "step_00000004.dcp")
    for part in ("model", "ema", "optimizer"):
        a, b = ckpt.read_tensors(last(straight), part), ckpt.read_tensors(last(cut), part)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), part
    rows = read_metrics(cut)
    assert [r["step"] for r in rows if set(r) == {"step", "ckpt/save_s", "ckpt/stage_gbps"}] == [2, 3, 4]  # async
    assert [r["ckpt/step"] for r in rows if "ckpt/write_s" in r] == [2, 3, 4]


def test_a_failed_background_write_is_raised_by_the_next_wait_and_leaves_nothing(tmp_path, monkeypatch):
    from dit_train.runs.checkpoint_saver import CheckpointSaver

    def full_disk(self, *args, **kwargs):
        raise OSError(28, "No space left on device", str(self.path))

    monkeypatch.setattr(dcp.FileSystemWriter, "write_data", full_disk)
    rows = []
    saver = CheckpointSaver(str(tmp_path), keep_last=0, asynchronous=True, log_metrics=lambda s, m: rows.append(m))
    saver.save(1, {"model": {"w": torch.ones(4)}}, {"step": 1})
    saver.pending.future.exception(timeout=60)  # the write has failed in the background ...
    saver.poll(2)  # ... which a poll, on one rank only, leaves alone
    assert saver.pending is not None
    with pytest.raises(OSError, match="No space left") as e:  # the OSError inside DCP's CheckpointException
        saver.wait(3)  # every rank waits at the same step, so all of them raise together
    assert e.value.errno == 28 and e.value.filename.endswith("step_00000001.dcp.tmp")
    assert os.listdir(ckpt.checkpoint_dir(str(tmp_path))) == []
    assert [set(r) for r in rows] == [{"ckpt/save_s", "ckpt/stage_gbps"}]


def test_staging_takes_pinned_buffers_on_cuda_only(tmp_path, monkeypatch):
    """The stager's options follow the device of the saved tensors (fake CUDA tensors here: no GPU needed)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from dit_train.runs import checkpoint_saver
    from dit_train.runs.checkpoint_saver import CheckpointSaver, staging_options

    cuda, cpu = staging_options(torch.device("cuda", 0)), staging_options(torch.device("cpu"))
    assert cuda.use_pinned_memory and cuda.use_non_blocking_copy and not cpu.use_pinned_memory
    assert not cpu.use_non_blocking_copy  # DCP refuses non-blocking copies without an accelerator
    assert not cuda.use_async_staging and not cpu.use_async_staging  # complete before the next step changes them
    chosen = []

    class Pending:
        stage_s = 0.5

    monkeypatch.setattr(checkpoint_saver, "DefaultStager", lambda options: chosen.append(options) or "stager")
    monkeypatch.setattr(ckpt, "start_save", lambda *args: Pending())
    with FakeTensorMode():
        on_cuda = {"model": {"w": torch.empty(1000, 250, device="cuda")}}
    rows = []
    for tensors in (on_cuda, {"model": {"w": torch.zeros(1000, 250)}}):
        saver = CheckpointSaver(str(tmp_path), keep_last=0, asynchronous=True, log_metrics=lambda s, m: rows.append(m))
        saver.save(1, tensors, {"step": 1})
        saver.pending = None
    assert chosen == [cuda, cpu]
    assert [r["ckpt/stage_gbps"] for r in rows] == [pytest.approx(1e6 / 0.5 / 1e9)] * 2  # 1 MB in 0.5 s


def test_async_saves_reuse_their_staging_buffers_and_each_round_trips_bit_for_bit(tmp_path, monkeypatch):
    from torch.distributed.checkpoint import FileSystemReader

    from dit_train.runs.checkpoint_saver import CheckpointSaver

    staged = []  # what each save's writer was given, kept alive: fresh buffers could not land on the same memory
    original = dcp.FileSystemWriter.write_data

    def capture(self, plan, planner):
        staged.append({k: v for k, v in planner.state_dict.items()})
        return original(self, plan, planner)

    monkeypatch.setattr(dcp.FileSystemWriter, "write_data", capture)
    g = torch.Generator().manual_seed(0)
    live = {"w": torch.randn(256, 64, generator=g), "m": torch.randn(4096, generator=g).double()}
    saver = CheckpointSaver(str(tmp_path), keep_last=0, asynchronous=True, log_metrics=lambda s, m: None)
    expected = {}
    for step in (1, 2, 3):
        saver.save(step, {"model": live}, {"step": step})
        expected[step] = {k: v.clone() for k, v in live.items()}
        for v in live.values():  # the next steps change the tensors in place while the write is in flight
            v.mul_(-1.5).add_(0.25)
        saver.wait(step)
    assert len(staged) == 3
    for later in staged[1:]:
        assert {k: v.data_ptr() for k, v in later.items()} == {k: v.data_ptr() for k, v in staged[0].items()}
    for step, values in expected.items():
        back = {"model": {k: torch.empty_like(v) for k, v in values.items()}}
        dcp.load(back, storage_reader=FileSystemReader(ckpt.checkpoint_path(str(tmp_path), step)), no_dist=True)
        for k, v in values.items():
            assert torch.equal(back["model"][k], v) and back["model"][k].dtype == v.dtype, (step, k)


def test_the_last_checkpoint_is_complete_before_the_end_of_run_evaluations_start(tiny_cfg, monkeypatch):
    """With asynchronous saves the end-of-run work (validation, grids, FD: minutes) ran while the last checkpoint was
    still being written: a SIGKILL during it left only step_N.dcp.tmp, so the requeue trained ckpt_every steps
    again, and a full disk met by a grid hid the save's own error (a hostile-file-system trial)."""
    tiny_cfg.train.async_checkpoint = True
    trainer = Trainer(tiny_cfg, DistInfo())
    seen = []
    run_due = trainer.evaluation.run_due

    def recorded(step, *args, **kwargs):
        if step == tiny_cfg.train.steps:
            seen.append([os.path.basename(p) for p in ckpt.list_checkpoints(tiny_cfg.run_dir, remove_partial=False)])
        return run_due(step, *args, **kwargs)

    monkeypatch.setattr(trainer.evaluation, "run_due", recorded)
    trainer.fit()
    assert seen == [[f"step_{3:08d}.dcp", f"step_{tiny_cfg.train.steps:08d}.dcp"]], seen
