"""Optional packages: a feature whose package is missing stops with one line naming the pyproject extra, checked
on the command line before anything heavy; every extra is in pyproject and in `dev`."""

import os
import tomllib

import pytest

from conftest import ROOT
from dit_train.config import check_command_line
from dit_train.extras import EXTRA_OF, MissingExtra, require


def test_missing_package_names_its_extra(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "wandb", None)  # as if wandb were not installed
    with pytest.raises(MissingExtra, match=r"^logger.wandb.mode=offline needs the package 'wandb', which is not "
                                           r"installed: pip install 'dit_train\[wandb\]'$"):
        require("wandb", "wandb", "logger.wandb.mode=offline")
    require("torch", "none", "anything")  # installed: no error


@pytest.mark.parametrize("args, module, extra", [
    (["logger.wandb.mode=offline"], "wandb", "wandb"),
    (["eval.every_n_steps=10", "eval.encoder=dinov2"], "transformers", "eval"),
    (["launcher=slurm"], "hydra_plugins.hydra_submitit_launcher", "slurm"),
])
def test_command_line_refuses_a_feature_without_its_package(monkeypatch, capsys, args, module, extra):
    monkeypatch.setitem(__import__("sys").modules, module, None)
    with pytest.raises(SystemExit) as stop:
        check_command_line(args)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1 and f"pip install 'dit_train[{extra}]'" in err, err


def test_every_extra_is_in_pyproject_and_in_dev():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    named = set(EXTRA_OF.values())
    assert named <= set(extras)
    (dev_self,) = [d for d in extras["dev"] if d.startswith("dit_train[")]
    assert set(dev_self[len("dit_train["):-1].split(",")) == named


def test_a_slurm_sweep_on_a_machine_without_sbatch_is_one_line(monkeypatch, capsys, tmp_path):
    """submitit's "Could not detect srun" traceback came after Hydra had made the sweep folder (a distributed
    trial ran the documented sweep where Slurm is not installed)."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch
    with pytest.raises(SystemExit) as stop:
        check_command_line(["--multirun", "launcher=slurm", "model=dit_s"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err == ("error: launcher=slurm submits with Slurm's sbatch, which is not on this "
                                            "machine's PATH: run the command on the cluster's login node (or drop "
                                            "launcher=slurm to train here)\n")
    (tmp_path / "sbatch").write_text("#!/bin/sh\n")
    (tmp_path / "sbatch").chmod(0o755)
    check_command_line(["--multirun", "launcher=slurm", "model=dit_s"])  # on a login node: composed and checked


def test_a_slurm_job_is_checked_at_its_own_world_size(monkeypatch, capsys, tmp_path):
    """Each launcher=slurm job runs nodes x gpus_per_node ranks: checked at the login node's world size 1,
    train.batch_size=3 on 2 ranks was submitted and refused by the cluster's jobs (dit-torchrun refused it at once)."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    (tmp_path / "sbatch").write_text("#!/bin/sh\nexit 1\n")
    (tmp_path / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    shape = ["model.launch.nodes=2", "model.launch.gpus_per_node=1"]
    with pytest.raises(SystemExit) as stop:
        check_command_line(["--multirun", "launcher=slurm", "model=dit_xs", *shape, "train.batch_size=3"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1, err
    assert "train.batch_size" in err and "divisible by the world size 2" in err, err
    # the sweep's own shapes, job by job: dit_xs at 2 x 1 refused, at 1 x 1 (its preset) accepted
    with pytest.raises(SystemExit):
        check_command_line(["--multirun", "launcher=slurm", "model=dit_xs", "model.launch.nodes=1,2",
                            "train.batch_size=3"])
    assert "divisible by the world size 2" in capsys.readouterr().err
    assert len(check_command_line(["--multirun", "launcher=slurm", "model=dit_xs", "train.batch_size=3"])) == 1
    assert len(check_command_line(["--multirun", "launcher=slurm", "model=dit_xs", *shape,
                                   "train.batch_size=4"])) == 1
