"""Sizes in the unit that shows them: a small model's checkpoint line read "(0.00 GB, ...)"."""

import logging

from dit_train.runs import checkpoint as ckpt
from dit_train.runs.checkpoint_saver import CheckpointSaver
from dit_train.telemetry.byte_size import format_bytes


def test_each_size_reads_in_the_largest_unit_that_keeps_it_at_least_one():
    assert format_bytes(0) == "0 B" and format_bytes(999) == "999 B"
    assert format_bytes(1000) == "1.00 KB" and format_bytes(34_500) == "34.50 KB"
    assert format_bytes(5_120_000) == "5.12 MB" and format_bytes(7.6e9) == "7.60 GB" and format_bytes(2e12) == "2.00 TB"


def test_a_tiny_checkpoint_is_logged_in_kilobytes_not_as_zero_gigabytes(tmp_path, monkeypatch, caplog):
    class Written:
        def __init__(self, step):
            self.step, self.final = step, ckpt.checkpoint_path(str(tmp_path), step)

        def finish(self, keep_last):
            return {"ckpt/write_s": 0.5, "ckpt/bytes": 41_600}

    monkeypatch.setattr(ckpt, "start_save", lambda run_dir, step, *args: Written(step))
    saver = CheckpointSaver(str(tmp_path), keep_last=0, asynchronous=False, log_metrics=lambda s, m: None)
    with caplog.at_level(logging.INFO, logger="dit_train"):
        saver.save(3, {}, {"step": 3})
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("saved checkpoint")]
    assert said == [f"saved checkpoint {ckpt.checkpoint_path(str(tmp_path), 3)} (41.60 KB, written in 0.5 s)"]
