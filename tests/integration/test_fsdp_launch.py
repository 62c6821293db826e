"""Launch plumbing without a cluster: srun without torchrun (one task per GPU, the submitit launcher) gets its
process-group variables from Slurm's, and a preemption signal that another handler owned before the trainer
(submitit's SIGUSR2 requeue) is handed back to it after the checkpoint."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT, needs_fashion
from dit_train.parallel.fsdp import first_slurm_host, slurm_environment


@pytest.mark.parametrize("nodelist,first", [("gpu[003-004,9],cpu1", "gpu003"), ("r[1-2]-n[07-08]", "r1-n07"),
                                            ("node7", "node7"), ("a,b", "a"), ("n[10]", "n10")])
def test_first_slurm_host(nodelist, first):
    assert first_slurm_host(nodelist) == first


def test_slurm_task_environment():
    step = {"SLURM_STEP_ID": "0", "SLURM_PROCID": "13", "SLURM_STEP_NUM_TASKS": "32", "SLURM_LOCALID": "5",
            "SLURM_STEP_NODELIST": "gpu[003-006]", "SLURM_JOB_ID": "123456"}
    assert slurm_environment(step) == {"RANK": "13", "WORLD_SIZE": "32", "LOCAL_RANK": "5",
                                       "MASTER_ADDR": "gpu003", "MASTER_PORT": "23456"}
    assert slurm_environment({**step, "MASTER_ADDR": "head", "MASTER_PORT": "29500"})["MASTER_ADDR"] == "head"
    assert slurm_environment({**step, "WORLD_SIZE": "8"}) == {}  # torchrun's variables win
    assert slurm_environment({**step, "SLURM_STEP_NUM_TASKS": "1"}) == {}  # one task: single process
    no_step = {k: v for k, v in step.items() if k != "SLURM_STEP_ID"}
    assert slurm_environment(no_step) == {}  # the batch script itself, not an srun step


@needs_fashion
def test_preemption_signal_is_handed_to_the_previous_handler_after_the_checkpoint(tiny_cfg):
    from dit_train.runs import checkpoint as ckpt
    from dit_train.parallel.fsdp import DistInfo
    from dit_train.trainer.preemption import Preempted
    from dit_train.trainer.loop import Trainer

    seen = []

    def submitit_like(signum, frame):
        seen.append((signum, [os.path.basename(p) for p in ckpt.list_checkpoints(tiny_cfg.run_dir)]))

    old = signal.signal(signal.SIGUSR2, submitit_like)
    try:
        tiny_cfg.train.ckpt_every = 0
        trainer = Trainer(tiny_cfg, DistInfo())
        step = trainer.train_step

        def signal_during_step_2(*a, **kw):
            if trainer.state.step == 1:
                os.kill(os.getpid(), signal.SIGUSR2)
            return step(*a, **kw)

        trainer.train_step = signal_during_step_2
        with pytest.raises(Preempted, match="received SIGUSR2 at step 2"):
            trainer.fit()
        assert seen == [(signal.SIGUSR2, ["step_00000002.dcp"])]  # called once, after the checkpoint
        assert signal.getsignal(signal.SIGUSR2) is submitit_like  # and restored
    finally:
        signal.signal(signal.SIGUSR2, old)


TINY = ["model.hidden_size=32", "model.depth=1", "model.num_heads=1", "model.patch_size=8", "train.batch_size=4",
        "train.val_samples=4", "train.val_batch_size=4", "train.val_t_points=1", "train.sample_every=0",
        "train.progress=false", "train.warmup_steps=0", "train.log_every=1", "train.ckpt_every=0"]


def start_torchrun(run_dir, *overrides):
    return subprocess.Popen([sys.executable, "-m", "dit_train.torchrun", "--standalone", "--nproc_per_node", "2",
                             "-m", "dit_train", f"run_dir={run_dir}", *TINY, *overrides], cwd=str(run_dir.parent),
                            env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def wait_until(ready, proc, what: str, timeout: float = 180) -> None:
    t0 = time.time()
    while not ready():
        assert proc.poll() is None, proc.communicate()
        assert time.time() - t0 < timeout, f"no {what}"
        time.sleep(0.1)


@needs_fashion
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_a_stop_signal_to_torchrun_checkpoints_and_the_job_exits_75(tmp_path, sig):
    """`dit-torchrun` (torchrun's options, torchrun's behaviour) signalled like scancel or Slurm's
    --signal: the 2 ranks checkpoint together and the job exits 75, requeue-able (torchrun itself exits 1)."""
    from dit_train.runs import checkpoint as ckpt
    from dit_train.trainer.preemption import EXIT_PREEMPTED

    run_dir = tmp_path / "run"
    proc = start_torchrun(run_dir, "train.steps=400")
    try:
        metrics = run_dir / "metrics.jsonl"
        wait_until(lambda: metrics.exists() and any(json.loads(row)["step"] >= 2
                                                    for row in metrics.read_text().split("\n")[:-1]), proc, "step 2")
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == EXIT_PREEMPTED, err[-3000:]
    # both ranks received it: rank 0 says so once (before: a line per rank)
    assert err.count("preempted:") == 1 and err.count(f"preempted: received {sig.name} at step") == 1, err[-3000:]
    assert f"torchrun: received {sig.name} and passed it on to the workers (a checkpoint, then exit): exit 75" in err
    saved = ckpt.list_checkpoints(str(run_dir))
    assert len(saved) == 1 and 2 <= ckpt.read_train_state(saved[0])["step"] < 400


@needs_fashion
def test_sharded_ranks_stop_the_end_of_run_grid_together(tmp_path):
    """2 FSDP2 ranks in a long end-of-run grid (every model call a collective): they agree on the signal at the
    same model call, leave the grid together and exit 75, the last checkpoint written before the grid."""
    from dit_train.runs import checkpoint as ckpt
    from dit_train.trainer.preemption import EXIT_PREEMPTED

    run_dir = tmp_path / "run"
    proc = start_torchrun(run_dir, "train.steps=3", "train.val_every=0", "train.sample_every=3",
                          "train.sample_steps=200000")
    try:
        wait_until(lambda: ckpt.list_checkpoints(str(run_dir), remove_partial=False), proc, "checkpoint")
        time.sleep(1.0)  # inside the grid
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == EXIT_PREEMPTED, err[-3000:]
    assert err.count("preempted: received SIGTERM at step 3, the last, during the end-of-run work: its checkpoint "
                     "was written first; skipped sample grid and summary.json") == 1, err[-3000:]
    assert err.count("preempted:") == 1, err[-3000:]  # rank 0's line only
    assert [ckpt.read_train_state(p)["step"] for p in ckpt.list_checkpoints(str(run_dir))] == [3]


@pytest.mark.parametrize("launch, said", [
    (["--nproc_per_node", "2"], "error: train.batch_size=15 is not valid: must be divisible by the world size 2"),
    # a world size torchrun decides itself (here the CPU count): every worker refuses, the job exits 2 in one line
    (["--nproc_per_node", "cpu"], "torchrun: the workers were refused"),
])
def test_a_refused_command_line_under_dit_torchrun_exits_2(tmp_path, launch, said):
    """Under dit-torchrun a bad value was each worker's error line, then torchrun's ChildFailedError traceback, exit
    1 (a distributed trial). The trainer's command line is checked at the job's world size before any worker
    starts: its one line, exit 2."""
    bad = "train.batch_size=15" if launch[1] == "2" else "optimizer.lrr=1"
    r = subprocess.run([sys.executable, "-m", "dit_train.torchrun", "--standalone", *launch, "-m", "dit_train",
                        "experiment=debug", bad], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    lines = r.stderr.strip().splitlines()
    assert lines[-1].startswith(said), r.stderr[-3000:]
    if launch[1] == "2":  # refused before any worker started
        assert len(lines) == 1 and r.stdout == "", r.stderr


def test_a_master_port_in_use_under_dit_torchrun_is_one_line_and_exit_2(tmp_path):
    """`dit-torchrun --master-port P` with P held by another process (another job's rendezvous on the node): torchrun's
    store failed to listen and the job ended in torchrun's 40-line DistNetworkError traceback, exit 1. It is one line
    naming the port and what to pass, exit 2, before any worker starts (no run folder)."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "dit_train.torchrun", "--nproc_per_node", "2", "--master_addr",
                            "127.0.0.1", "--master_port", str(port), "-m", "dit_train", "experiment=debug",
                            f"run_dir={tmp_path / 'run'}"], cwd=tmp_path, capture_output=True, text=True,
                           timeout=120, env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert r.stderr.strip().splitlines() == [
        f"error: torchrun: port {port} is in use on this host (another job's rendezvous?): pass a free port with "
        f"--master-port (or --rdzv-endpoint HOST:PORT), or --standalone on one node"], r.stderr[-3000:]
    assert r.stdout == "" and not (tmp_path / "run").exists()


