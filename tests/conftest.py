import contextlib
import faulthandler
import multiprocessing
import os
import socket
import time
import warnings
from datetime import timedelta

import pytest
import torch

import dit_train  # noqa: F401 - registers the config schemas with Hydra (compose needs them)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INTEGRATION = os.path.join(ROOT, "tests", "integration")
CONF_DIR = os.path.join(ROOT, "dit_train", "conf")
FASHION_ROOT = "/usr/share/datasets/fashion-mnist"

# Two intra-op threads for the one process on two cores; one each when pytest-xdist runs two workers side by side.
torch.set_num_threads(max(1, min(2, torch.get_num_threads()) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))

# Processes the tests start in Python (ranks, checkpoint writers) fork from one server process that imported torch
# and the trainer once (start method "forkserver"); "spawn" re-imported them in every process, ~5 s of CPU each on
# a 2-core host, a fifth of the suite's time. A forked process sees the environment of the server, i.e. of the
# first test that started one: tests that change os.environ must not rely on it reaching their processes.
# torch._dynamo too: every training rank imports it (meta-device model building goes through torch._compile),
# and inductor's compile_fx: the compiled RowNorm ranks of test_sharded_optim (~1.5 s of CPU per rank).
multiprocessing.set_forkserver_preload(["torch", "torch.distributed.fsdp", "dit_train.trainer.loop", "torch._dynamo",
                                       "torch._inductor.compile_fx"])


def pytest_collection_modifyitems(items):
    """Everything under tests/integration/ is end to end: `-m "not integration"` runs the unit tests alone."""
    for item in items:
        if str(item.path).startswith(INTEGRATION + os.sep):
            item.add_marker(pytest.mark.integration)


def compose(overrides=()):
    """The composed Hydra config, as `python -m dit_train <overrides>` would see it (run_dir given explicitly)."""
    from hydra import compose as hcompose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return hcompose(config_name="config", overrides=list(overrides))


@pytest.fixture
def tiny_cfg(tmp_path):
    """A seconds-long training config on real Fashion-MNIST: a very small DiT, few steps."""
    return compose([
        f"run_dir={tmp_path / 'run'}",
        "model.hidden_size=32", "model.depth=2", "model.num_heads=2", "model.patch_size=8",
        "train.steps=6", "train.batch_size=8", "train.warmup_steps=2", "train.log_every=2",
        "train.val_every=3", "train.val_samples=16", "train.val_batch_size=8", "train.val_t_points=2",
        "train.sample_every=0", "train.ckpt_every=3", "train.progress=false", "train.samples_per_class=1",
        "train.sample_steps=2",
    ])


