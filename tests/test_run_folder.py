"""Run-folder integrity: a resume that would silently change the experiment is refused before anything is written;
one writer per folder; summaries that tell the truth; clean one-line failures; non-finite weights never saved."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import ROOT, compose, needs_fashion, stop_signal_during_step
from dit_train import checkpoint as ckpt
from dit_train.config import ConfigError
from dit_train.parallel import DistInfo
from dit_train.preemption import EXIT_INTERRUPTED, EXIT_PREEMPTED, Preempted
from dit_train.run_lock import RunFolderBusy, RunLock
from dit_train.train import Trainer, TrainingStopped, run

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


# ---- resume compatibility ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("change, named", [
    (["optimizer.K=5"], "optimizer.K: 3 -> 5"),
    (["optimizer.lr=0.01"], "optimizer.lr: 0.002 -> 0.01"),
    (["optimizer=rownorm"], 'optimizer.name: "periodic_rowwise" -> "rownorm"'),
    (["train.batch_size=8"], "train.batch_size: 4 -> 8"),
    (["model.hidden_size=64"], "model.hidden_size: 32 -> 64"),
])
def test_resume_with_a_changed_experiment_is_refused_before_anything_is_written(tmp_path, change, named):
    run(tiny(tmp_path / "run"))
    before = {f: read(tmp_path / "run" / f) for f in ("config.yaml", "run_info.json", "summary.json")}
    with pytest.raises(ConfigError, match="cannot change on resume") as e:
        run(tiny(tmp_path / "run", "train.resume=auto", "train.steps=6", *change))
    assert named in str(e.value) and "train.init_from" in str(e.value) and "\n" not in str(e.value)
    assert {f: read(tmp_path / "run" / f) for f in before} == before  # provenance untouched


def test_a_swapped_optimizer_is_named_first_and_stands_for_the_keys_that_follow_from_it(tmp_path):
    """periodic_rowwise -> adamw changes a dozen optimizer keys (K, momentum, ... absent); the line names the swap
    first and counts those, so that it still shows at once what changed (and any other change beside it)."""
    run(tiny(tmp_path / "run"))
    with pytest.raises(ConfigError, match="cannot change on resume") as e:
        run(tiny(tmp_path / "run", "train.resume=auto", "optimizer=adamw", "train.batch_size=8"))
    changes = str(e.value).split("another config (", 1)[1].split("); these keys", 1)[0]
    assert re.fullmatch(r'optimizer\.name: "periodic_rowwise" -> "adamw" \(and \d+ other keys of optimizer\); '
                        r'train\.batch_size: 4 -> 8', changes), changes


def test_resume_may_change_length_cadence_and_paths(tmp_path):
    run(tiny(tmp_path / "run"))
    out = run(tiny(tmp_path / "run", "train.resume=auto", "train.steps=6", "train.log_every=2",
                   "train.ckpt_every=3", "train.keep_last=1"))
    assert out["steps"] == 6


def test_fork_starts_from_the_weights_with_a_fresh_optimizer(tmp_path):
    run(tiny(tmp_path / "source"))
    fork = Trainer(tiny(tmp_path / "fork", f"train.init_from={tmp_path / 'source'}", "optimizer.K=5"), DistInfo())
    fork.resume()
    source = ckpt.read_tensors(ckpt.resolve_checkpoint(str(tmp_path / "source")), "model")
    assert fork.state.step == 0 and not fork.optimizer.state
    assert all(torch.equal(v, source[k]) for k, v in fork.model.state_dict().items())


def test_a_requeued_fork_continues_from_its_own_checkpoints(tmp_path):
    """train.init_from + train.resume=auto: the first start forks; a requeue (the same command) continues the
    fork's own newest checkpoint, not the source again."""
    run(tiny(tmp_path / "source"))
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


def test_a_fork_into_another_model_size_is_one_line_and_leaves_no_folder(tmp_path):
    run(tiny(tmp_path / "source"))
    r = subprocess.run([sys.executable, "-m", "dit_train", *TINY, f"run_dir={tmp_path / 'fork'}",
                        f"train.init_from={tmp_path / 'source'}", "model.hidden_size=64"], cwd=str(tmp_path),
                       capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT}, timeout=300)
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


def test_default_run_folders_differ_for_jobs_started_in_the_same_second():
    code = "from dit_train.run_names import run_suffix; print(run_suffix())"
    env = {**os.environ, "PYTHONPATH": ROOT, "SLURM_ARRAY_JOB_ID": "77", "SLURM_ARRAY_TASK_ID": "3"}
    names = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env).stdout.strip()
             for _ in range(2)]
    assert names[0] != names[1] and all(n.startswith("j77_3-") for n in names)


# ---- summaries --------------------------------------------------------------------------------------------------
def test_rerunning_a_finished_run_leaves_its_summary(tmp_path, capsys):
    run(tiny(tmp_path / "run"))
    summary = read(tmp_path / "run" / "summary.json")
    again = run(tiny(tmp_path / "run", "train.resume=auto"))
    assert read(tmp_path / "run" / "summary.json") == summary and again["steps"] == 4
    assert "already finished at step 4" in capsys.readouterr().out


