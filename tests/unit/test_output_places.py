"""The output places of the sampling commands (dit-sample's --grid and --out-dir, dit-fd's --out) are checked before
a checkpoint is loaded or an image sampled, writing nothing: a file where a folder is expected, or a folder where
the grid PNG goes, is one line naming it, exit 1 (it was a traceback after the sampling)."""

import os
import sys

import pytest
import torch

from dit_train import sample
from dit_train.evaluation.fd import features, job
from dit_train.runs import checkpoint as ckpt


def places(tmp_path):
    (tmp_path / "a_file").write_text("x")
    os.makedirs(tmp_path / "a_folder")
    return tmp_path / "a_file", tmp_path / "a_folder"


@pytest.mark.parametrize("flag, where, says", [
    ("--grid", "a_file/grid.png", "Not a directory (ENOTDIR): '{t}/a_file'"),
    ("--out-dir", "a_file/pngs", "Not a directory (ENOTDIR): '{t}/a_file'"),
    ("--grid", "a_folder", "--grid is a folder, expected a PNG path (EISDIR): '{t}/a_folder'"),
])
def test_a_bad_sample_output_is_one_line_before_the_checkpoint_is_read(tmp_path, capsys, flag, where, says):
    places(tmp_path)
    before = sorted(os.listdir(tmp_path))
    # no_run: were the checkpoint read first, its error would come first
    assert sample.main([str(tmp_path / "no_run"), flag, str(tmp_path / where)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: " + says.format(t=tmp_path)) and err.count("\n") == 1, err
    assert sorted(os.listdir(tmp_path)) == before and os.listdir(tmp_path / "a_folder") == []


def test_a_bad_fd_output_is_one_line_before_the_encoder_loads(tmp_path, capsys, monkeypatch):
    places(tmp_path)
    run_dir = str(tmp_path / "run")
    ckpt.save(run_dir, 1, {"ema": {"w": torch.ones(3)}}, {"step": 1, "config": {}}, keep_last=0)
    monkeypatch.setattr(features, "build_extractor", lambda *a, **k: pytest.fail("the encoder was loaded"))
    monkeypatch.setattr(sys, "argv", ["dit-fd", run_dir, "--out", str(tmp_path / "a_file" / "fd"), "--device", "cpu"])
    assert job.cli() == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: Not a directory (ENOTDIR): '{tmp_path}/a_file'") and err.count("\n") == 1, err