@pytest.fixture
def one_intra_op_thread():
    """For tests on tiny matrices, where a second intra-op thread only adds synchronisation and stalls for
    milliseconds per op when other jobs share the two cores. Restored afterwards."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


needs_fashion = pytest.mark.skipif(not os.path.exists(FASHION_ROOT), reason="apt-get install dataset-fashion-mnist")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def gloo_group(rank: int, world: int, port: int):
    """Inside a spawned rank: join a local gloo group (one intra-op thread each: the ranks share two cores) for the
    body, then leave it cleanly whatever happened."""
    import torch.distributed as dist

    from dit_train.parallel.fsdp import shutdown_process_group

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank),
                      LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    try:
        yield
    finally:
        shutdown_process_group()


def _traced(rank, entry, *args):
    # a rank killed by a fatal signal (e.g. an abort inside gloo) prints every thread's Python stack: where it was
    faulthandler.enable(all_threads=True)
    entry(rank, *args)


def spawn_ranks(entry, world: int, args: tuple, timeout: float = 240.0) -> None:
    """Start entry(rank, world, port, *args) on `world` spawned processes (a fresh port for their gloo group) and
    wait; a job still running after `timeout` seconds is killed and reported.

    A job whose rank dies of SIGABRT runs once more, with a warning in the test summary. gloo on this CPU box
    aborts a rank mid-job now and then ("terminate called without an active exception": 3 of 40 runs of
    test_fd_distributed one afternoon, 0 of ~250 since, no reproducer); these tests check the maths of the
    distributed paths, so one abort is reported and retried, and a second fails the test. Failed assertions,
    exceptions and timeouts are never retried."""
    import torch.multiprocessing as mp

    for attempt in (1, 2):
        ctx = mp.start_processes(_traced, args=(entry, world, free_port(), *args), nprocs=world, join=False,
                                 start_method="forkserver")
        t0 = time.time()
        try:
            while not ctx.join(timeout=1.0):
                if time.time() - t0 > timeout:
                    for p in ctx.processes:
                        p.kill()
                    raise TimeoutError(f"{world}-rank job did not finish in {timeout:.0f} s")
            return
        except mp.ProcessExitedException as e:
            if e.signal_name != "SIGABRT" or attempt == 2:
                raise
            warnings.warn(f"{world}-rank job: rank {e.error_index} aborted (SIGABRT, stacks above); running it again")


def stop_signal_during_step(trainer, step: int, name: str = "SIGTERM") -> None:
    """Make `name` arrive while `trainer` runs its step `step` (1-based), before that step's all-reduce, as a real
    signal handler would record it."""
    original = trainer.train_step

    def step_with_signal(*args, **kwargs):
        if trainer.state.step == step - 1:
            trainer.preemption.signal_name = name
        return original(*args, **kwargs)

    trainer.train_step = step_with_signal


@pytest.fixture
def small_tmpfs(tmp_path):
    """A factory of real small file systems (`mount -t tmpfs -o size=...`, root only), unmounted afterwards: a full
    disk as the kernel reports it (ENOSPC from write or close), not a monkeypatched write."""
    import subprocess

    mounted = []

    def mount(size: str):
        folder = tmp_path / f"tmpfs{len(mounted)}"
        folder.mkdir()
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True,
                           text=True)
        if r.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here (root needed): {r.stderr.strip()}")
        mounted.append(folder)
        return folder

    yield mount
    for folder in mounted:
        subprocess.run(["umount", "-l", str(folder)], check=False)


def fill_disk(folder) -> None:
    """Write zeros into `folder` until its file system is full."""
    with open(os.path.join(folder, "filler"), "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError:
            pass


class CliResult:
    """What subprocess.run(capture_output=True, text=True) returns, for run_cli_in_process."""

    def __init__(self, returncode: int, stdout: str, stderr: str):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


@contextlib.contextmanager
def _process_state_kept(signals):
    """What a command run in this process may change and a new process would start without, as it was afterwards:
    sys.argv, the working directory, os.environ, the handlers of `signals` and torch's global settings."""
    import signal as signal_module
    import sys

    saved_argv, saved_cwd, saved_env = list(sys.argv), os.getcwd(), dict(os.environ)
    saved_signals = {s: signal_module.getsignal(s) for s in signals}
    saved_torch = (torch.get_num_threads(), torch.get_default_dtype(), torch.are_deterministic_algorithms_enabled(),
                   torch.is_grad_enabled(), torch.get_float32_matmul_precision())
    try:
        yield
    finally:
        for s, handler in saved_signals.items():
            signal_module.signal(s, handler)
        torch.set_num_threads(saved_torch[0])
        torch.set_default_dtype(saved_torch[1])
        torch.use_deterministic_algorithms(saved_torch[2])
        torch.set_grad_enabled(saved_torch[3])
        torch.set_float32_matmul_precision(saved_torch[4])
        os.environ.clear()
        os.environ.update(saved_env)
        os.chdir(saved_cwd)
        sys.argv = saved_argv


def _exit_code_as_a_process(command, out, err) -> int:
    """Run `command()` with stdout and stderr into `out` and `err` as a new interpreter would write them: its exit
    code (a SystemExit's; 0 when it returns), warnings printed to stderr (pytest records them instead: a test that
    the command says one line sees a warning as a second line, as it would from a subprocess)."""
    import sys

    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), warnings.catch_warnings():
        warnings.resetwarnings()
        for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
            warnings.simplefilter("ignore", category)
        # (not warnings._showwarning_orig: under pytest's recording that one hands the warning to the recorder)
        warnings.showwarning = lambda message, category, filename, lineno, file=None, line=None: sys.stderr.write(
            warnings.formatwarning(message, category, filename, lineno, line))
        try:
            code = command()
            return code if isinstance(code, int) else 0
        except SystemExit as e:
            if not isinstance(e.code, (int, type(None))):
                print(e.code, file=sys.stderr)  # sys.exit("message"): Python prints it
            return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)


