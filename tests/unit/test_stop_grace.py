"""train.stop_grace_s: the seconds a stop signal leaves before the kill (torchrun --shutdown-timeout, 30 s by
default; Slurm --signal=USR1@N). A preemption writes its checkpoint in that time; a run whose checkpoints take
longer is told so, once when a save takes longer and again at the start of a resume (from the write time the
checkpoint recorded), instead of losing its preemption checkpoints silently."""

import logging

import torch

from dit_train.runs import checkpoint as ckpt
from dit_train.runs.checkpoint_saver import CheckpointSaver, grace_warning
from dit_train.diffusion.ema import EMA
from dit_train.trainer.state import TrainState


def test_the_warning_names_the_write_the_grace_and_what_to_set():
    assert grace_warning(29.0, 7_600_000_000, 30) is None and grace_warning(None, None, 30) is None
    told = grace_warning(57.0, 7_600_000_000, 30)
    assert told.startswith("a checkpoint took 57 s to write (7.6 GB, 0.13 GB/s), more than train.stop_grace_s=30 s")
    assert "torchrun --shutdown-timeout" in told and "--signal=USR1@N" in told and "\n" not in told
    assert grace_warning(57.0, None, 30).startswith("a checkpoint took 57 s to write, more than")


def test_a_slow_save_is_warned_about_once(tmp_path, monkeypatch, caplog):
    class SlowPending:
        def __init__(self, step):
            self.step, self.final = step, ckpt.checkpoint_path(str(tmp_path), step)

        def finish(self, keep_last):
            return {"ckpt/write_s": 45.0, "ckpt/bytes": 9_000_000_000}

    monkeypatch.setattr(ckpt, "start_save", lambda run_dir, step, *args: SlowPending(step))
    saver = CheckpointSaver(str(tmp_path), keep_last=0, asynchronous=False, log_metrics=lambda s, m: None,
                            stop_grace_s=30)
    with caplog.at_level(logging.WARNING, logger="dit_train"):
        for step in (1, 2):
            saver.save(step, {}, {"step": step})
    told = [r.getMessage() for r in caplog.records if "stop_grace_s" in r.getMessage()]
    assert len(told) == 1 and "took 45 s" in told[0] and saver.last_write_s == 45.0


def test_the_train_state_carries_the_last_write_time_to_a_resume():
    model = torch.nn.Linear(2, 2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(torch.optim.SGD(model.parameters(), lr=0.1), lambda s: 1.0)
    state = TrainState(scheduler=scheduler, generator=torch.Generator(), ema=EMA(model, 0.9), ckpt_write_s=41.5)
    back = TrainState(scheduler=scheduler, generator=torch.Generator(), ema=EMA(model, 0.9))
    back.load_state_dict(state.state_dict())
    assert back.ckpt_write_s == 41.5


def test_a_resume_warns_at_start_when_its_last_checkpoint_took_longer_than_the_grace(tiny_cfg, caplog):
    import json
    import os

    from omegaconf import OmegaConf

    from dit_train.trainer.loop import run

    run(tiny_cfg)
    newest = ckpt.list_checkpoints(tiny_cfg.run_dir)[-1]
    with open(os.path.join(newest, ckpt.TRAIN_STATE)) as f:
        state = json.load(f)
    assert isinstance(state["ckpt_write_s"], float)  # the write of the save before it, as measured
    state["ckpt_write_s"] = 75.0  # as a slow cluster file system would have measured it
    with open(os.path.join(newest, ckpt.TRAIN_STATE), "w") as f:
        json.dump(state, f)
    resumed = OmegaConf.merge(tiny_cfg, {"train": {"resume": "auto", "steps": 7}})
    with caplog.at_level(logging.WARNING, logger="dit_train"):
        run(resumed)
    assert any("took 75 s to write, more than train.stop_grace_s=30 s" in r.getMessage() for r in caplog.records)
