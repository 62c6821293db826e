"""Sharded checkpoints without launching processes: the on-disk rules (only complete folders count, partial ones
are reported), FSDP2 on a group of one (parallel.fsdp=true) equals the plain single process, a sharded
checkpoint resumes into a plain single process, and the parallel.* config checks."""

import json
import logging
import os

import pytest
import torch

from conftest import compose, needs_fashion
from dit_train.runs import checkpoint as ckpt
from dit_train.config import ConfigError, validate
from dit_train.parallel.fsdp import DistInfo, resolve_plan

TINY = ["model.hidden_size=32", "model.depth=2", "model.num_heads=2", "model.patch_size=8",
        "train.steps=4", "train.batch_size=8", "train.warmup_steps=2", "train.log_every=1",
        "train.val_every=2", "train.val_samples=8", "train.val_batch_size=8", "train.val_t_points=2",
        "train.sample_every=0", "train.ckpt_every=2", "train.keep_last=0", "train.progress=false",
        "train.samples_per_class=1", "train.sample_steps=2", "optimizer=adamw"]


def fake_dcp(folder, complete=True):
    os.makedirs(folder, exist_ok=True)
    if complete:
        with open(os.path.join(folder, ckpt.MARKER), "w") as f:
            f.write("{}")


def test_only_complete_checkpoints_are_listed_partial_ones_reported(tmp_path, caplog):
    run_dir = str(tmp_path)
    folder = ckpt.checkpoint_dir(run_dir)
    os.makedirs(folder)
    torch.save({"step": 3}, os.path.join(folder, "step_00000003.pt"))  # an earlier version's file: read-only
    fake_dcp(os.path.join(folder, "step_00000004.dcp"))
    fake_dcp(os.path.join(folder, "step_00000006.dcp"), complete=False)  # renamed but its marker is missing
    fake_dcp(os.path.join(folder, "step_00000005.dcp.tmp"), complete=False)  # a save interrupted mid-write
    with caplog.at_level(logging.WARNING):
        listed = ckpt.list_checkpoints(run_dir, remove_partial=False, legacy=True)
    assert [os.path.basename(p) for p in listed] == ["step_00000003.pt", "step_00000004.dcp"]
    assert [os.path.basename(p) for p in ckpt.list_checkpoints(run_dir, remove_partial=False)] == \
        ["step_00000004.dcp"]  # what training resumes from
    assert "step_00000005.dcp.tmp" in caplog.text and "step_00000006.dcp" in caplog.text
    assert os.path.exists(os.path.join(folder, "step_00000005.dcp.tmp"))  # other ranks never delete
    assert ckpt.resolve_checkpoint(run_dir).endswith("step_00000004.dcp")
    with pytest.raises(FileNotFoundError, match="incomplete"):
        ckpt.resolve_checkpoint(os.path.join(folder, "step_00000006.dcp"))
    ckpt.list_checkpoints(run_dir)  # rank 0 / single process: partial folders removed
    assert not any(".tmp" in f for f in os.listdir(folder))
    ckpt.prune_checkpoints(run_dir, keep_last=1)  # both formats count
    assert [os.path.basename(p) for p in ckpt.list_checkpoints(run_dir, legacy=True)] == ["step_00000004.dcp"]


