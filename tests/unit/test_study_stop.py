"""dit-study stops when a group's trainer stops on a signal, instead of starting the next group's runs."""

import signal

import pytest

from dit_train.study import run as study_run
from dit_train.trainer.preemption import EXIT_INTERRUPTED, EXIT_PREEMPTED

GROUPS = [dict(name=f"optimizer={o},seed=0", model="dit_xs", optimizer=o, K=None, scale=None, lr=None, seed=0,
               overrides=[f"optimizer={o}", "seed=0"]) for o in ("adamw", "muon")]


class Args:
    config_dir = None
    experiment = "mine"
    overrides: list = []
    records = None
    dry_run = False


def start_groups(monkeypatch, tmp_path, code: int):
    """run_groups over two groups whose trainer exits `code`: (the groups started, failures or the StudyStopped)."""
    started = []

    def fake_trainer(cmd):
        started.append(next(a for a in cmd if a.startswith("optimizer=")))
        return code

    monkeypatch.setattr(study_run, "run_trainer", fake_trainer)
    monkeypatch.setattr(study_run, "done", lambda *a: False)
    try:
        return started, study_run.run_groups(GROUPS, None, str(tmp_path), lambda r: 10, Args())
    except study_run.StudyStopped as stopped:
        return started, stopped


@pytest.mark.parametrize("code,exit_code", [(EXIT_PREEMPTED, 75), (EXIT_INTERRUPTED, 130), (-signal.SIGKILL, 137)])
def test_a_trainer_stopped_by_a_signal_stops_the_study_before_the_next_group(monkeypatch, tmp_path, code,
                                                                              exit_code):
    started, stopped = start_groups(monkeypatch, tmp_path, code)
    assert started == ["optimizer=adamw"]
    assert isinstance(stopped, study_run.StudyStopped) and stopped.exit_code == exit_code
    assert "rerun the same command" in str(stopped)


def test_a_failed_group_does_not_stop_the_study(monkeypatch, tmp_path):
    started, failures = start_groups(monkeypatch, tmp_path, 1)
    assert started == ["optimizer=adamw", "optimizer=muon"] and failures == [1, 1]  # each failed group's exit code
