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


# Ctrl-C while another command reads its arguments: that command's one line (what it left), exit 130. Not here:
# dit-train (above) and dit-torchrun (its own signal handling, torchrun.py).
NOT_HERE = {"dit-train", "dit-torchrun"}  # dit-train: the tests above; dit-torchrun hands Ctrl-C to torchrun


def console_scripts() -> dict:
    import os
    import tomllib

    from conftest import ROOT

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["project"]["scripts"]


@pytest.mark.parametrize("script", sorted(set(console_scripts()) - NOT_HERE))
def test_ctrl_c_in_every_other_command_is_one_line_and_exit_130(script, monkeypatch):
    """dit-encode-latents, dit-sample, dit-export and the memory tools printed a KeyboardInterrupt traceback (found
    by a new-user trial). Ctrl-C arrives here while argparse reads the arguments, inside each command's main."""
    import argparse
    import importlib

    from conftest import run_entry_in_process

    def interrupted(self, *args, **kwargs):
        raise KeyboardInterrupt

    module, name = console_scripts()[script].split(":")
    entry = getattr(importlib.import_module(module), name)
    for read in ("parse_args", "parse_known_args", "parse_intermixed_args"):  # dit-study reads intermixed
        monkeypatch.setattr(argparse.ArgumentParser, read, interrupted)
    try:
        r = run_entry_in_process(entry, prog=script)
    except KeyboardInterrupt:  # not out of the test session: this test's failure
        pytest.fail(f"Ctrl-C escaped {script}: a KeyboardInterrupt traceback")
    assert r.returncode == 130 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith(f"{script}: interrupted"), r.stderr
