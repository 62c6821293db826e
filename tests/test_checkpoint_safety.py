"""Checkpoints are data, not code: a checkpoint whose pickled parts would run code when loaded is refused by every
reader (resume, export, sampling and the FD jobs all go through dit_train.checkpoint), and nothing runs."""

import os
import pickle

import pytest
import torch

from dit_train import checkpoint as ckpt


class Payload:
    """Unpickling this calls os.makedirs(path): the side effect shows whether code ran."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return os.makedirs, (self.path,)


def saved_run(tmp_path):
    run_dir = str(tmp_path / "run")
    tensors = {"ema": {"w": torch.ones(3)}, "optimizer": {"param_groups": [{"lr": 0.1}]}}
    path = ckpt.save(run_dir, 1, tensors, {"step": 1, "active_time_s": 0.0, "config": {}}, keep_last=0)
    return run_dir, path


def test_a_clean_checkpoint_reads_back(tmp_path):
    run_dir, path = saved_run(tmp_path)
    weights, config, meta = ckpt.load_ema_weights(run_dir)
    assert torch.equal(weights["w"], torch.ones(3)) and meta["step"] == 1 and meta["format"] == "dcp"


def test_code_in_dcp_metadata_is_refused(tmp_path):
    run_dir, path = saved_run(tmp_path)
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(Payload(tmp_path / "pwned"), f)
    with pytest.raises(ckpt.CheckpointError, match="refusing to load"):
        ckpt.load_ema_weights(run_dir)
    assert not (tmp_path / "pwned").exists()


def test_code_in_a_dcp_non_tensor_item_is_refused(tmp_path):
    """The optimizer's param-group values are stored as pickled items; one that would run code stops resume."""
    model, ema = torch.nn.Linear(3, 1), torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    tensors = ckpt.tensor_state(model, optimizer, ema)
    tensors["optimizer"]["param_groups"][0]["lr"] = Payload(tmp_path / "pwned")
    path = ckpt.save(str(tmp_path / "run"), 1, tensors, {"step": 1, "config": {}}, keep_last=0)
    assert not (tmp_path / "pwned").exists()  # saving pickled it without running it
    with pytest.raises(ckpt.CheckpointError, match="could run code"):
        ckpt.load(path, model, optimizer, ema)  # what resume calls
    assert not (tmp_path / "pwned").exists()


def test_code_in_a_legacy_single_file_checkpoint_is_refused(tmp_path):
    folder = tmp_path / "run" / "checkpoints"
    folder.mkdir(parents=True)
    torch.save({"step": 5, "config": {}, "ema": {"model": {}}, "rng": Payload(tmp_path / "pwned")},
               folder / "step_00000005.pt")
    for reader in (ckpt.load_ema_weights, ckpt.load_for_inference):
        with pytest.raises(ckpt.CheckpointError, match="could run code"):
            reader(str(tmp_path / "run"))
    assert not (tmp_path / "pwned").exists()
