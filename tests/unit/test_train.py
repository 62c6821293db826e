"""End-to-end behaviour of the training loop on real Fashion-MNIST with a very small DiT (seconds per test)."""

import json
import math
import os

import pytest
import torch

from conftest import compose, needs_fashion, stop_signal_during_step
from dit_train.runs import checkpoint as ckpt
from dit_train.trainer.preemption import Preempted
from dit_train.trainer.loop import Trainer, TrainingStopped, run
from dit_train.parallel.fsdp import DistInfo

pytestmark = needs_fashion


def read_metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_run_leaves_metrics_checkpoints_samples_summary(tiny_cfg):
    tiny_cfg.train.sample_every = 6
    summary = run(tiny_cfg)
    d = tiny_cfg.run_dir
    assert summary["steps"] == 6 and summary["val_loss"] > 0
    rows = read_metrics(d)
    train_rows = [r for r in rows if "train/loss" in r]
    assert [r["step"] for r in train_rows] == [2, 4, 6]
    assert all("time/forward" in r and "imgs_per_s" in r for r in train_rows)
    # each row's lr is the one its step trained with: step s (1-based) at the schedule's index s - 1 (warm-up 2 of
    # 6 steps, then cosine to min_lr_ratio), by hand
    tc, lr = tiny_cfg.train, tiny_cfg.optimizer.lr
    assert tc.lr_schedule == "cosine" and tc.warmup_steps == 2
    cosine = lambda progress: lr * (tc.min_lr_ratio + (1 - tc.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))
    assert [r["lr"] for r in train_rows] == pytest.approx([lr * 2 / 2, cosine(1 / 4), cosine(3 / 4)], rel=1e-12)
    val_rows = [r for r in rows if "val/loss" in r]
    assert [r["step"] for r in val_rows] == [3, 6] and "val/loss_t0.250" in val_rows[0]
    assert [os.path.basename(p) for p in ckpt.list_checkpoints(d)] == ["step_00000003.dcp", "step_00000006.dcp"]
    assert os.path.exists(os.path.join(d, "samples", "step_00000006.png"))
    assert json.load(open(os.path.join(d, "summary.json")))["steps"] == 6
    info = json.load(open(os.path.join(d, "run_info.json")))
    assert "torch" in info["packages"] and "git_commit" in info
    # the kind of CPU: bf16 results of the same commit and seed differ between AMX and AVX2 kernels
    assert info["cpu_capability"] == torch.backends.cpu.get_cpu_capability() and info["cpu"]
    assert os.path.exists(os.path.join(d, "config.yaml"))


def test_fresh_run_refuses_folder_with_checkpoints(tiny_cfg):
    run(tiny_cfg)
    with pytest.raises(FileExistsError, match="train.resume=auto"):
        run(tiny_cfg)


def state_of(trainer):
    return {k: v.clone() for k, v in trainer.model.state_dict().items()}


@pytest.mark.parametrize("optimizer", [
    [],  # the default (adamw)
    # the matrix optimizers' state (momentum, the periodic schedule's step) travels in the checkpoint too; cut at
    # step 3 of K = 2: a refresh step, with a RowNorm step before and after it
    ["optimizer=periodic_rowwise", "optimizer.K=2"],
], ids=["adamw", "periodic_rowwise"])
def test_resume_continues_bit_for_bit(tiny_cfg, tmp_path, optimizer):
    """2N steps straight == N steps, preemption (checkpoint), resume, N steps: same weights, EMA, losses."""
    if optimizer:
        tiny_cfg.optimizer = compose(optimizer).optimizer
    straight_cfg = tiny_cfg.copy()
    straight_cfg.run_dir = str(tmp_path / "straight")
    straight_cfg.train.ckpt_every = 0
    straight = Trainer(straight_cfg, DistInfo())
    straight_summary = straight.fit()

    cut_cfg = tiny_cfg.copy()
    cut_cfg.run_dir = str(tmp_path / "cut")
    cut_cfg.train.ckpt_every = 0
    first = Trainer(cut_cfg, DistInfo())
    stop_signal_during_step(first, 3)  # the signal arrives during step 3
    with pytest.raises(Preempted, match="step 3"):
        first.fit()
    cut_cfg.train.resume = "auto"
    second = Trainer(cut_cfg, DistInfo())
    second_summary = second.fit()
    assert second.state.step == 6
    # the summary is the run's, not the second process's: train_loss over all 6 steps (before, the 3 after the
    # resume), skipped steps, best FD; the timings differ from run to run and are left out
    per_run = ("steps", "train_loss", "train_loss_steps", "val_loss", "skipped_steps", "best_fd", "params")
    assert {k: second_summary[k] for k in per_run} == {k: straight_summary[k] for k in per_run}
    assert straight_summary["train_loss_steps"] == 6
    assert json.load(open(os.path.join(cut_cfg.run_dir, "summary.json")))["train_loss"] == straight_summary["train_loss"]
    for k, v in state_of(straight).items():
        assert torch.equal(v, second.model.state_dict()[k]), k
    for a, b in zip(straight.ema.model.parameters(), second.ema.model.parameters()):
        assert torch.equal(a, b)
    losses = lambda d: [(r["step"], r["train/loss"]) for r in read_metrics(d) if "train/loss" in r]
    assert losses(straight_cfg.run_dir) == losses(cut_cfg.run_dir)


