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
