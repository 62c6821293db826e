"""A sweep whose jobs' folder names (the experiments' hydra.sweep.subdir=${hydra.job.override_dirname}) would pass
the file system's limit on a name is refused on the command line in one line, before Hydra writes anything; Hydra
itself fails after the sweep began, with an OSError traceback."""

import os

import pytest

from dit_train.config import check_command_line
from dit_train.config.command_line import ConfigError, _name_limit, sweep_job_folders

# fourteen ordinary overrides of one study job: their folder name is 292 bytes
MANY = ["optimizer=periodic_rowwise", "optimizer.K=3", "optimizer.rownorm_scale=spectral", "optimizer.lr=0.004",
        "model.qk_norm=False", "seed=45", "train.steps=2", "train.warmup_steps=0", "train.ema_decay=0.999",
        "train.log_every=1", "train.ckpt_every=1000", "train.min_lr_ratio=0.1", "optimizer.weight_decay=0.01",
        "optimizer.momentum=0.95"]


def test_a_sweep_of_many_overrides_is_refused_in_one_line_before_anything_is_written(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    name = ",".join(sorted(MANY))  # Hydra's override_dirname: sorted, the experiment key excluded
    assert len(name) > _name_limit(str(tmp_path))
    with pytest.raises(SystemExit) as stop:
        check_command_line(["--multirun", "experiment=smoke", *MANY])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1, err
    assert f"folder name of {len(name)} bytes, more than this file system's {_name_limit(str(tmp_path))}" in err
    assert f"sweeps/smoke/{name[:50]}..." in err and "hydra.sweep.subdir='${hydra.job.num}'" in err
    assert os.listdir(tmp_path) == []


def test_the_suggested_numbered_folders_pass(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    check_command_line(["--multirun", "experiment=smoke", *MANY, "hydra.sweep.subdir=${hydra.job.num}"])
    assert capsys.readouterr().err == ""


def test_each_job_is_named_with_its_own_overrides_up_to_the_limit(tmp_path, monkeypatch):
    """The limit is the file system's, checked per job: seed=<digits> is the whole name under experiment=smoke."""
    monkeypatch.chdir(tmp_path)
    limit = _name_limit(str(tmp_path))
    fits, over = "seed=" + "1" * (limit - 5), "seed=" + "1" * (limit - 4)
    sweep_job_folders([["experiment=smoke", "seed=1"], ["experiment=smoke", fits]])
    with pytest.raises(ConfigError, match=f"folder name of {limit + 1} bytes"):
        sweep_job_folders([["experiment=smoke", "seed=1"], ["experiment=smoke", over]])
    # numbered folders: the same job fits
    sweep_job_folders([["experiment=smoke", over, "hydra.sweep.subdir=${hydra.job.num}"]])


def test_the_jobs_of_one_choice_of_groups_are_composed_once_and_named_as_hydra_names_them(monkeypatch):
    """seed=N is a value, not a choice of config group: a sweep over seeds composed once per seed (~0.3 s each)."""
    import dit_train.config.command_line as cl

    composed = []
    monkeypatch.setattr(cl, "hydra_config", lambda job, real=cl.hydra_config: composed.append(job) or real(job))
    jobs = [["experiment=smoke", f"seed={s}", "optimizer.lr=0.01"] for s in (1, 2, 3)]
    folders = sweep_job_folders(jobs)
    assert len(composed) == 1
    assert folders == [os.path.join("sweeps/smoke", f"optimizer.lr=0.01,seed={s}") for s in (1, 2, 3)]