@pytest.mark.parametrize("left", ["both renames to do", "the second rename to do", "the newer save incomplete"])
def test_a_save_interrupted_while_being_put_in_place_is_finished_not_deleted(tmp_path, left):
    """_publish moves an earlier save of the same step aside (step_N.dcp.old.tmp) and renames the complete
    step_N.dcp.tmp into place: a crash between the two left both `*.tmp` and no step_N.dcp, and the next resume
    deleted both as partial, losing the step. The complete newer save is put in place (the earlier one when the newer
    is incomplete); readers only look; nothing complete is deleted."""
    folder = ckpt.checkpoint_dir(str(tmp_path))
    final = os.path.join(folder, "step_00000004.dcp")
    fake_dcp(os.path.join(folder, "step_00000002.dcp"))
    if left != "the second rename to do":
        fake_dcp(final + ".old.tmp")
        with open(os.path.join(final + ".old.tmp", "which"), "w") as f:
            f.write("earlier")
    fake_dcp(final + ".tmp", complete=left != "the newer save incomplete")
    with open(os.path.join(final + ".tmp", "which"), "w") as f:
        f.write("newer")
    before = sorted(os.listdir(folder))
    assert [os.path.basename(p) for p in ckpt.list_checkpoints(str(tmp_path), remove_partial=False)] == \
        ["step_00000002.dcp"] and sorted(os.listdir(folder)) == before  # a reader changes nothing
    listed = ckpt.list_checkpoints(str(tmp_path))  # rank 0 of a resumed run
    assert [os.path.basename(p) for p in listed] == ["step_00000002.dcp", "step_00000004.dcp"]
    assert sorted(os.listdir(folder)) == ["step_00000002.dcp", "step_00000004.dcp"]
    with open(os.path.join(final, "which")) as f:
        assert f.read() == ("earlier" if left == "the newer save incomplete" else "newer")


def _losses(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}


@needs_fashion
def test_group_of_one_equals_single_process_and_its_checkpoint_resumes_anywhere(tmp_path):
    import torch.distributed as dist

    from dit_train.trainer.loop import run

    plain, sharded = tmp_path / "plain", tmp_path / "sharded"
    run(compose(TINY + [f"run_dir={plain}"]))
    run(compose(TINY + [f"run_dir={sharded}", "parallel.fsdp=true"]))
    assert not dist.is_initialized()  # run() removed the group it made
    assert _losses(sharded) == _losses(plain)  # same weights, same noise, one rank: bit for bit
    folder = ckpt.checkpoint_dir(str(sharded))
    assert sorted(os.listdir(folder)) == ["step_00000002.dcp", "step_00000004.dcp"]

    # sharded checkpoint -> plain single process (no process group at all)
    back = tmp_path / "back"
    run(compose(TINY + [f"run_dir={back}", f"train.resume={os.path.join(folder, 'step_00000002.dcp')}"]))
    assert _losses(back) == {3: _losses(plain)[3], 4: _losses(plain)[4]}

    # resume=auto skips an interrupted save and an incomplete folder, and continues from the newest complete one
    fake_dcp(os.path.join(folder, "step_00000006.dcp.tmp"), complete=False)
    fake_dcp(os.path.join(folder, "step_00000005.dcp"), complete=False)
    run(compose(TINY + [f"run_dir={sharded}", "parallel.fsdp=true", "train.resume=auto", "train.steps=6"]))
    assert sorted(_losses(sharded)) == [1, 2, 3, 4, 5, 6]
    assert "step_00000006.dcp" in os.listdir(folder)


def test_parallel_config_errors_name_key_value_and_choices():
    cpu2 = DistInfo(world_size=2)
    with pytest.raises(ConfigError, match=r"parallel.fsdp=false is not valid with 2 processes"):
        resolve_plan({"fsdp": False}, cpu2)
    with pytest.raises(ConfigError, match=r"parallel.mixed_precision='fp8' is not valid: choose auto"):
        resolve_plan({"mixed_precision": "fp8"}, cpu2)
    with pytest.raises(ConfigError, match=r"parallel.activation_checkpointing='yes'"):
        resolve_plan({"activation_checkpointing": "yes"}, cpu2)
    plan = resolve_plan({"fsdp": "auto"}, cpu2)
    assert plan.sharded and plan.param_dtype == torch.float32  # auto: fp32 on CPU
    assert resolve_plan({"mixed_precision": "auto"}, DistInfo(world_size=2, device=torch.device("cuda", 0))
                        ).param_dtype == torch.bfloat16
    assert not resolve_plan({"fsdp": "auto"}, DistInfo()).sharded
    cfg = compose(["eval.every_n_steps=10", "eval.num_samples=300", "eval.batch_size=100", "run_dir=/tmp/unused",
                   "train.batch_size=96"])
    # 3 generation batches over 2 ranks: the evaluator pads (tests/integration/test_fd_distributed.py)
    validate(cfg, world_size=2)
    validate(cfg, world_size=3)
