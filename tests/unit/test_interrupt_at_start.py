"""Ctrl-C while the command line is checked (seconds: every job composed, checkpoints read) is one line and exit
130, with nothing written; it was a traceback ending in KeyboardInterrupt (found by a new-user trial)."""

import sys

import pytest

import dit_train.__main__ as entry


def test_ctrl_c_during_the_command_line_check_is_one_line_and_exit_130(monkeypatch, capsys, tmp_path):
    def interrupted(argv):
        raise KeyboardInterrupt

    monkeypatch.setattr(entry, "check_command_line", interrupted)
    monkeypatch.setattr(sys, "argv", ["dit-train", f"run_dir={tmp_path / 'run'}"])
    with pytest.raises(SystemExit) as stop:
        entry.cli()
    assert stop.value.code == 130
    assert capsys.readouterr().err == "interrupted before training started; nothing to checkpoint\n"
    assert not (tmp_path / "run").exists()
