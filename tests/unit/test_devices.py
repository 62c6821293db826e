"""--device of the sampling commands: a name torch cannot parse or a CUDA device this machine lacks is one line,
exit 2, before anything is loaded (the run folder here does not exist: its error would come first if it were)."""

import sys

import pytest
import torch

from dit_train.evaluation.fd import job, reference_stats
from dit_train import sample

COMMANDS = {"dit-sample": sample.main, "dit-fd": job.cli, "dit-reference-stats": reference_stats.cli}
MISSING_CUDA = f"cuda:{torch.cuda.device_count()}"  # one past the last device, on any machine


@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize("device, says", [
    ("gpu", "expected cpu, cuda or cuda:N"),
    (MISSING_CUDA, f"this machine has {torch.cuda.device_count()} CUDA device(s)"),
])
def test_a_device_this_machine_lacks_is_one_line_before_anything_loads(command, device, says, tmp_path, capsys,
                                                                       monkeypatch):
    args = ["--cache-dir", str(tmp_path / "cache")] if command == "dit-reference-stats" else [str(tmp_path / "run")]
    monkeypatch.setattr(sys, "argv", [command, *args, "--device", device])
    assert COMMANDS[command]() == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --device {device!r} is not valid: {says}") and err.count("\n") == 1, err
    assert not (tmp_path / "cache").exists()
