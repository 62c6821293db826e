"""Forks (train.init_from): what a fork carries from its parent (model and EMA weights, the EMA's update count),
what it does not (the parent's wandb run name), a requeued fork that no longer needs its parent, and a parent
checkpoint pruned between the fork's choice and its load."""

import shutil

import pytest

from conftest import needs_fashion
from dit_train.parallel.fsdp import DistInfo
from dit_train.runs import checkpoint as ckpt
from dit_train.runs.fork import ForkSourceGone
from dit_train.trainer.loop import Trainer, run
from test_run_folder import cli, tiny, trained, trained_copy  # noqa: F401 - the module's trained run

pytestmark = needs_fashion


def test_a_fork_keeps_the_parents_ema_and_its_update_count(trained, tmp_path):  # noqa: F811
    """The EMA's warm-up decay is min(decay, (1+n)/(10+n)): a fork restarting n at 0 kept after 4 steps only
    ~0.5% of the parent's EMA."""
    parent = trained_copy(trained, tmp_path / "parent")
    source = ckpt.resolve_checkpoint(str(parent))
    fork = Trainer(tiny(tmp_path / "fork", f"train.init_from={parent}"), DistInfo())
    fork.resume()
    ema = ckpt.read_tensors(source, "ema")
    assert fork.ema.num_updates == ckpt.read_train_state(source, ("ema_num_updates",))["ema_num_updates"] == 4
    assert all((v == ema[k]).all() for k, v in fork.ema.model.state_dict().items())


def test_a_requeued_fork_continues_after_its_parent_is_deleted(trained, tmp_path):  # noqa: F811
    parent = trained_copy(trained, tmp_path / "parent")
    command = [f"run_dir={tmp_path / 'fork'}", f"train.init_from={parent}", "train.resume=auto", "train.steps=2"]
    r = cli(tmp_path, *command)
    assert r.returncode == 0, r.stderr
    shutil.rmtree(parent)
    r = cli(tmp_path, *command[:-1], "train.steps=4")
    assert r.returncode == 0, r.stderr
    assert ckpt.read_train_state(ckpt.resolve_checkpoint(str(tmp_path / "fork")))["step"] == 4


def test_a_fork_does_not_take_the_parents_wandb_run_name(trained, tmp_path):  # noqa: F811
    from dit_train.runs.resume_config import continue_saved_config

    parent = tmp_path / "parent"
    run(tiny(parent, "logger.wandb.name=parent_run", "train.steps=2"))
    cfg = continue_saved_config(tiny(tmp_path / "fork", f"train.init_from={parent}"), [f"train.init_from={parent}"])
    assert cfg.logger.wandb.name is None
    resumed = continue_saved_config(tiny(parent, "train.resume=auto"), ["train.resume=auto"])
    assert resumed.logger.wandb.name == "parent_run"  # its own resume keeps it


def test_the_fork_loads_the_checkpoint_chosen_at_its_start(trained, tmp_path, monkeypatch):  # noqa: F811
    parent = trained_copy(trained, tmp_path / "parent")
    chosen = ckpt.resolve_checkpoint(str(parent))
    fork = Trainer(tiny(tmp_path / "fork", f"train.init_from={parent}"), DistInfo())
    shutil.copytree(chosen, chosen.replace("00000004", "00000006"))  # the parent saved again since
    loaded = []
    real = ckpt.load_weights
    monkeypatch.setattr(ckpt, "load_weights", lambda path, *a: (loaded.append(path), real(path, *a)))
    fork.resume()
    assert loaded == [chosen]


def test_a_parent_checkpoint_pruned_before_the_load_is_retried_then_one_line(trained, tmp_path):  # noqa: F811
    parent = trained_copy(trained, tmp_path / "parent")
    fork = Trainer(tiny(tmp_path / "fork", f"train.init_from={parent}"), DistInfo())
    shutil.rmtree(ckpt.resolve_checkpoint(str(parent)))  # pruned by the live parent: step 2 is now its latest
    fork.resume()
    assert fork.ema.num_updates == 2
    fork = Trainer(tiny(tmp_path / "fork2", f"train.init_from={parent}"), DistInfo())
    shutil.rmtree(parent / "checkpoints")
    with pytest.raises(ForkSourceGone) as e:
        fork.resume()
    assert "\n" not in str(e.value) and "step_00000002" in str(e.value)