def test_an_extended_run_that_is_preempted_has_no_summary(tmp_path):
    run(tiny(tmp_path / "run"))
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
    from dit_train import atomic_io

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


def cli(tmp_path, *args, timeout=120):
    return subprocess.run([sys.executable, "-m", "dit_train", *TINY, *args], cwd=str(tmp_path), capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "PYTHONPATH": ROOT})


def test_an_unwritable_run_dir_is_one_line(tmp_path):
    (tmp_path / "a_file").write_text("x")
    r = cli(tmp_path, f"run_dir={tmp_path / 'a_file' / 'run'}")
    assert r.returncode == 1 and r.stderr.strip().count("\n") == 0, r.stderr
    assert r.stderr.startswith("error: Not a directory") and "a_file" in r.stderr


def test_stale_temp_files_of_a_dead_writer_are_removed_first(tmp_path):
    os.makedirs(tmp_path / "run")
    (tmp_path / "run" / "run_info.json.tmp-99999").write_text("torn")
    run(tiny(tmp_path / "run"))
    assert not any(".tmp-" in f for f in os.listdir(tmp_path / "run"))


def start(tmp_path, run_dir):
    return subprocess.Popen([sys.executable, "-m", "dit_train", f"run_dir={run_dir}", *TINY, "train.steps=100000",
                             "train.ckpt_every=0"], cwd=str(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": ROOT})


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


def test_a_second_sigterm_during_the_shutdown_keeps_the_requeue_exit_code(tmp_path):
    proc = start(tmp_path, tmp_path / "run")
    wait_for_training(tmp_path / "run", proc)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_PREEMPTED, err
    assert len(ckpt.list_checkpoints(str(tmp_path / "run"))) == 1


def _hung_peer(rank, port, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank),
                      LOCAL_RANK=str(rank))
    import torch.distributed as dist

    from dit_train.parallel import collective_timeouts, init_distributed

    init_distributed(timeout_minutes=0.05)  # 3 s
    if rank == 1:
        time.sleep(60)  # hangs: never joins the collective
        return
    t0 = time.time()
    try:
        with collective_timeouts(0.05):
            dist.all_reduce(torch.ones(1))
        queue.put(("finished", time.time() - t0))
    except Exception as e:  # noqa: BLE001 - what the test inspects
        queue.put((f"{type(e).__name__}: {e}", time.time() - t0))


def test_a_hung_peer_ends_the_survivor_with_one_line_after_the_timeout():
    import torch.multiprocessing as mp

    from conftest import free_port

    ctx = mp.get_context("forkserver")  # conftest: the server has imported torch and the trainer
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_hung_peer, args=(r, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        message, waited = queue.get(timeout=90)
    finally:
        for p in procs:
            p.kill()
    assert message.startswith("CollectiveTimeout: rank 0: a collective waited more than parallel.timeout_minutes=0.05")
    assert "\n" not in message and waited < 30


def test_a_torn_last_metrics_row_is_dropped_before_appending(tmp_path):
    from omegaconf import OmegaConf

    from dit_train.logger import MetricLogger

    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "train/loss": 0.5}\n{"step": 2, "train/l')
    logger = MetricLogger(str(tmp_path), OmegaConf.create({"wandb": {"mode": "disabled"}}))
    logger.log(3, {"train/loss": 0.25})
    logger.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 3]


def test_resuming_into_a_read_only_run_folder_is_one_line(tmp_path, small_tmpfs):
    """A run on a file system mounted read-only (an archive, a snapshot): before, Hydra's log-file handler failed
    in a 30-line traceback."""
    disk = small_tmpfs("4m")
    run(tiny(disk / "run"))
    subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
    r = subprocess.run([sys.executable, "-m", "dit_train", *TINY, f"run_dir={disk / 'run'}", "train.resume=auto",
                        "train.steps=6"], cwd=str(tmp_path), capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": ROOT}, timeout=300)
    assert r.returncode == 1 and r.stderr.splitlines() == [
        f"error: run folder {disk / 'run'} is not writable (Read-only file system, EROFS): a run writes its "
        f"checkpoints and metrics there; copy it to a writable place, or fork it with "
        f"train.init_from={disk / 'run'} into a new run_dir"], r.stderr


def test_a_torn_summary_is_one_line_naming_it(tmp_path):
    from dit_train.json_file import DamagedJSONFile
    from dit_train.metrics import read_summary

    path = tmp_path / "summary.json"
    path.write_text('{"steps": 4, "val_l')
    with pytest.raises(DamagedJSONFile) as e:
        read_summary(str(path))
    assert str(e.value).startswith(f"{path} is not valid JSON (") and "\n" not in str(e.value)
    assert read_summary(str(tmp_path / "absent.json")) == {}