def test_a_master_port_in_use_under_srun_is_one_line_on_rank_0(tmp_path):
    """srun without torchrun: rank 0 makes the group's store on MASTER_PORT. A port already taken (another job's
    group on the node) was the store's 40-line traceback; it is one line naming the variable, exit 2, and no run
    folder is left."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        step = {"SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_ID": "7",
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
        r = subprocess.run([sys.executable, "-m", "dit_train", "experiment=debug", "parallel.timeout_minutes=0.2",
                            f"run_dir={tmp_path / 'run'}"], cwd=tmp_path, capture_output=True, text=True,
                           timeout=120, env={**env, **step, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert r.stderr.strip().splitlines()[-1] == (
        f"error: MASTER_PORT='{port}' on MASTER_ADDR='127.0.0.1' is in use (another job's process group on this "
        f"node?): set MASTER_PORT to a free port; the other ranks give up after parallel.timeout_minutes=0.2")
    assert not (tmp_path / "run").exists()


def srun_task(tmp_path, rank: int, extra_env: dict, *overrides: str) -> subprocess.CompletedProcess:
    """One task of a 2-task srun step without torchrun (the other never started), run in tmp_path."""
    import socket

    with socket.socket() as s:  # a free port, released for the task's store
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    step = {"SLURM_STEP_ID": "0", "SLURM_PROCID": str(rank), "SLURM_NTASKS": "2", "SLURM_JOB_ID": "7",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    return subprocess.run([sys.executable, "-m", "dit_train", "experiment=debug", *overrides], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120,
                          env={**env, **step, **extra_env, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"})


def test_a_rank_that_never_joins_under_srun_is_one_line_on_rank_0(tmp_path):
    """srun without torchrun, the second task never started: rank 0's store waited parallel.timeout_minutes and
    ended in DistStoreError's traceback ('1/2 clients joined'), leaving runs/<date>/<time>/ with Hydra's files and an
    empty dit_train.log. One line naming the rank that did not join and what to check, exit 1, no folder."""
    r = srun_task(tmp_path, 0, {}, "parallel.timeout_minutes=0.05")
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: rank 0: 1 of 2 ranks joined the process group at "
                                                   "MASTER_ADDR=127.0.0.1 MASTER_PORT="), r.stderr
    assert "within parallel.timeout_minutes=0.05; rank 1 did not: check that every task started" in lines[0]
    assert not [p for p in (tmp_path / "runs").rglob("*")], list((tmp_path / "runs").rglob("*"))


def test_a_failed_start_leaves_the_users_empty_folder_above_run_dir(tmp_path):
    """run_dir=<a folder the user made>/run and a start that failed before anything was written (here rank 1 never
    joined): the run folder of Hydra's files was removed, and with it the user's folder above it whenever that was
    empty (meant for Hydra's runs/<date>/ level alone): `mkdir /shared/runs` gone after a first failed job. Now only
    the run folder goes."""
    (tmp_path / "mine").mkdir()
    r = srun_task(tmp_path, 0, {}, "parallel.timeout_minutes=0.05", f"run_dir={tmp_path / 'mine' / 'run'}")
    assert r.returncode == 1 and "rank 1 did not" in r.stderr, r.stderr[-3000:]
    assert os.listdir(tmp_path / "mine") == []  # the run folder of Hydra's files alone is removed, the user's kept


def two_tasks_rank1_mounted(tmp_path, mount: str, overrides: list[str], rank0_first_s: float = 0.0):
    """Two tasks as srun starts them (no torchrun) on `tmp_path/shared/run`, rank 1 in its own mount namespace where
    `mount` (a shell command on `{shared}`) changes what it sees there: another node's view of the folder, emulated
    on one host. Returns (shared, [(returncode, stdout, stderr)] per rank)."""
    import shutil
    import socket

    if not shutil.which("unshare") or subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode:
        pytest.skip("needs unshare -m (root) to give rank 1 a view of the folder of its own")
    shared = tmp_path / "shared"
    shared.mkdir()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC"))}
    command = [sys.executable, "-m", "dit_train", "experiment=debug", *overrides, f"run_dir={shared / 'run'}"]
    procs = []
    for r in (0, 1):
        launch = {"RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": "2",
                  "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
        view = ["unshare", "-m", "sh", "-c", mount.format(shared=shared) + ' && exec "$@"', "sh"] if r else []
        procs.append(subprocess.Popen([*view, *command], cwd=tmp_path, env={**env, **launch}, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
        time.sleep(rank0_first_s if r == 0 else 0)
    outputs = [p.communicate(timeout=180) for p in procs]
    return shared, [(p.returncode, *o) for p, o in zip(procs, outputs)]


def test_a_run_dir_that_is_another_folder_on_rank_1_is_refused_in_one_line(tmp_path):
    """run_dir on a node-local path in a 2-node job, emulated on one host: rank 1 runs in its own mount namespace
    with a private tmpfs over the run folder's parent. The run trained and exited 0, each checkpoint marked COMPLETE
    by rank 0 without rank 1's shard (written to a folder no one else sees), and only a resume failed. Now one line
    on rank 0 naming the rank and what to give, exit 2 on both ranks, nothing of the run written."""
    shared, out = two_tasks_rank1_mounted(tmp_path, "mount -t tmpfs none {shared}",  # its own empty folder
                                          ["train.steps=2", "parallel.timeout_minutes=1"])
    assert [code for code, _, _ in out] == [2, 2], out
    assert out[0][2].strip().splitlines() == [
        f"error: run_dir={shared / 'run'} is not one folder on every rank: rank(s) 1 do not see rank 0's .lock there "
        f"(a node-local path?); every rank writes its checkpoint shards into run_dir, so give a run_dir on a file "
        f"system every node mounts"], out[0][2][-3000:]
    assert out[1][2].strip() == "", out[1][2][-3000:]  # one line for the job, rank 0's
    assert not (shared / "run" / "checkpoints").exists() and not (shared / "run" / "run_info.json").exists()


def test_a_task_that_refused_its_run_folder_is_not_reported_as_never_started(tmp_path):
    """srun without torchrun (no --kill-on-bad-exit), rank 1 cannot write run_dir (a read-only mount on its node): it
    exits with its own line before joining, and rank 0, after parallel.timeout_minutes, told the user only to check
    that every task started (it had) and could reach MASTER_ADDR. Now its line says a task may have exited with its
    own line, in its log."""
    # rank 0 makes the folder first, as a task started earlier does; rank 1 sees it read-only
    _, out = two_tasks_rank1_mounted(tmp_path, "mount --bind -o ro {shared} {shared}",
                                     ["parallel.timeout_minutes=0.05"], rank0_first_s=2)
    assert "is not writable (Read-only file system, EROFS)" in out[1][2], out[1][2][-3000:]
    lines = out[0][2].strip().splitlines()
    assert len(lines) == 1 and "rank 1 did not: check that every task started (srun -n 2, one per GPU) and is still "\
        "running (a task that refused its config or run folder exited with its own line: see its log)" in lines[0], \
        out[0][2][-3000:]


def test_a_socket_interface_this_host_lacks_is_one_line(tmp_path):
    """GLOO_SOCKET_IFNAME=bogus0 (a user's setting, which the trainer did not check): each rank's gloo traceback
    'Unable to find address for: bogus0', torchrun's ChildFailedError, a run folder per rank of Hydra's files. Under
    dit-torchrun one line before any worker starts; a task started by srun itself refuses it, exit 2, no folder."""
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "bogus0"}
    r = subprocess.run([sys.executable, "-m", "dit_train.torchrun", "--standalone", "--nproc-per-node", "2", "-m",
                        "dit_train", "experiment=debug"], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                       env=env)
    said = "error: GLOO_SOCKET_IFNAME=bogus0: this host ("
    assert r.returncode == 2 and r.stderr.startswith(said) and r.stderr.count("\n") == 1, r.stderr[-3000:]
    assert "has no network interface named bogus0; its interfaces: " in r.stderr and "lo" in r.stderr
    assert not (tmp_path / "runs").exists()
    task = srun_task(tmp_path, 0, {"GLOO_SOCKET_IFNAME": "bogus0"})
    assert task.returncode == 2 and task.stderr.strip().splitlines()[-1].startswith(said), task.stderr[-3000:]
    assert "Traceback" not in task.stderr and not [p for p in (tmp_path / "runs").rglob("*")]
