"""wandb: one wandb run per run folder across a preemption and resume, grouped by study, tagged with what it
trains, its summary pushed; offline (no login, no network)."""

import glob
import json
import os
import re
import time

import pytest
from omegaconf import OmegaConf

from conftest import needs_fashion, run_cli_in_process, stop_signal_during_step
from dit_train.parallel.fsdp import DistInfo
from dit_train.trainer.preemption import Preempted
from dit_train.trainer.loop import Trainer
from dit_train.telemetry.wandb_run import RECORD, name_from_overrides, tags


@needs_fashion
def test_preempted_and_resumed_run_is_one_wandb_run(tiny_cfg, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")  # the dataset id below must come from the summary, not stdout
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    OmegaConf.set_struct(tiny_cfg, False)
    tiny_cfg.study = {"name": "group_of_this_study"}
    tiny_cfg.logger.wandb.mode = "offline"
    tiny_cfg.train.ckpt_every = 0
    first = Trainer(tiny_cfg, DistInfo())
    stop_signal_during_step(first, 3)
    with pytest.raises(Preempted):
        first.fit()
    tiny_cfg.train.resume = "auto"
    Trainer(tiny_cfg, DistInfo()).fit()

    record = json.load(open(os.path.join(tiny_cfg.run_dir, RECORD)))
    folders = sorted(glob.glob(os.path.join(tiny_cfg.run_dir, "wandb", "offline-run-*")))
    assert folders  # one per process start (two, unless both started within one second): one id, one wandb run
    # offline-run-<date>_<time>-<id>, and wandb appends -1, -2 ... when two starts fall in the same second
    ids = {re.match(r"offline-run-\d{8}_\d{6}-([^-]+)", os.path.basename(f)).group(1) for f in folders}
    assert ids == {record["id"]}  # `wandb sync` merges them by id
    assert record["name"] == "run"  # outside a Hydra job: the run folder's name
    wanted = (b"group_of_this_study", b"optimizer=adamw", b"model=dit_s", b"lr=0.002", b"fashion_mnist:train:32px")
    # wandb's own service process writes the .wandb file and may still be flushing after finish() returns (seen
    # once under CI load: the file held only its header), so read it until everything is there or 30 s pass
    deadline = time.monotonic() + 30
    while True:
        log = open(glob.glob(os.path.join(folders[-1], "*.wandb"))[0], "rb").read()
        if all(expected in log for expected in wanted) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    for expected in wanted:
        assert expected in log, expected  # group, tags, and summary.json's keys in the run's summary


def test_run_name_leaves_out_where_and_how_a_run_executes():
    assert name_from_overrides("model=dit_s,optimizer=muon,run_dir=runs/x,train.resume=auto") == \
        "model=dit_s,optimizer=muon"
    assert name_from_overrides("") == ""


def test_tags_name_model_optimizer_k_and_lr():
    config = {"model": {"name": "dit_xs"}, "optimizer": {"name": "periodic_rowwise", "K": 3, "lr": 0.008}}
    assert tags(config) == ["model=dit_xs", "optimizer=periodic_rowwise", "K=3", "lr=0.008"]


@pytest.mark.parametrize("record,expected", [
    ("{}", "has no 'id', 'name' (it should hold id, name)"),
    ('{"id": "team/abc", "name": "x"}', "id 'team/abc' is not a valid wandb run id"),
    ('{"id": "ab', "is not valid JSON"),
])
def test_a_damaged_wandb_record_is_one_line_naming_it_before_anything_is_written(tmp_path, record, expected,
                                                                                  monkeypatch):
    """wandb_run.json `{}` was a KeyError traceback, an id with '/' wandb's own error after the run folder was
    written; now both are refused by the command in one line naming the file, exit 2. The command runs in this
    process (conftest.run_cli_in_process): the refusal is what it says, not what only a new process shows."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / RECORD).write_text(record)
    monkeypatch.setenv("WANDB_MODE", "offline")
    r = run_cli_in_process(f"run_dir={run_dir}", "logger.wandb.mode=offline", "model.hidden_size=32",
                           "model.depth=1", "model.num_heads=1", "model.patch_size=8", "train.steps=2",
                           "train.batch_size=4", cwd=str(tmp_path))
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert lines[0].startswith(f"error: {run_dir / RECORD}") and expected in lines[0], lines[0]
    # nothing of the run written (Hydra's own files stay, as in any folder that existed before)
    assert set(os.listdir(run_dir)) <= {RECORD, ".hydra", "dit_train.log"}