def test_nan_gradient_skips_update_and_stops_after_max_bad_steps(tiny_cfg):
    tiny_cfg.train.max_bad_steps = 2
    trainer = Trainer(tiny_cfg, DistInfo())
    poison = {"on": False}

    def hook(grad):
        return torch.full_like(grad, float("nan")) if poison["on"] else grad

    trainer.model.final_layer.linear.weight.register_hook(hook)
    x, y = trainer.evaluation.val_batches[0]
    trainer.train_step(x, {"y": y})
    opt_state = {k: {n: t.clone() for n, t in v.items() if torch.is_tensor(t)} for k, v in trainer.optimizer.state.items()}
    weights = state_of(trainer)
    poison["on"] = True
    out = trainer.train_step(x, {"y": y})
    assert out["train/skipped"] == 1.0 and trainer.state.skipped_steps == 1
    for k, v in weights.items():
        assert torch.equal(v, trainer.model.state_dict()[k])
    for p, st in trainer.optimizer.state.items():
        for n, t in opt_state[p].items():
            assert torch.equal(t, st[n])
    with pytest.raises(TrainingStopped, match=r"stopping at step 0: 2 non-finite steps in a row") as stopped:
        trainer.train_step(x, {"y": y})
    # nothing was ever saved: the message must not promise a checkpoint that does not exist
    assert "untouched" not in str(stopped.value)
    assert "no checkpoint of this run has been written yet" in str(stopped.value)


def test_a_run_whose_every_step_was_skipped_is_not_a_finished_run(tiny_cfg):
    """A run shorter than train.max_bad_steps whose every update was skipped (latents encoded as inf by a VAE with
    a huge scaling factor) exited 0 with a summary.json, as if trained."""
    import os

    tiny_cfg.train.steps, tiny_cfg.train.max_bad_steps = 2, 20
    trainer = Trainer(tiny_cfg, DistInfo())
    trainer.model.final_layer.linear.weight.register_hook(lambda g: torch.full_like(g, float("nan")))
    with pytest.raises(TrainingStopped, match=r"every one of the run's 2 steps was skipped .* nothing was trained"):
        trainer.fit()
    assert not os.path.exists(os.path.join(tiny_cfg.run_dir, "summary.json"))


def test_nan_stop_names_the_checkpoint_it_leaves_untouched(tiny_cfg):
    tiny_cfg.train.max_bad_steps = 1
    trainer = Trainer(tiny_cfg, DistInfo())
    trainer.state.step = 3
    trainer.save()
    x, y = trainer.evaluation.val_batches[0]
    trainer.model.final_layer.linear.weight.register_hook(lambda g: torch.full_like(g, float("nan")))
    with pytest.raises(TrainingStopped, match=r"the last good checkpoint is .*step_00000003\.dcp, untouched"):
        trainer.train_step(x, {"y": y})


def test_dry_run_builds_large_preset_on_meta(capsys):
    cfg = compose(["model=dit_4b", "optimizer=adamw", "train.dry_run=true", "run_dir=/tmp/unused"])
    out = run(cfg)
    text = capsys.readouterr().out
    assert out["params"] == 4035090960
    assert "4,035,090,960 parameters" in text and "dry run" in text


def test_same_seed_same_losses(tiny_cfg, tmp_path):
    a = tiny_cfg.copy()
    a.run_dir = str(tmp_path / "a")
    b = tiny_cfg.copy()
    b.run_dir = str(tmp_path / "b")
    run(a)
    run(b)
    la = [r.get("train/loss") for r in read_metrics(a.run_dir)]
    assert la == [r.get("train/loss") for r in read_metrics(b.run_dir)]


def test_wandb_offline_needs_no_login_or_network(tiny_cfg, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    tiny_cfg.logger.wandb.mode = "offline"
    tiny_cfg.train.sample_every = 6
    run(tiny_cfg)
    runs = [d for d in os.listdir(os.path.join(tiny_cfg.run_dir, "wandb")) if d.startswith("offline-run-")]
    assert len(runs) == 1
    files = os.listdir(os.path.join(tiny_cfg.run_dir, "wandb", runs[0]))
    assert any(f.endswith(".wandb") for f in files)


@needs_fashion
def test_the_last_checkpoint_is_written_before_the_end_of_run_fd_and_then_holds_its_best_fd(tmp_path):
    """The last step's checkpoint comes first (a signal during the evaluations loses no step); the FD measured
    after it is still recorded as the best FD in that checkpoint's train state, as summary.json has it."""
    cfg = compose([f"run_dir={tmp_path / 'run'}", "eval=ci", "eval.every_n_steps=4", "eval.num_samples=16",
                   "eval.batch_size=8", "eval.sample_steps=1", "eval.reference_num=32", "eval.reference_split=val",
                   f"eval.cache_dir={tmp_path / 'cache'}", "model.hidden_size=32", "model.depth=1",
                   "model.num_heads=1", "model.patch_size=8", "train.steps=4", "train.batch_size=4",
                   "train.val_every=0", "train.sample_every=0", "train.ckpt_every=0", "train.progress=false"])
    trainer = Trainer(cfg, DistInfo())
    order = []
    save, evaluate_fd = trainer.save, trainer.evaluation.evaluate_fd
    trainer.save = lambda: order.append("checkpoint") or save()
    trainer.evaluation.evaluate_fd = lambda *a: order.append("fd") or evaluate_fd(*a)
    summary = trainer.fit()
    assert order == ["checkpoint", "fd"]
    best = ckpt.read_train_state(ckpt.resolve_checkpoint(cfg.run_dir))["best_fd"]
    assert best is not None and best == summary["best_fd"] and best["step"] == 4
