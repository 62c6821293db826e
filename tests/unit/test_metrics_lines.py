"""metrics.jsonl from elsewhere is read with bounded memory: the reports and the resume's timeline refuse a file
larger than any run writes in one line, pass over lines longer than any row, and never block on a FIFO."""

import json
import os

import pytest

from dit_train.runs.timeline import set_aside_after
from dit_train.study import report
from dit_train.telemetry import metrics_lines as lines_module
from dit_train.telemetry.metrics_lines import metrics_lines


def row(step: int) -> bytes:
    return (json.dumps({"step": step, "train/loss": 1.0 / step}) + "\n").encode()


def test_a_sparse_file_larger_than_any_run_writes_is_refused_naming_its_size(tmp_path):
    path = tmp_path / "metrics.jsonl"
    with open(path, "wb") as f:
        f.truncate(lines_module.MAX_FILE_BYTES + 1)  # sparse: no disk used, no newline in 8 GiB of zeros
    with pytest.raises(ValueError, match=r"metrics.jsonl is 8.59 GB, more than any run writes .* not read"):
        report.read_metrics(str(path))
    with pytest.raises(ValueError, match="8.59 GB"):  # the resume refuses before it moves anything
        set_aside_after(str(tmp_path), 1, "checkpoints/step_1")
    assert sorted(os.listdir(tmp_path)) == ["metrics.jsonl"]


def test_a_line_longer_than_any_row_is_passed_over_in_chunks(tmp_path, monkeypatch):
    monkeypatch.setattr(lines_module, "MAX_ROW_BYTES", 64)
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(row(1) + b"x" * 1000 + b"\n" + row(2) + b"y" * 500)  # the last: overlong and torn
    assert list(metrics_lines(str(path))) == [row(1), row(2)]
    assert [r["step"] for r in report.read_metrics(str(path))] == [1, 2]
    read_sizes = []  # the reader never takes more than one row's bound at a time (`for line in f` took 1000)
    real_fdopen = lines_module.os.fdopen

    def counting_fdopen(fd, mode):
        f = real_fdopen(fd, mode)
        readline = f.readline
        f.readline = lambda limit: read_sizes.append(len(line := readline(limit))) or line
        return f

    monkeypatch.setattr(lines_module.os, "fdopen", counting_fdopen)
    list(metrics_lines(str(path)))
    assert read_sizes and max(read_sizes) <= 65


def test_the_timeline_keeps_rows_and_moves_later_ones_past_an_overlong_line(tmp_path, monkeypatch):
    monkeypatch.setattr(lines_module, "MAX_ROW_BYTES", 64)
    (tmp_path / "metrics.jsonl").write_bytes(row(1) + b"z" * 300 + b"\n" + row(2) + row(3))
    moved = set_aside_after(str(tmp_path), 2, "checkpoints/step_2")
    assert "steps 3-3 (1 rows)" in moved
    assert (tmp_path / "metrics.jsonl").read_bytes() == row(1) + row(2)


def test_a_fifo_is_refused_without_blocking(tmp_path):
    path = tmp_path / "metrics.jsonl"
    os.mkfifo(path)
    with pytest.raises(ValueError, match="not a regular file"):
        report.read_metrics(str(path))