def test_a_live_parents_save_in_progress_is_said_to_be_being_written(trained, tmp_path, caplog):  # noqa: F811
    from dit_train.runs.lock import RunLock

    parent = trained_copy(trained, tmp_path / "parent")
    (parent / "checkpoints" / "step_00000006.dcp.tmp-1234").mkdir()
    lock = RunLock(str(parent)).acquire()  # the parent is still training
    try:
        with caplog.at_level("WARNING", logger="dit_train"):
            assert ckpt.resolve_checkpoint(str(parent)).endswith("step_00000004.dcp")
    finally:
        lock.release()
    [told] = [r.getMessage() for r in caplog.records if "tmp-1234" in r.getMessage()]
    assert "is being written by the run in" in told and "interrupted" not in told, told


def test_a_parent_gone_before_the_load_is_one_line_and_leaves_no_fork_folder(trained, tmp_path, monkeypatch):  # noqa: F811
    parent = trained_copy(trained, tmp_path / "parent")
    real = ckpt.load_weights

    def parent_pruned_first(path, *a):  # the live parent prunes between the fork's choice and its read
        shutil.rmtree(parent / "checkpoints", ignore_errors=True)
        return real(path, *a)

    monkeypatch.setattr(ckpt, "load_weights", parent_pruned_first)
    r = cli(tmp_path, f"run_dir={tmp_path / 'fork'}", f"train.init_from={parent}")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "was removed before the fork could read it" in r.stderr
    assert not (tmp_path / "fork").exists(), sorted(p.name for p in (tmp_path / "fork").iterdir())


def test_every_rank_forks_from_rank_0s_choice_and_shares_its_refusal(trained, tmp_path, monkeypatch):  # noqa: F811
    """Each rank resolved the parent's newest checkpoint for itself: a parent that saved between two ranks' looks
    had them read their shards from two checkpoints. Rank 1 here never resolves: it takes what rank 0 broadcast,
    a path or a refusal (rank 0's refusal raised alone left the others waiting for a path)."""
    import torch.distributed as dist

    from dit_train.parallel import fsdp
    from dit_train.runs import fork

    parent = trained_copy(trained, tmp_path / "parent")
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda: 1)
    monkeypatch.setattr(ckpt, "resolve_checkpoint", lambda *a: pytest.fail("rank 1 resolved the parent itself"))
    broadcast = []
    monkeypatch.setattr(fsdp, "broadcast_object", lambda obj: (broadcast.append(obj), ("/rank0/step_4.dcp", None))[1])
    assert fork.choose_parent_checkpoint(str(parent)) == "/rank0/step_4.dcp" and broadcast == [None]
    refusal = ckpt.CheckpointError("no checkpoint in /parent")
    monkeypatch.setattr(fsdp, "broadcast_object", lambda obj: (None, refusal))
    with pytest.raises(ckpt.CheckpointError, match="no checkpoint in /parent"):
        fork.choose_parent_checkpoint(str(parent))


def test_every_rank_takes_rank_0s_word_on_whether_the_source_was_pruned(trained, tmp_path, monkeypatch):  # noqa: F811
    """After a failed read each rank asked is_complete for itself: a parent pruning at that moment could have one
    rank raise "damaged" while the others waited in the next choice's broadcast for the collective timeout. Rank 1
    here never looks: it takes rank 0's word (gone), chooses again with the others and loads the newest."""
    import torch.distributed as dist

    from dit_train.parallel import fsdp
    from dit_train.runs import fork

    parent = trained_copy(trained, tmp_path / "parent")
    newest = ckpt.resolve_checkpoint(str(parent))
    fork_ = Trainer(tiny(tmp_path / "fork", f"train.init_from={parent}"), DistInfo())
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda: 1)
    real_complete = ckpt.is_complete
    monkeypatch.setattr(ckpt, "is_complete", lambda path: pytest.fail("rank 1 judged the source itself")
                        if path == "/pruned/step_2.dcp" else real_complete(path))
    said = iter([True, (newest, None)])  # rank 0: the source is gone; then its new choice
    monkeypatch.setattr(fsdp, "broadcast_object", lambda obj: next(said))
    tried = []

    def first_read_fails(path, *a):  # DCP raises a rank's read error on every rank
        tried.append(path)
        if len(tried) == 1:
            raise ckpt.CheckpointError("a shard vanished")

    monkeypatch.setattr(ckpt, "load_weights", first_read_fails)
    assert fork.load_fork(str(parent), "/pruned/step_2.dcp", fork_.model, fork_.ema.model) == (newest, 4)
    assert tried == ["/pruned/step_2.dcp", newest]
