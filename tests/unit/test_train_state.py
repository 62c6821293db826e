"""TrainState across device kinds: a CUDA run's checkpoint resumed on the CPU (or the reverse) cannot continue the
training generator's stream (mt19937 on the CPU, Philox on CUDA), so it is refused in one line that says what to
do, instead of failing inside Generator.set_state."""

import base64

import pytest
import torch

from dit_train.runs.checkpoint import CheckpointError
from dit_train.diffusion.ema import EMA
from dit_train.trainer.state import CPU_STATE_BYTES, TrainState


def cpu_train_state() -> TrainState:
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    return TrainState(scheduler=scheduler, generator=torch.Generator().manual_seed(3), ema=EMA(model, 0.9))


def test_the_cpu_generator_state_is_the_size_the_device_rule_assumes():
    assert torch.Generator().get_state().numel() == CPU_STATE_BYTES


def test_a_state_records_its_generator_device_and_loads_back_on_the_same_kind():
    ts = cpu_train_state()
    state = ts.state_dict()
    assert state["generator_device"] == "cpu"
    other = cpu_train_state()
    other.load_state_dict(state)
    assert torch.equal(other.generator.get_state(), ts.generator.get_state())


@pytest.mark.parametrize("recorded", [True, False])  # False: a checkpoint written before the key existed
def test_a_cuda_runs_state_is_refused_on_the_cpu_in_one_line(recorded):
    ts = cpu_train_state()
    state = ts.state_dict()
    philox = torch.arange(16, dtype=torch.uint8)  # a CUDA generator's state: seed and offset, 16 bytes
    state["generator"] = base64.b64encode(philox.numpy().tobytes()).decode()
    if recorded:
        state["generator_device"] = "cuda"
    else:
        del state["generator_device"]
    with pytest.raises(CheckpointError, match="written by a cuda run and this run trains on cpu.*train.init_from") as e:
        ts.load_state_dict(state)
    assert "\n" not in str(e.value) and ts.step == 0


def test_the_latents_vae_record_survives_a_resume_whose_latents_moved_and_older_states_load_without_it():
    """A resume from a moved data.root (no latents_info.json to read the record from) keeps the checkpoint's record,
    so its later checkpoints can still check dit-sample/dit-export/dit-fd --vae; a state written before the record
    existed loads with none (the commands then warn that the VAE cannot be checked)."""
    record = {"vae": "/w/vae", "vae_files": {"config.json": "1-ab"}, "scaling_factor": 0.5, "shift_factor": 0.25}
    ts = cpu_train_state()
    ts.latents_vae = record
    state = ts.state_dict()
    resumed = cpu_train_state()  # built where data.root/latents_info.json is absent: no record of its own
    resumed.load_state_dict(state)
    assert resumed.latents_vae == record and resumed.state_dict()["latents_vae"] == record
    del state["latents_vae"]
    older = cpu_train_state()
    older.load_state_dict(state)
    assert older.latents_vae is None and "latents_vae" not in older.state_dict()


def test_the_train_loss_window_travels_in_the_state_and_an_older_state_resumes_with_an_empty_one(tmp_path, capsys):
    """The summary's train_loss (mean of the last TRAIN_LOSS_WINDOW losses) is the run's across a resume: the window
    is in the state (JSON floats round-trip exactly), capped at its length even when a state holds more; a state
    written before it travelled resumes with none, and the summary says how many steps its mean covers."""
    import json
    import math
    from types import SimpleNamespace

    from dit_train.telemetry.metrics import write_summary
    from dit_train.trainer.state import TRAIN_LOSS_WINDOW

    losses = [1.0 / 3 + i for i in range(TRAIN_LOSS_WINDOW + 7)]
    ts = cpu_train_state()
    ts.recent_losses.extend(losses)
    state = json.loads(json.dumps(ts.state_dict()))  # as train_state.json holds it
    assert state["recent_losses"] == losses[-TRAIN_LOSS_WINDOW:]
    resumed = cpu_train_state()
    resumed.load_state_dict({**state, "recent_losses": losses})  # longer than the window: the last ones count
    assert list(resumed.recent_losses) == losses[-TRAIN_LOSS_WINDOW:]
    resumed.recent_losses.append(7.0)
    assert len(resumed.recent_losses) == TRAIN_LOSS_WINDOW and resumed.recent_losses[-1] == 7.0

    with pytest.raises(CheckpointError, match="recent_losses"):
        cpu_train_state().load_state_dict({**state, "recent_losses": ["1.0"]})

    cfg = SimpleNamespace(run_dir=str(tmp_path), train=SimpleNamespace(batch_size=2),
                          model=SimpleNamespace(name="m"), optimizer=SimpleNamespace(name="o"))
    older = {k: v for k, v in state.items() if k != "recent_losses"}
    old = cpu_train_state()
    old.load_state_dict({**older, "step": 8})
    assert len(old.recent_losses) == 0 and old.recent_losses.maxlen == TRAIN_LOSS_WINDOW
    old.recent_losses.extend([1.0, 2.0, 4.0])  # the 3 steps after the resume
    old.step = 11
    summary = write_summary(cfg, old, {}, 1, "d", True)
    assert summary["train_loss"] == 7.0 / 3 and summary["train_loss_steps"] == 3
    assert "train_loss=2.3333 (mean of the last 3 steps only: resumed from an older checkpoint)" in \
        capsys.readouterr().out
    assert json.load(open(tmp_path / "summary.json"))["train_loss_steps"] == 3
    whole = cpu_train_state()  # a run whose window holds all its steps says nothing more
    whole.step, whole.recent_losses = 2, type(whole.recent_losses)([1.0, 2.0], maxlen=TRAIN_LOSS_WINDOW)
    assert write_summary(cfg, whole, {}, 1, "d", True)["train_loss_steps"] == 2
    assert "only" not in capsys.readouterr().out
    assert math.isnan(write_summary(cfg, cpu_train_state(), {}, 1, "d", False)["train_loss"])