def run_cli_in_process(*args, cwd, timeout: int = 300) -> CliResult:
    """`python -m dit_train *args` run by `cwd`, in this process: its exit code, stdout and stderr, as
    subprocess.run would give them, without the ~3 s of a new Python importing torch. For the tests of what the
    command does (its refusals, dry runs, folders); tests of what only a process shows (a signal's exit code,
    Python warnings printed by a fresh interpreter, the console script) still start one.

    The entry mutates process state that a new process would start without, restored here so the next test sees
    none of it: sys.argv (cli() appends to it), the working directory, Hydra's GlobalHydra and HydraConfig
    singletons (a later library run() would take the last command's folder for its Hydra folder), the logging
    Hydra configures (root handlers writing into the run folder, levels), signal handlers (a preempted command
    ignores SIGTERM from then on), os.environ, torch's global settings, and the per-process caches and flags of
    dit_train (the run-folder suffix, the deferred-.hydra flag). A command still running after `timeout` seconds
    (e.g. blocked opening a FIFO) raises TimeoutError, as subprocess.run's timeout would."""
    import io
    import logging
    import signal as signal_module
    import sys

    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig

    from dit_train import __main__ as entry
    from dit_train.runs import hydra_files, names

    root = logging.getLogger()
    saved_root = (list(root.handlers), root.level)
    saved_levels = {name: logger.level for name, logger in logging.Logger.manager.loggerDict.items()
                    if isinstance(logger, logging.Logger)}
    signals = [signal_module.SIGINT, signal_module.SIGTERM, signal_module.SIGUSR1, signal_module.SIGALRM]
    saved_deferred = hydra_files._deferred
    out, err = io.StringIO(), io.StringIO()
    with _process_state_kept(signals):
        try:
            sys.argv = [os.path.join(ROOT, "dit_train", "__main__.py"), *map(str, args)]
            os.chdir(cwd)
            names.run_suffix.cache_clear()
            # logging as a new process has it until Hydra configures it: no root handlers (pytest's would take the
            # warnings logged before Hydra, which Python's last-resort handler prints to stderr), level WARNING
            root.handlers[:] = []
            root.setLevel(logging.WARNING)

            def too_long(*_):
                raise TimeoutError(f"python -m dit_train {' '.join(map(str, args))} ran more than {timeout} s")

            signal_module.signal(signal_module.SIGALRM, too_long)
            signal_module.alarm(timeout)
            code = _exit_code_as_a_process(entry.cli, out, err)
        finally:
            signal_module.alarm(0)
            for handler in root.handlers:
                if handler not in saved_root[0]:
                    handler.close()  # Hydra's dit_train.log in the run folder
            root.handlers[:], _ = saved_root[0], root.setLevel(saved_root[1])
            for name, level in saved_levels.items():
                logging.getLogger(name).setLevel(level)
            for name, logger in logging.Logger.manager.loggerDict.items():
                if isinstance(logger, logging.Logger) and name not in saved_levels:
                    logger.setLevel(logging.NOTSET)
            hydra_files._deferred = saved_deferred
            names.run_suffix.cache_clear()
            GlobalHydra.instance().clear()
            HydraConfig.instance().cfg = None
    return CliResult(code, out.getvalue(), err.getvalue())


def run_entry_in_process(entry, *args, prog: str = "dit-command") -> CliResult:
    """A dit-* console command other than dit-train (its `main` or `cli`, e.g. dit_train.export.main) run with
    `args` in this process: its exit code, stdout and stderr as subprocess.run would give them, without the ~3-4 s
    of a new interpreter importing torch. sys.argv is set too (cli() entries read it); an argparse refusal
    (SystemExit) is an exit code. As in run_cli_in_process, warnings are printed to stderr as a fresh interpreter
    prints them, and what a command may change for the process (argv, cwd, environment, signal handlers, torch's
    global settings) is restored afterwards. For tests of what the command says and writes; a test of what only a
    process shows (the console script itself, a signal's exit code, torchrun) still starts one."""
    import io
    import signal as signal_module
    import sys

    out, err = io.StringIO(), io.StringIO()
    with _process_state_kept([signal_module.SIGINT, signal_module.SIGTERM, signal_module.SIGUSR1]):
        sys.argv = [prog, *map(str, args)]
        code = _exit_code_as_a_process(
            lambda: entry(list(sys.argv[1:])) if entry.__name__ == "main" else entry(), out, err)
    return CliResult(code, out.getvalue(), err.getvalue())
