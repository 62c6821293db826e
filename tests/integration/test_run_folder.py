"""Run-folder integrity: a resume that would silently change the experiment is refused before anything is written;
one writer per folder; summaries that tell the truth; clean one-line failures; non-finite weights never saved."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import FASHION_ROOT, ROOT, compose, needs_fashion, run_cli_in_process, stop_signal_during_step
from dit_train.runs import checkpoint as ckpt
from dit_train.config import ConfigError
from dit_train.parallel.fsdp import DistInfo
from dit_train.trainer.preemption import EXIT_INTERRUPTED, EXIT_PREEMPTED, Preempted
from dit_train.runs.folder import prepare_run_folder
from dit_train.runs.lock import EXIT_RUN_FOLDER_BUSY, RunFolderBusy, RunLock
from dit_train.trainer.loop import Trainer, TrainingStopped, run

pytestmark = needs_fashion

TINY = ["model.hidden_size=32", "model.depth=1", "model.num_heads=1", "model.patch_size=8",
        "train.batch_size=4", "train.val_samples=4", "train.val_batch_size=4", "train.val_t_points=1",
        "train.sample_every=0", "train.samples_per_class=1", "train.sample_steps=1", "train.progress=false",
        "train.warmup_steps=0", "train.log_every=1", "train.ckpt_every=2", "train.steps=4",
        "optimizer=periodic_rowwise"]


def tiny(run_dir, *extra):
    return compose(TINY + [f"run_dir={run_dir}", *extra])


def read(path):
    with open(path, "rb") as f:
        return f.read()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """`run(tiny(...))` trained once for the module (4 steps, checkpoints at 2 and 4): the tests that start from
    such a finished run take a copy of it (trained_copy), as each trained its own before."""
    folder = tmp_path_factory.mktemp("trained") / "run"
    run(tiny(folder))
    return folder


def trained_copy(trained, dest):
    """A copy of the module's trained run at `dest` (a test may change or continue it: the next test's copy is
    untouched)."""
    shutil.copytree(trained, dest, symlinks=True)
    return dest


# ---- resume compatibility ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("change, named", [
    (["optimizer.K=5"], "optimizer.K: 3 -> 5"),
    (["optimizer.lr=0.01"], "optimizer.lr: 0.002 -> 0.01"),
    (["optimizer=rownorm"], 'optimizer.name: "periodic_rowwise" -> "rownorm"'),
    (["train.batch_size=8"], "train.batch_size: 4 -> 8"),
    (["model.hidden_size=64"], "model.hidden_size: 32 -> 64"),
    # FSDP's compute and reduction dtypes change the losses as train.precision does
    (["parallel.mixed_precision=bf16"], 'parallel.mixed_precision: "auto" -> "bf16"'),
    (["parallel.reduce_dtype=bf16"], 'parallel.reduce_dtype: "fp32" -> "bf16"'),
])
def test_resume_with_a_changed_experiment_is_refused_before_anything_is_written(trained, tmp_path, change, named):
    trained_copy(trained, tmp_path / "run")
    before = {f: read(tmp_path / "run" / f) for f in ("config.yaml", "run_info.json", "summary.json")}
    with pytest.raises(ConfigError, match="cannot change on resume") as e:
        run(tiny(tmp_path / "run", "train.resume=auto", "train.steps=6", *change))
    assert named in str(e.value) and "train.init_from" in str(e.value) and "\n" not in str(e.value)
    assert {f: read(tmp_path / "run" / f) for f in before} == before  # provenance untouched


def test_a_swapped_optimizer_is_named_first_and_stands_for_the_keys_that_follow_from_it(trained, tmp_path):
    """periodic_rowwise -> adamw changes a dozen optimizer keys (K, momentum, ... absent); the line names the swap
    first and counts those, so that it still shows at once what changed (and any other change beside it)."""
    trained_copy(trained, tmp_path / "run")
    with pytest.raises(ConfigError, match="cannot change on resume") as e:
        run(tiny(tmp_path / "run", "train.resume=auto", "optimizer=adamw", "train.batch_size=8"))
    changes = str(e.value).split("another config (", 1)[1].split("); these keys", 1)[0]
    assert re.fullmatch(r'optimizer\.name: "periodic_rowwise" -> "adamw" \(and \d+ other keys of optimizer\); '
                        r'train\.batch_size: 4 -> 8', changes), changes


def fashion_copy(folder, train=None, val=None):
    """The Fashion-MNIST idx files in `folder`: all of them, or the first `train` / `val` images of each split."""
    import gzip
    import struct

    from dit_train.data.fashion_mnist import FILES, read_idx

    os.makedirs(folder)
    for split, n in (("train", train), ("val", val)):
        for stem in FILES[split]:
            if n is None:  # the files as they are: recompressing 47 MB at gzip's default level took ~15 s of CPU
                shutil.copy(os.path.join(FASHION_ROOT, stem + ".gz"), folder)
                continue
            data = read_idx(os.path.join(FASHION_ROOT, stem + ".gz"))[:n]
            header = bytes([0, 0, 8, data.ndim]) + struct.pack(">" + "I" * data.ndim, *data.shape)
            with gzip.open(os.path.join(folder, stem + ".gz"), "wb", compresslevel=1) as f:
                f.write(header + data.tobytes())


def test_resume_follows_the_data_not_its_path(tmp_path, caplog):
    """data.root may move (the same data resumes) but not change: another data set behind the same or another path
    is refused in one line naming both fingerprints, before anything is written."""
    fashion_copy(tmp_path / "data")
    run(tiny(tmp_path / "run", f"data.root={tmp_path / 'data'}"))
    os.rename(tmp_path / "data", tmp_path / "moved")
    with caplog.at_level("INFO", logger="dit_train"):
        out = run(tiny(tmp_path / "run", f"data.root={tmp_path / 'moved'}", "train.resume=auto", "train.steps=6"))
    assert out["steps"] == 6 and any("the same data" in r.getMessage() for r in caplog.records)

    fashion_copy(tmp_path / "small", train=1000, val=100)
    before = {f: read(tmp_path / "run" / f) for f in ("config.yaml", "run_info.json", "summary.json", "metrics.jsonl")}
    for root in ("small", "moved"):  # another folder; the run's own folder with its content replaced
        if root == "moved":
            os.rename(tmp_path / "moved", tmp_path / "full")
            os.rename(tmp_path / "small", tmp_path / "moved")
        with pytest.raises(ConfigError, match=r"^train.resume=auto: data.root=\S+ holds other data than \S+ was "
                                              r"trained on") as e:
            run(tiny(tmp_path / "run", f"data.root={tmp_path / root}", "train.resume=auto", "train.steps=8"))
        message = str(e.value)
        assert "1000 train + 100 val items" in message and "60000 train + 10000 val items" in message, message
        assert ("it was trained from data.root=" in message) == (root == "small") and "\n" not in message
        assert {f: read(tmp_path / "run" / f) for f in before} == before


def test_resume_may_change_length_cadence_and_paths(trained, tmp_path):
    trained_copy(trained, tmp_path / "run")
    out = run(tiny(tmp_path / "run", "train.resume=auto", "train.steps=6", "train.log_every=2",
                   "train.ckpt_every=3", "train.keep_last=1"))
    assert out["steps"] == 6


def test_fork_starts_from_the_weights_with_a_fresh_optimizer(trained, tmp_path):
    trained_copy(trained, tmp_path / "source")
    fork = Trainer(tiny(tmp_path / "fork", f"train.init_from={tmp_path / 'source'}", "optimizer.K=5"), DistInfo())
    fork.resume()
    source = ckpt.read_tensors(ckpt.resolve_checkpoint(str(tmp_path / "source")), "model")
    assert fork.state.step == 0 and not fork.optimizer.state
    assert all(torch.equal(v, source[k]) for k, v in fork.model.state_dict().items())
    # the parent's EMA and its count: the decay ramp goes on, it does not restart and wash the average out
    parent = ckpt.read_train_state(ckpt.resolve_checkpoint(str(tmp_path / "source")), ("ema_num_updates",))
    assert fork.ema.num_updates == parent["ema_num_updates"] > 0
    ema = ckpt.read_tensors(ckpt.resolve_checkpoint(str(tmp_path / "source")), "ema")
    assert all(torch.equal(v, ema[k]) for k, v in fork.ema.model.state_dict().items())


# ---- one timeline -----------------------------------------------------------------------------------------------
def train_row_steps(run_dir):
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if "train/loss" in json.loads(line)]


def test_a_resume_from_an_earlier_checkpoint_owns_the_run_and_sets_the_abandoned_steps_aside(tmp_path, caplog):
    """15 steps (keep_last=3), an explicit resume from step 5, preempted at 7: the abandoned steps 6-15
    (checkpoints, metrics rows, summary) are moved aside, not deleted; step_5 is not pruned; resume=auto then
    continues the branch from 7 to 15 and writes its summary, and metrics.jsonl reads 1..15 once."""
    run_dir = tmp_path / "run"
    long = ["train.steps=15", "train.ckpt_every=5", "train.keep_last=3"]
    run(tiny(run_dir, *long))
    rows = (run_dir / "metrics.jsonl").read_text().splitlines(keepends=True)
    summary = read(run_dir / "summary.json")
    step_5 = ckpt.checkpoint_path(str(run_dir), 5)

    cfg = tiny(run_dir, *long, f"train.resume={step_5}")
    with caplog.at_level("WARNING", logger="dit_train"):
        lock = prepare_run_folder(cfg, DistInfo())
    try:
        trainer = Trainer(cfg, DistInfo())
        stop_signal_during_step(trainer, 7)
        with pytest.raises(Preempted, match="step 7"):
            trainer.fit()
    finally:
        lock.release()
    assert [os.path.basename(p) for p in ckpt.list_checkpoints(str(run_dir))] == \
        ["step_00000005.dcp", "step_00000007.dcp"]
    [aside] = [run_dir / "abandoned" / d for d in os.listdir(run_dir / "abandoned")]
    assert aside.name.endswith("-after-step-5") and (aside / "ABANDONED.txt").exists()
    assert sorted(os.listdir(aside / "checkpoints")) == ["step_00000010.dcp", "step_00000015.dcp"]
    assert ckpt.read_train_state(str(aside / "checkpoints" / "step_00000015.dcp"))["step"] == 15
    assert read(aside / "summary.json") == summary
    assert (aside / "metrics.jsonl").read_text().splitlines(keepends=True) == \
        [r for r in rows if json.loads(r)["step"] > 5]
    assert train_row_steps(run_dir) == list(range(1, 8))
    told = [r.getMessage() for r in caplog.records if "moved aside" in r.getMessage()]
    assert len(told) == 1 and str(aside) in told[0] and "step_00000010.dcp, step_00000015.dcp" in told[0]
    assert "metrics.jsonl rows of steps 6-15" in told[0] and "summary.json (steps 15)" in told[0]

    out = run(tiny(run_dir, *long, "train.resume=auto"))  # the branch, not the abandoned step 15
    assert out["steps"] == 15 and json.load(open(run_dir / "summary.json"))["steps"] == 15
    assert train_row_steps(run_dir) == list(range(1, 16))
    assert [os.path.basename(p) for p in ckpt.list_checkpoints(str(run_dir))] == \
        ["step_00000007.dcp", "step_00000010.dcp", "step_00000015.dcp"]
    assert os.listdir(run_dir / "abandoned") == [aside.name]  # nothing after 7 to set aside this time


def test_a_resume_that_falls_back_past_a_damaged_checkpoint_sets_that_timeline_aside(trained, tmp_path, caplog):
    """resume=auto skips a checkpoint whose tensors cannot be read and continues from the one before: a branch too.
    The damaged checkpoint is kept (moved aside, not overwritten by the branch's save of the same step) and
    metrics.jsonl reads each step once."""
    run_dir = tmp_path / "run"
    trained_copy(trained, run_dir)
    newest = ckpt.checkpoint_path(str(run_dir), 4)
    for name in os.listdir(newest):
        if name.endswith(".distcp"):
            open(os.path.join(newest, name), "wb").close()  # truncated: its tensors are gone
    with caplog.at_level("WARNING", logger="dit_train"):
        out = run(tiny(run_dir, "train.resume=auto", "train.steps=6"))
    assert out["steps"] == 6 and any("is unreadable" in r.getMessage() for r in caplog.records)
    [aside] = [run_dir / "abandoned" / d for d in os.listdir(run_dir / "abandoned")]
    assert aside.name.endswith("-after-step-2") and os.listdir(aside / "checkpoints") == ["step_00000004.dcp"]
    assert any(os.path.getsize(aside / "checkpoints" / "step_00000004.dcp" / f) == 0
               for f in os.listdir(aside / "checkpoints" / "step_00000004.dcp"))  # the damaged one itself
    assert json.load(open(aside / "summary.json"))["steps"] == 4
    assert train_row_steps(run_dir) == list(range(1, 7))
    assert [json.loads(r)["step"] for r in (aside / "metrics.jsonl").read_text().splitlines()][0] == 3


def test_setting_aside_keeps_torn_rows_and_moves_what_it_cannot_read(tmp_path):
    """What a crash can leave: rows logged past the last checkpoint, a torn last row, a save without its marker, an
    unreadable summary. Everything after the step is moved (none of it deleted), the rest stays where it was."""
    from dit_train.runs.timeline import set_aside_after

    run_dir = tmp_path / "run"
    os.makedirs(run_dir / "checkpoints" / "step_00000020.dcp")  # no COMPLETE marker: moved all the same
    os.makedirs(run_dir / "checkpoints" / "step_00000012.dcp")
    os.makedirs(run_dir / "samples")
    for name in ("step_00000012.png", "fd_step_00000010.png", "step_00000020.png"):
        (run_dir / "samples" / name).write_bytes(name.encode())
    rows = [json.dumps({"step": s, "train/loss": 1.0}) + "\n" for s in range(1, 16)]
    (run_dir / "metrics.jsonl").write_text("".join(rows) + '{"step": 16, "train/lo')
    (run_dir / "summary.json").write_text('{"steps": 2')
    told = set_aside_after(str(run_dir), 12, "somewhere/step_00000012.dcp")
    [aside] = [run_dir / "abandoned" / d for d in os.listdir(run_dir / "abandoned")]
    assert (run_dir / "metrics.jsonl").read_text() == "".join(rows[:12]) + '{"step": 16, "train/lo'
    assert (aside / "metrics.jsonl").read_text() == "".join(rows[12:])
    assert (aside / "summary.json").read_text() == '{"steps": 2' and not (run_dir / "summary.json").exists()
    assert os.listdir(aside / "checkpoints") == ["step_00000020.dcp"]
    assert os.listdir(run_dir / "checkpoints") == ["step_00000012.dcp"]
    assert os.listdir(aside / "samples") == ["step_00000020.png"]
    assert sorted(os.listdir(run_dir / "samples")) == ["fd_step_00000010.png", "step_00000012.png"]
    assert "metrics.jsonl rows of steps 13-15 (3 rows)" in told and "summary.json (unreadable)" in told
    assert set_aside_after(str(run_dir), 12, "somewhere/step_00000012.dcp") is None  # nothing left after 12


def test_resume_auto_without_a_checkpoint_says_it_starts_a_new_run(tmp_path, caplog):
    """train.resume=auto in a folder without checkpoints starts there (a requeued job's first start), but says so:
    a misspelled run_dir silently trained a new run (found by a new-user trial). resume=null says nothing."""
    for resume, expected in (("auto", [f"train.resume=auto: no checkpoint in {tmp_path / 'typo' / 'checkpoints'}; "
                                       f"starting a new run there"]), ("null", [])):
        caplog.clear()
        with caplog.at_level("INFO", logger="dit_train"):
            lock = prepare_run_folder(tiny(tmp_path / "typo", f"train.resume={resume}"), DistInfo())
        lock.release()
        assert [r.getMessage() for r in caplog.records if "no checkpoint" in r.getMessage()] == expected


@pytest.mark.parametrize("resume", ["auto", "null"])
def test_a_new_start_in_a_folder_without_checkpoints_sets_the_earlier_records_aside(trained, tmp_path, caplog,
                                                                                    resume):
    """A first attempt that died before its first checkpoint, requeued (resume=auto), or a run_dir used again: the
    new run appended to the earlier metrics.jsonl (dit-report then read the other run's last rows). They go aside."""
    run_dir = trained_copy(trained, tmp_path / "run")
    shutil.rmtree(run_dir / "checkpoints")
    earlier = (run_dir / "metrics.jsonl").read_text()
    with caplog.at_level("WARNING", logger="dit_train"):
        run(tiny(run_dir, "train.steps=2", f"train.resume={resume}"))
    [aside] = [run_dir / "abandoned" / d for d in os.listdir(run_dir / "abandoned")]
    assert aside.name.endswith("-before-a-new-start")
    assert (aside / "metrics.jsonl").read_text() == earlier
    assert json.load(open(aside / "summary.json"))["steps"] == 4
    assert train_row_steps(run_dir) == [1, 2] and json.load(open(run_dir / "summary.json"))["steps"] == 2
    [told] = [r.getMessage() for r in caplog.records if "moved aside" in r.getMessage()]
    assert "earlier attempt's records" in told and "metrics.jsonl rows of steps 1-4" in told, told


def test_a_requeued_fork_continues_from_its_own_checkpoints(trained, tmp_path):
    """train.init_from + train.resume=auto: the first start forks; a requeue (the same command) continues the
    fork's own newest checkpoint, not the source again."""
    trained_copy(trained, tmp_path / "source")
    command = [f"train.init_from={tmp_path / 'source'}", "train.resume=auto", "optimizer.K=5"]
    first = Trainer(tiny(tmp_path / "fork", *command), DistInfo())
    stop_signal_during_step(first, 3)
    with pytest.raises(Preempted, match="at step 3"):
        first.fit()
    own = ckpt.read_tensors(ckpt.resolve_checkpoint(str(tmp_path / "fork")), "model")
    requeued = Trainer(tiny(tmp_path / "fork", *command), DistInfo())
    requeued.resume()
    assert requeued.state.step == 3 and requeued.optimizer.state
    assert all(torch.equal(v, own[k]) for k, v in requeued.model.state_dict().items())
    assert run(tiny(tmp_path / "fork", *command))["steps"] == 4


def test_a_fork_into_another_model_size_is_one_line_and_leaves_no_folder(trained, tmp_path):
    trained_copy(trained, tmp_path / "source")
    r = cli(tmp_path, f"run_dir={tmp_path / 'fork'}", f"train.init_from={tmp_path / 'source'}", "model.hidden_size=64")
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert "holds a model of another architecture (hidden_size: 32 -> 64)" in lines[0]
    assert "model.hidden_size=32" not in lines[0] and "model=dit_s" in lines[0]
    assert not os.path.exists(tmp_path / "fork")


# ---- one writer -------------------------------------------------------------------------------------------------
def test_a_second_writer_is_refused_naming_the_holder(tmp_path):
    os.makedirs(tmp_path / "run")
    holder = RunLock(str(tmp_path / "run")).acquire()
    try:
        with pytest.raises(RunFolderBusy, match=f"in use by .* pid {os.getpid()}"):
            run(tiny(tmp_path / "run"))
        assert not os.path.exists(tmp_path / "run" / "run_info.json")  # nothing written by the refused one
    finally:
        holder.release()
    run(tiny(tmp_path / "run"))  # released: the folder is usable again


def test_a_refused_command_leaves_the_run_folders_hydra_record_untouched(tmp_path):
    """`.hydra/` of an explicit run folder records the command that made (or last resumed) the run: a resume refused
    by the config check, or a writer refused by the lock, must not overwrite it with the refused command."""
    run_dir = tmp_path / "run"
    first = cli(tmp_path, f"run_dir={run_dir}")
    assert first.returncode == 0, first.stderr[-2000:]
    record = {f: read(run_dir / ".hydra" / f) for f in ("config.yaml", "overrides.yaml", "hydra.yaml")}
    assert b"model.depth=1" in record["overrides.yaml"] and b"train.resume" not in record["overrides.yaml"]

    refused = cli(tmp_path, f"run_dir={run_dir}", "train.resume=auto", "model.depth=2")
    assert refused.returncode == 2 and refused.stderr.startswith("error: train.resume=auto: "), refused.stderr
    assert "model.depth: 1 -> 2" in refused.stderr and refused.stderr.strip().count("\n") == 0
    assert {f: read(run_dir / ".hydra" / f) for f in record} == record

    holder = RunLock(str(run_dir)).acquire()
    try:
        busy = cli(tmp_path, f"run_dir={run_dir}", "train.resume=auto", "train.steps=6")
    finally:
        holder.release()
    # not exit 2 (a bad command, which dit-study reports as not fixed by rerunning): the same command works later
    assert busy.returncode == EXIT_RUN_FOLDER_BUSY == 73 and "is in use by" in busy.stderr, busy.stderr
    assert {f: read(run_dir / ".hydra" / f) for f in record} == record

    resumed = cli(tmp_path, f"run_dir={run_dir}", "train.resume=auto", "train.steps=6")  # accepted: recorded
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert b"train.resume=auto" in read(run_dir / ".hydra" / "overrides.yaml")
    assert b"run:\n    dir: " + str(run_dir).encode() in read(run_dir / ".hydra" / "hydra.yaml")


def test_default_run_folders_differ_for_jobs_started_in_the_same_second():
    # names.py alone, loaded by its path (importing the package imports torch: ~3 s a process), in two processes
    code = ("import importlib.util as u; s = u.spec_from_file_location('names', 'dit_train/runs/names.py'); "
            "m = u.module_from_spec(s); s.loader.exec_module(m); print(m.run_suffix())")
    env = {**os.environ, "PYTHONPATH": ROOT, "SLURM_ARRAY_JOB_ID": "77", "SLURM_ARRAY_TASK_ID": "3"}
    names = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT,
                            check=True).stdout.strip() for _ in range(2)]
    assert names[0] != names[1] and all(n.startswith("j77_3-") for n in names)


# ---- summaries --------------------------------------------------------------------------------------------------
def test_rerunning_a_finished_run_leaves_its_summary(trained, tmp_path, capsys):
    trained_copy(trained, tmp_path / "run")
    summary = read(tmp_path / "run" / "summary.json")
    again = run(tiny(tmp_path / "run", "train.resume=auto"))
    assert read(tmp_path / "run" / "summary.json") == summary and again["steps"] == 4
    assert "already finished at step 4" in capsys.readouterr().out


def test_an_extended_run_that_is_preempted_has_no_summary(trained, tmp_path):
    trained_copy(trained, tmp_path / "run")
    trainer = Trainer(tiny(tmp_path / "run", "train.resume=auto", "train.steps=8"), DistInfo())
    stop_signal_during_step(trainer, 6)
    with pytest.raises(Preempted, match="step 6"):
        trainer.fit()
    assert not os.path.exists(tmp_path / "run" / "summary.json")


# ---- clean failures ---------------------------------------------------------------------------------------------
def test_non_finite_weights_are_never_saved(tmp_path):
    trainer = Trainer(tiny(tmp_path / "run"), DistInfo())
    trainer.state.step = 2
    trainer.save()
    with torch.no_grad():
        trainer.model.final_layer.linear.weight[0, 0] = float("inf")
    trainer.state.step = 4
    with pytest.raises(TrainingStopped, match=r"step 4: the weights are no longer finite.*step_00000002\.dcp"):
        trainer.save()
    assert [os.path.basename(p) for p in ckpt.list_checkpoints(str(tmp_path / "run"))] == ["step_00000002.dcp"]


def test_a_failed_write_leaves_no_temp_file(tmp_path, monkeypatch):
    from dit_train.runs import atomic_io

    def full_disk(data, path):
        with open(path, "wb") as f:
            f.write(data[:3])
        raise OSError(28, "No space left on device", path)

    monkeypatch.setattr(atomic_io, "write_synced", full_disk)
    with pytest.raises(OSError, match="No space left"):
        atomic_io.atomic_write_bytes(b"payload", str(tmp_path / "summary.json"))
    assert os.listdir(tmp_path) == []
    monkeypatch.setattr(ckpt, "write_synced", full_disk)
    with pytest.raises(OSError, match="No space left"):
        ckpt.save(str(tmp_path / "run"), 1, {"model": {"w": torch.ones(2)}}, {"step": 1}, keep_last=0)
    assert os.listdir(tmp_path / "run" / "checkpoints") == []  # the partial checkpoint folder is gone


def cli(tmp_path, *args, timeout=120, flags=()):
    """`python -m dit_train` by tmp_path, in this process (conftest.run_cli_in_process): these tests are about what
    the command checks and writes; the exit codes of signals are tested on real processes (start() below)."""
    return run_cli_in_process(*flags, *TINY, *args, cwd=str(tmp_path), timeout=timeout)


def test_an_unwritable_run_dir_is_one_line(tmp_path):
    (tmp_path / "a_file").write_text("x")
    r = cli(tmp_path, f"run_dir={tmp_path / 'a_file' / 'run'}")
    assert r.returncode == 1 and r.stderr.strip().count("\n") == 0, r.stderr
    assert r.stderr.startswith("error: Not a directory") and "a_file" in r.stderr


@pytest.mark.parametrize("name", [".lock", "metrics.jsonl", "dit_train.log"])
def test_a_link_in_the_run_folder_is_refused_before_anything_outside_it_is_written(tmp_path, name):
    """A run folder from elsewhere with `.lock -> ~/.bashrc` (the lock is truncated and rewritten), metrics.jsonl
    (its torn last row cut off, then appended to) or Hydra's log (appended to) as a link: resuming it wrote into the
    link's target. Refused in one line, exit 2, before Hydra's log is opened; the target is untouched."""
    os.makedirs(tmp_path / "run")
    victim = tmp_path / "victim"
    victim.write_bytes(b"important\nno newline at the end")
    os.symlink(victim, tmp_path / "run" / name)
    r = cli(tmp_path, f"run_dir={tmp_path / 'run'}", "train.resume=auto")
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith(f"error: run_dir={str(tmp_path / 'run')!r} is not valid: {tmp_path / 'run' / name} "
                               f"is a symbolic link"), r.stderr
    assert victim.read_bytes() == b"important\nno newline at the end"
    assert sorted(os.listdir(tmp_path / "run")) == [name]
    with pytest.raises(ConfigError, match="is a symbolic link"):  # the library path (run()) refuses it too
        prepare_run_folder(tiny(tmp_path / "run", "train.resume=auto"), DistInfo())
    assert victim.read_bytes() == b"important\nno newline at the end"


def test_a_linked_checkpoints_folder_is_refused_before_another_runs_checkpoints_are_pruned(trained, tmp_path):
    """A copy of a run folder whose `checkpoints` links to the original run's: resuming it trained on, saved into
    the original's folder and pruned (train.keep_last) its checkpoints, and removed its `*.tmp` folders as leftovers
    of saves. Refused in one line before anything is written; the original is untouched."""
    original = tmp_path / "original"
    trained_copy(trained, original)
    (original / "checkpoints" / "notes.tmp").mkdir()  # not a save's leftover: a folder of the original's owner
    before = sorted(os.listdir(original / "checkpoints"))
    os.makedirs(tmp_path / "copy")
    os.symlink(original / "checkpoints", tmp_path / "copy" / "checkpoints")
    with pytest.raises(ConfigError, match=r"checkpoints is a symbolic link .* would write or delete outside") as e:
        run(tiny(tmp_path / "copy", "train.resume=auto", "train.steps=6", "train.keep_last=1"))
    assert "\n" not in str(e.value)
    assert sorted(os.listdir(original / "checkpoints")) == before
    assert sorted(os.listdir(tmp_path / "copy")) == ["checkpoints"]


def test_a_linked_checkpoint_or_written_folder_or_a_fifo_is_refused(tmp_path):
    """A checkpoint linked to one elsewhere (a resume rewrites its train_state.json), each folder a run writes
    inside (checkpoints, samples, abandoned, .hydra, wandb, nccl_traces) linked to a folder elsewhere, and a FIFO
    in place of a file the run writes in place (Hydra's log opened for appending waited for a reader forever)."""
    from dit_train.runs.in_place_files import IN_PLACE, WRITTEN_FOLDERS, refuse_writes_outside

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.makedirs(tmp_path / "run" / "checkpoints")
    os.symlink(elsewhere, tmp_path / "run" / "checkpoints" / "step_00000002.dcp")
    with pytest.raises(ConfigError, match=r"step_00000002\.dcp is a symbolic link"):
        refuse_writes_outside(str(tmp_path / "run"))
    for name in WRITTEN_FOLDERS:
        folder = tmp_path / ("run_" + name.strip("."))
        folder.mkdir()
        os.symlink(elsewhere, folder / name)
        with pytest.raises(ConfigError, match=f"{re.escape(name)} is a symbolic link"):
            refuse_writes_outside(str(folder))
    for name in IN_PLACE:
        folder = tmp_path / ("fifo_" + name.strip("."))
        folder.mkdir()
        os.mkfifo(folder / name)
        with pytest.raises(ConfigError, match=f"{re.escape(name)} is not a regular file"):
            refuse_writes_outside(str(folder))


def test_a_run_writes_no_folder_the_link_check_does_not_know(tmp_path):
    """WRITTEN_FOLDERS names every folder a run makes in its run folder (with samples, a resume that sets a timeline
    aside and Hydra's record): a new one must be added there, or a link at its name would be followed."""
    from dit_train.runs.in_place_files import WRITTEN_FOLDERS

    run(tiny(tmp_path / "run", "train.sample_every=2"))
    run(tiny(tmp_path / "run", "train.resume=" + str(tmp_path / "run" / "checkpoints" / "step_00000002.dcp")))
    folders = {name for name in os.listdir(tmp_path / "run") if os.path.isdir(tmp_path / "run" / name)}
    assert {"checkpoints", "samples", "abandoned"} <= folders <= set(WRITTEN_FOLDERS), folders


def test_stale_temp_files_of_a_dead_writer_are_removed_first(tmp_path):
    os.makedirs(tmp_path / "run")
    (tmp_path / "run" / "run_info.json.tmp-99999").write_text("torn")
    run(tiny(tmp_path / "run"))
    assert not any(".tmp-" in f for f in os.listdir(tmp_path / "run"))


def start(tmp_path, run_dir):
    return subprocess.Popen([sys.executable, "-m", "dit_train", f"run_dir={run_dir}", *TINY, "train.steps=100000",
                             "train.ckpt_every=0"], cwd=str(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"})


def wait_for_training(run_dir, proc, timeout=120):
    t0 = time.time()
    while not (run_dir / "metrics.jsonl").exists() or not (run_dir / "metrics.jsonl").read_text():
        assert proc.poll() is None and time.time() - t0 < timeout, proc.communicate()
        time.sleep(0.05)


def test_ctrl_c_checkpoints_and_exits_130(tmp_path):
    proc = start(tmp_path, tmp_path / "run")
    wait_for_training(tmp_path / "run", proc)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_INTERRUPTED, err
    assert "received SIGINT" in err and "Traceback" not in err
    assert len(ckpt.list_checkpoints(str(tmp_path / "run"))) == 1


def test_ctrl_c_in_a_dit_study_groups_sweep_leaves_the_advice_to_dit_study(tmp_path):
    """The same Ctrl-C in the sweep of one dit-study group (dit-study starts its trainers with UNDER_STUDY_ENV):
    the sweep's own command would continue that group alone; dit-study's line (rerun the study) is the advice."""
    UNDER_STUDY_ENV = "DIT_TRAIN_UNDER_STUDY"  # dit_train.trainer.preemption.UNDER_STUDY_ENV

    sweep = tmp_path / "sweep"
    args = ["--multirun", *TINY, "train.steps=100000", "train.ckpt_every=0", "seed=1,2", f"hydra.sweep.dir={sweep}"]
    proc = subprocess.Popen([sys.executable, "-m", "dit_train", *args], cwd=str(tmp_path), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", UNDER_STUDY_ENV: "1"})
    wait_for_training(sweep / "0", proc)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_INTERRUPTED, err
    assert err.strip().splitlines()[-1].startswith("preempted: received SIGINT at step ") and "--multirun" not in err


def test_ctrl_c_in_a_local_sweep_says_how_to_continue_the_whole_sweep(tmp_path):
    """Ctrl-C during a --multirun's first job ends the sweep there (exit 130): the job's own hint
    (`train.resume=auto run_dir=<sweep>/0`) continued that job alone and left the later jobs unrun, unsaid. A second
    line gives the sweep's command; pasted, it continues job 0 from its checkpoint and runs job 1."""
    import shlex

    sweep = tmp_path / "sweep"
    args = ["--multirun", *TINY, "train.steps=100000", "train.ckpt_every=0", "seed=1,2", f"hydra.sweep.dir={sweep}"]
    proc = subprocess.Popen([sys.executable, "-m", "dit_train", *args], cwd=str(tmp_path), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"})
    wait_for_training(sweep / "0", proc)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_INTERRUPTED and not (sweep / "1").exists(), err
    lines = err.strip().splitlines()
    prefix = "the --multirun sweep stopped at its job 0; the jobs after it did not run: continue the whole sweep " \
             "(each job from its own checkpoint, finished jobs skipped) with: "
    assert lines[-2].startswith("preempted: received SIGINT at step ") and lines[-1].startswith(prefix), err
    words = shlex.split(lines[-1].removeprefix(prefix))
    kept = [a for a in args if a != "--multirun" and not a.startswith("hydra.sweep.dir=")]
    assert words == ["python", "-m", "dit_train", "--multirun", f"hydra.sweep.dir={sweep}", "train.resume=auto",
                     *kept]
    stopped_at = int(re.search(r"step_(\d+)", ckpt.list_checkpoints(str(sweep / "0"))[-1]).group(1))
    r = run_cli_in_process(*words[3:], f"train.steps={stopped_at + 1}", cwd=str(tmp_path))  # a shorter sweep
    assert r.returncode == 0, r.stderr[-3000:]
    for job in ("0", "1"):
        assert json.loads((sweep / job / "summary.json").read_text())["steps"] == stopped_at + 1


def test_a_second_sigterm_during_the_shutdown_keeps_the_requeue_exit_code(tmp_path):
    proc = start(tmp_path, tmp_path / "run")
    wait_for_training(tmp_path / "run", proc)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_PREEMPTED, err
    assert len(ckpt.list_checkpoints(str(tmp_path / "run"))) == 1


def _faulty_peer(rank, port, queue, fault, timeout_minutes):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank),
                      LOCAL_RANK=str(rank))
    import torch.distributed as dist

    from dit_train.parallel import fsdp
    from dit_train.parallel.fsdp import CollectiveTimeout, collective_timeouts, init_distributed, \
        shutdown_process_group

    init_distributed(timeout_minutes=timeout_minutes)
    if fault == "dies":
        dist.barrier()
    if fault.startswith("leaves after"):  # rank 1 is gone; rank 0 leaves the group as the trainer's exit path does
        if rank == 1:
            os._exit(1)
        failing = {"leaves after a peer died": CollectiveTimeout("a peer died"),
                   "leaves after a refusal": ValueError("refused")}[fault]
        fsdp.FAILING_WAIT_S = 1.0  # 10 s as shipped
        t0 = time.time()
        shutdown_process_group(failing=failing)
        queue.put(("left", time.time() - t0))
        return
    if rank == 1:
        if fault == "dies":
            os._exit(1)  # dies mid-step: its peer is about to reduce the loss with it
        time.sleep(60)  # hangs: never joins the collective
        return
    t0 = time.time()
    try:
        with collective_timeouts(timeout_minutes):
            for _ in range(3):
                dist.all_reduce(torch.ones(1))
                time.sleep(0.5)
        queue.put(("finished", time.time() - t0))
    except Exception as e:  # noqa: BLE001 - what the test inspects
        queue.put((f"{type(e).__name__}: {e}", time.time() - t0))


def survivor(fault: str, timeout_minutes: float) -> tuple[str, float]:
    """(what rank 0's collective raised, how long it waited) when rank 1 of a gloo pair hangs or dies."""
    import torch.multiprocessing as mp

    from conftest import free_port

    ctx = mp.get_context("forkserver")  # conftest: the server has imported torch and the trainer
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_faulty_peer, args=(r, port, queue, fault, timeout_minutes)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        return queue.get(timeout=90)
    finally:
        for p in procs:
            p.kill()


def test_a_hung_peer_ends_the_survivor_with_one_line_after_the_timeout():
    message, waited = survivor("hangs", 0.05)  # 3 s
    assert message.startswith("CollectiveTimeout: rank 0: a collective waited more than parallel.timeout_minutes=0.05")
    assert "\n" not in message and waited < 30


def test_a_dead_peer_ends_the_survivor_with_one_line_within_the_timeout():
    """A rank killed mid-step (gloo): its peer's collective failed at once with the transport's error ("Connection
    closed by peer", "Connection reset by peer") in a traceback; it is one line saying a rank died, well within
    parallel.timeout_minutes (30 s here)."""
    message, waited = survivor("dies", 0.5)
    assert message.startswith("CollectiveTimeout: rank 0: another rank died during a collective"), message
    assert "\n" not in message and waited < 30
    # gloo's words end the parenthesis whole: its advice after them was cut mid-word ("... caused by a remo)")
    assert re.search(r"(Connection closed by peer|Connection reset by peer|Broken pipe)( \[[^\]]*\]:\d+)?\); see its "
                     r"log for why$", message), message


@pytest.mark.parametrize("fault, at_most", [("leaves after a peer died", 0.9), ("leaves after a refusal", 5)])
def test_a_failing_rank_leaves_the_group_without_waiting_for_a_dead_peer(fault, at_most):
    """The exit path's wait for every rank to leave (shutdown_process_group): with a peer killed it waited for the
    store's timeout, parallel.timeout_minutes (30 s here, 10 min by default), then ended in the store's traceback
    instead of the rank's own one line (a distributed new-user trial saw it). After a CollectiveTimeout there is
    no wait; after another failure (a refusal every rank shares) at most FAILING_WAIT_S (1 s here), and its end is
    no error."""
    message, waited = survivor(fault, 0.5)
    assert message == "left" and waited < at_most, (message, waited)


def test_a_torn_last_metrics_row_is_dropped_before_appending(tmp_path):
    from omegaconf import OmegaConf

    from dit_train.telemetry.logger import MetricLogger

    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "train/loss": 0.5}\n{"step": 2, "train/l')
    logger = MetricLogger(str(tmp_path), OmegaConf.create({"wandb": {"mode": "disabled"}}))
    logger.log(3, {"train/loss": 0.25})
    logger.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 3]


@pytest.mark.parametrize("name", ["metrics.jsonl", ".lock"])
@pytest.mark.parametrize("plant", ["link", "fifo"])
def test_a_link_or_fifo_put_in_place_after_the_check_is_never_written_through(tmp_path, name, plant):
    """On a shared file system a link (or FIFO) can appear at `metrics.jsonl` or `.lock` after the run folder was
    checked (refuse_writes_outside) and before the run opens the file: it was followed (`.lock -> ~/.bashrc`
    emptied it; metrics were appended to the target) or hung the run. The opens themselves refuse it, one line."""
    from omegaconf import OmegaConf

    from dit_train.config.errors import ConfigError
    from dit_train.runs.in_place_files import refuse_writes_outside
    from dit_train.runs.lock import RunLock
    from dit_train.telemetry.logger import MetricLogger

    refuse_writes_outside(str(tmp_path))  # the folder is clean at the check
    victim = tmp_path.parent / f"{tmp_path.name}-bashrc"
    victim.write_text("export PATH=/usr/bin\n")
    if plant == "link":
        os.symlink(victim, tmp_path / name)
    else:
        os.mkfifo(tmp_path / name)
    opens = {"metrics.jsonl": lambda: MetricLogger(str(tmp_path), OmegaConf.create({"wandb": {"mode": "disabled"}})),
             ".lock": lambda: RunLock(str(tmp_path)).acquire()}[name]
    with pytest.raises(ConfigError) as refused:
        opens()
    assert f"{tmp_path / name} became a" in str(refused.value) and "\n" not in str(refused.value)
    assert victim.read_text() == "export PATH=/usr/bin\n"


def test_the_torn_row_is_found_from_the_end_without_reading_the_whole_file(tmp_path, monkeypatch):
    """The logger read the whole metrics.jsonl to find a torn last row: a sparse file of a terabyte in a run folder
    from elsewhere filled the memory. It reads from the end, a chunk at a time; a row torn across chunks is cut at
    its start."""
    import resource

    from dit_train.telemetry import logger as logger_module

    monkeypatch.setattr(logger_module, "TAIL_CHUNK", 8)
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2, "train/loss": 0.123456789')
    logger_module.drop_torn_last_line(str(path))
    assert path.read_text() == '{"step": 1}\n'
    monkeypatch.setattr(logger_module, "TAIL_CHUNK", 1 << 20)
    with open(path, "ab") as f:  # 64 GiB of holes (no disk used), then a torn row
        f.truncate(64 << 30)
        f.seek(0, os.SEEK_END)
        f.write(b'\n{"step": 3, "tr')
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    logger_module.drop_torn_last_line(str(path))
    assert path.stat().st_size == (64 << 30) + 1
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 64 << 10  # KiB: a chunk, not the file
    path.unlink()


def test_resuming_into_a_read_only_run_folder_is_one_line(tmp_path, small_tmpfs):
    """A run on a file system mounted read-only (an archive, a snapshot): before, Hydra's log-file handler failed
    in a 30-line traceback."""
    disk = small_tmpfs("4m")
    run(tiny(disk / "run"))
    subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
    r = cli(tmp_path, f"run_dir={disk / 'run'}", "train.resume=auto", "train.steps=6")
    assert r.returncode == 1 and r.stderr.splitlines() == [
        f"error: run folder {disk / 'run'} is not writable (Read-only file system, EROFS): a run writes its "
        f"checkpoints and metrics there; copy it to a writable place, or fork it with "
        f"train.init_from={disk / 'run'} into a new run_dir"], r.stderr


def test_resuming_with_a_read_only_checkpoints_folder_is_one_line_before_training(tmp_path):
    """checkpoints/ read-only on its own (a bind mount): the run trained up to its first save, then failed there
    (a hostile-file-system trial). Now refused before any step, in one line."""
    run_dir = tmp_path / "run"
    run(tiny(run_dir))
    folder = run_dir / "checkpoints"
    mounted = subprocess.run(["mount", "--bind", str(folder), str(folder)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot bind-mount here (root needed): {mounted.stderr.strip()}")
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(folder)], check=True)
        before = (run_dir / "metrics.jsonl").read_text()
        r = cli(tmp_path, f"run_dir={run_dir}", "train.resume=auto", "train.steps=6")
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)
    assert r.returncode == 1 and r.stderr.splitlines() == [
        f"error: the run folder's {folder} is not writable (Read-only file system, EROFS): a run writes its "
        f"checkpoints and metrics there; copy it to a writable place, or fork it with "
        f"train.init_from={run_dir} into a new run_dir"], r.stderr
    assert (run_dir / "metrics.jsonl").read_text() == before


def test_a_torn_summary_is_one_line_naming_it(tmp_path):
    from dit_train.runs.json_file import DamagedJSONFile
    from dit_train.telemetry.metrics import read_summary

    path = tmp_path / "summary.json"
    path.write_text('{"steps": 4, "val_l')
    with pytest.raises(DamagedJSONFile) as e:
        read_summary(str(path))
    assert str(e.value).startswith(f"{path} is not valid JSON (") and "\n" not in str(e.value)
    assert read_summary(str(tmp_path / "absent.json")) == {}


def test_a_fifo_in_place_of_a_record_is_one_line_not_a_hang(tmp_path):
    """summary.json, wandb_run.json (read when a run folder is resumed) or metrics.jsonl (read by the study runner
    and dit-report) as a FIFO in a folder from elsewhere: the reader waited for a writer forever."""
    from dit_train.study.report import read_metrics
    from dit_train.telemetry.metrics import read_summary
    from dit_train.telemetry.wandb_run import read_identity

    def hung(*_):
        raise TimeoutError("the reader hung on the FIFO")

    readers = {"summary.json": read_summary, "wandb_run.json": read_identity, "metrics.jsonl": read_metrics}
    previous = signal.signal(signal.SIGALRM, hung)
    try:
        for name, reader in readers.items():
            os.mkfifo(tmp_path / name)
            signal.alarm(20)
            with pytest.raises(ValueError, match=f"{re.escape(name)} is not a regular file") as e:
                reader(str(tmp_path / name))
            signal.alarm(0)
            assert "\n" not in str(e.value)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.mark.parametrize("planted", ["multirun.yaml", "0/.hydra/config.yaml", "0/dit_train.log", "0", "0/.hydra",
                                     "fifo:0/dit_train.log", "fifo:multirun.yaml"])
def test_a_sweep_folder_with_links_where_hydra_writes_is_refused_before_hydra_writes(tmp_path, planted):
    """A sweep folder from elsewhere continued with `--multirun hydra.sweep.dir=S train.resume=auto` (what dit-study
    runs): Hydra writes S/multirun.yaml, each job's .hydra/{config,hydra,overrides}.yaml and its log before the run's
    own checks start, so a link planted at one of them (or at a job folder, or its .hydra) had the link's target
    overwritten or appended to, and a FIFO there hung the command. Refused in one line, exit 2, before Hydra writes
    anything; the target is untouched."""
    sweep, victim = tmp_path / "S", tmp_path / "victim"
    kind, _, name = planted.rpartition(":")
    (sweep / "0" / ".hydra").mkdir(parents=True)
    target = sweep / name
    if target.is_dir():
        shutil.rmtree(target)
        victim.mkdir()
        (victim / "notes").write_text("important")
    else:
        victim.write_text("important")
    if kind == "fifo":
        os.mkfifo(target)
    else:
        os.symlink(victim, target)
    before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    r = cli(tmp_path, "train.resume=auto", "train.steps=1", f"hydra.sweep.dir={sweep}", flags=["--multirun"], timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    what = "is not a regular file" if kind == "fifo" else "is a symbolic link"
    assert r.stderr.startswith(f"error: hydra.sweep.dir={str(sweep)!r} is not valid: {target} {what}"), r.stderr
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == before
    if kind != "fifo":
        assert (victim / "notes" if victim.is_dir() else victim).read_text() == "important"


def test_a_folder_hydra_names_from_a_preset_or_hydra_run_dir_is_checked_too(tmp_path):
    """The same links where Hydra names the folder itself: an experiment's fixed hydra.sweep.dir (sweeps/smoke,
    from its yaml) and a single run's hydra.run.dir=X."""
    victim = tmp_path / "victim"
    victim.write_text("important")
    (tmp_path / "sweeps" / "smoke").mkdir(parents=True)
    os.symlink(victim, tmp_path / "sweeps" / "smoke" / "multirun.yaml")
    r = cli(tmp_path, "experiment=smoke", "train.steps=1", flags=["--multirun"], timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "hydra.sweep.dir='sweeps/smoke' is not valid: sweeps/smoke/multirun.yaml is a symbolic link" in r.stderr
    (tmp_path / "X" / ".hydra").mkdir(parents=True)
    os.symlink(victim, tmp_path / "X" / ".hydra" / "overrides.yaml")
    r = cli(tmp_path, f"hydra.run.dir={tmp_path / 'X'}", "train.resume=auto", "train.steps=1", timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert f"X/.hydra/overrides.yaml is a symbolic link" in r.stderr
    assert victim.read_text() == "important"


def test_a_checkpoint_named_with_lookalike_digits_is_never_listed(tmp_path):
    """A run folder from elsewhere with `step_００００００１０.dcp` (fullwidth digits, which `\\d` matched): it sorted
    after every real checkpoint, so train.resume=auto resumed it instead of the run's own newest (moved aside as
    abandoned), and keep_last pruned the run's own checkpoints but never it. Only ASCII step names are checkpoints."""
    import shutil

    import torch

    from dit_train.runs import checkpoint as ckpt

    for step in (10, 20):
        ckpt.save(str(tmp_path), step, {"ema": {"w": torch.zeros(1)}}, {"step": step, "config": {}}, keep_last=0)
    folder = tmp_path / "checkpoints"
    shutil.copytree(folder / "step_00000010.dcp", folder / "step_００００００１０.dcp")
    assert ckpt.list_checkpoints(str(tmp_path)) == [str(folder / "step_00000010.dcp"),
                                                    str(folder / "step_00000020.dcp")]
    assert ckpt.resolve_checkpoint(str(tmp_path)) == str(folder / "step_00000020.dcp")
    ckpt.prune_checkpoints(str(tmp_path), keep_last=1)
    assert (folder / "step_00000020.dcp").exists() and not (folder / "step_00000010.dcp").exists()


def test_a_sweep_whose_jobs_share_one_run_dir_is_refused_before_anything_is_written(tmp_path):
    """`--multirun run_dir=runs/x seed=1,2`: both jobs had the one folder; the first trained there and the second
    was refused after it (it had checkpoints), leaving a sweep folder of Hydra's files. Now one line names the
    folder, the jobs and what to give instead, exit 2, before anything is written; the sweep as suggested runs
    both jobs, each in its own folder."""
    r = cli(tmp_path, "run_dir=runs/x", "seed=1,2", "train.steps=1", flags=("--multirun",))
    assert r.returncode == 2, r.stderr[-3000:]
    assert r.stderr.strip().splitlines() == [
        "error: run_dir=runs/x is the run folder of jobs #0 and #1 of this --multirun: each job needs its own; leave "
        "run_dir out and give hydra.sweep.dir=runs/x (each job then has a folder of its own in it)"]
    assert os.listdir(tmp_path) == []
    r = cli(tmp_path, "hydra.sweep.dir=runs/x", "seed=1,2", "train.steps=1", flags=("--multirun",))
    assert r.returncode == 0, r.stderr[-3000:]
    for job in ("0", "1"):
        assert json.loads((tmp_path / "runs" / "x" / job / "summary.json").read_text())["steps"] == 1


def test_a_busy_run_folder_in_a_sweep_skips_that_job_and_the_others_run(tmp_path):
    """dit-study runs a group's seeds as one --multirun: a seed whose folder another process held (a second
    process on the same sweep) ended the sweep there, and the group's later seeds waited for the next invocation.
    Now that job alone is skipped, the others run, and the sweep ends with the busy status (73): rerun later."""
    sweep = tmp_path / "sweep"
    (sweep / "0").mkdir(parents=True)  # the first job's folder (hydra.sweep.subdir: the job's number)
    holder = RunLock(str(sweep / "0")).acquire()
    try:
        r = cli(tmp_path, "seed=1,2", f"hydra.sweep.dir={sweep}", flags=("--multirun",))
    finally:
        holder.release()
    assert r.returncode == EXIT_RUN_FOLDER_BUSY, r.stderr[-3000:]
    assert (sweep / "1" / "summary.json").is_file() and not (sweep / "0" / "summary.json").exists()
    errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert errors[0].startswith(f"error: run folder {sweep / '0'} is in use by ") and errors[0].endswith(
        "; this job is skipped, the sweep goes on"), errors
    assert errors[-1] == ("error: 1 job(s) of this sweep skipped: their run folders were in use by another process; "
                          "rerun the same command when it has finished (finished runs are not rerun)")
