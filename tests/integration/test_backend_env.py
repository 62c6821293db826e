"""The environment the process groups are created with (dit_train/parallel/backend_env.py, docs/scaling_out.md): for NCCL
the current variable names only, torch's take-the-process-down error handling, the flight recorder dumping on a
timeout into the run folder, user settings kept (no GPU here: init_process_group is patched to record what it would
have been given); for gloo the network interface that reaches MASTER_ADDR (two real gloo ranks on 127.0.0.2)."""

import datetime
import os
import shutil
import subprocess

import pytest
import torch
import torch.distributed as dist

from conftest import compose
from dit_train.parallel import backend_env
from dit_train.parallel.backend_env import record_nccl_traces, use_gloo_interface
from dit_train.parallel.fsdp import init_distributed

NAMES = sorted({*backend_env.NCCL_DEFAULTS, *backend_env.RENAMED, *backend_env.RENAMED.values(),
                *backend_env.OLDER_NAME, *backend_env.OLDER_NAME.values()})


@pytest.fixture
def clean_env(monkeypatch):
    """None of the NCCL variables set (all restored afterwards), a 2-rank torchrun environment, TF32 flags restored."""
    for name in (*NAMES, "GLOO_SOCKET_IFNAME", "MASTER_ADDR", "LOCAL_WORLD_SIZE", "SLURM_STEP_NUM_NODES"):
        monkeypatch.delenv(name, raising=False)
    for name, value in (("WORLD_SIZE", "2"), ("RANK", "0"), ("LOCAL_RANK", "0")):
        monkeypatch.setenv(name, value)
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    yield monkeypatch
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def group_created(monkeypatch, device: str) -> dict:
    """What init_distributed hands init_process_group: its arguments and the environment at that moment."""
    seen = {}

    def init_process_group(backend, **kwargs):
        seen.update(backend=backend, env=dict(os.environ), **kwargs)

    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    init_distributed(device=device)
    return seen


def nccl_env(env: dict) -> dict:
    return {k: v for k, v in env.items() if k in NAMES}


def test_the_nccl_group_gets_the_current_variables_and_a_ten_minute_timeout(clean_env):
    seen = group_created(clean_env, "cuda")
    assert seen["backend"] == "nccl"
    assert nccl_env(seen["env"]) == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
                                     "TORCH_FR_BUFFER_SIZE": "2000"}
    assert seen["timeout"] == datetime.timedelta(minutes=10)
    assert compose().parallel.timeout_minutes == 10  # the trainer's default too
    assert torch.backends.cuda.matmul.allow_tf32  # the model's fp32 matmuls (matmul_precision.py)


def test_user_settings_are_kept_under_either_spelling(clean_env):
    for name, value in (("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"), ("TORCH_NCCL_DUMP_ON_TIMEOUT", "0"),
                        ("TORCH_NCCL_TRACE_BUFFER_SIZE", "50")):
        clean_env.setenv(name, value)
    seen = group_created(clean_env, "cuda")
    assert nccl_env(seen["env"]) == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
                                     "TORCH_NCCL_TRACE_BUFFER_SIZE": "50"}


def test_a_deprecated_spelling_moves_to_the_current_name_with_its_value(clean_env):
    clean_env.setenv("NCCL_ASYNC_ERROR_HANDLING", "2")
    clean_env.setenv("NCCL_BLOCKING_WAIT", "1")
    env = group_created(clean_env, "cuda")["env"]
    assert not any(name in env for name in backend_env.RENAMED)
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2" and env["TORCH_NCCL_BLOCKING_WAIT"] == "1"


def test_a_gloo_group_gets_no_nccl_variables(clean_env):
    seen = group_created(clean_env, "cpu")
    assert seen["backend"] == "gloo" and nccl_env(seen["env"]) == {}


@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_flight_recorder_dumps_go_into_the_run_folder(clean_env, tmp_path, backend):
    clean_env.setattr(dist, "is_initialized", lambda: True)
    clean_env.setattr(dist, "get_backend", lambda group=None: backend)
    record_nccl_traces(str(tmp_path))
    if backend == "gloo":
        assert "TORCH_FR_DUMP_TEMP_FILE" not in os.environ and not (tmp_path / "nccl_traces").exists()
        return
    assert os.environ["TORCH_FR_DUMP_TEMP_FILE"] == str(tmp_path / "nccl_traces" / "rank_")
    assert (tmp_path / "nccl_traces").is_dir()


def test_a_dump_place_the_user_chose_is_kept(clean_env, tmp_path):
    clean_env.setattr(dist, "is_initialized", lambda: True)
    clean_env.setattr(dist, "get_backend", lambda group=None: "nccl")
    clean_env.setenv("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "/scratch/fr_")
    record_nccl_traces(str(tmp_path))
    assert "TORCH_FR_DUMP_TEMP_FILE" not in os.environ and not (tmp_path / "nccl_traces").exists()


# ---- gloo's network interface -----------------------------------------------------------------------------
def ipv4_interfaces() -> dict[str, str]:
    """{address: interface} from `ip -4 -o address` (the reference the derivation is checked against)."""
    if shutil.which("ip") is None:
        pytest.skip("no `ip` command")
    out = subprocess.run(["ip", "-4", "-o", "address"], capture_output=True, text=True, check=True).stdout
    return {fields[3].split("/")[0]: fields[1] for fields in (line.split() for line in out.splitlines())}


def loopback_interface() -> str:
    return ipv4_interfaces()["127.0.0.1"]


def test_gloo_binds_the_interface_that_reaches_master_addr(clean_env):
    cases = {"127.0.0.1": loopback_interface(), "127.0.0.2": loopback_interface()}  # lo holds all of 127/8
    cases.update({a: i for a, i in ipv4_interfaces().items() if not a.startswith("127.")})  # the first node itself
    for address, interface in cases.items():
        env = {"MASTER_ADDR": address, "WORLD_SIZE": "2"}
        use_gloo_interface(env)
        assert env["GLOO_SOCKET_IFNAME"] == interface, address


def test_a_chosen_interface_is_kept(clean_env):
    chosen = sorted(set(ipv4_interfaces().values()))[-1]  # an interface of this host, not the one use would pick
    env = {"MASTER_ADDR": "127.0.0.1", "WORLD_SIZE": "2", "GLOO_SOCKET_IFNAME": chosen}
    use_gloo_interface(env)
    assert env["GLOO_SOCKET_IFNAME"] == chosen


def test_a_chosen_interface_this_host_does_not_have_is_one_line(clean_env):
    """Every rank stopped in gloo's traceback 'Unable to find address for: bogus0' (NCCL: 'no socket interface
    found'); the line names the variable and this host's interfaces (socket.if_nameindex, read here by `ip`'s
    independent listing in /sys/class/net)."""
    here = sorted(n for n in os.listdir("/sys/class/net") if os.path.isdir(f"/sys/class/net/{n}"))
    for env, named in [({"GLOO_SOCKET_IFNAME": "bogus0"}, "named bogus0"),
                       ({"GLOO_SOCKET_IFNAME": f"{here[0]},bogus0"}, "named bogus0"),  # gloo: every name must exist
                       ({"NCCL_SOCKET_IFNAME": "bogus"}, "whose name starts with bogus"),
                       ({"NCCL_SOCKET_IFNAME": f"={here[0][:-1]}"}, f"named {here[0][:-1]}")]:  # `=`: exact names
        with pytest.raises(ValueError) as err:
            use_gloo_interface({"MASTER_ADDR": "127.0.0.1", "WORLD_SIZE": "2", **env}) if "GLOO_SOCKET_IFNAME" in env \
                else backend_env.use_nccl_environment(env)
        var, value = next(iter(env.items()))
        message = str(err.value)
        assert message.startswith(f"{var}={value}: this host") and f"no network interface {named};" in message
        assert sorted(message.split("its interfaces: ")[1].split(" (")[0].split(", ")) == here and "\n" not in message
    # what NCCL would find: a prefix of a name, a name, an exclusion list
    for value in (here[0][:1], here[0], f"={here[0]}", "^bogus"):
        backend_env.use_nccl_environment({"NCCL_SOCKET_IFNAME": value})


@pytest.mark.parametrize("launcher", [{"LOCAL_WORLD_SIZE": "8"}, {"SLURM_STEP_NUM_NODES": "2"}])
def test_a_multi_node_job_whose_master_is_loopback_here_is_refused_in_one_line(clean_env, launcher):
    env = {"MASTER_ADDR": "127.0.1.1", "WORLD_SIZE": "16", **launcher}  # Debian's /etc/hosts entry for the host name
    with pytest.raises(ValueError) as err:
        use_gloo_interface(env)
    message = str(err.value)
    assert message.startswith("MASTER_ADDR=127.0.1.1 is reached through the loopback interface")
    assert "GLOO_SOCKET_IFNAME" in message and "\n" not in message and "GLOO_SOCKET_IFNAME" not in env


def test_an_unresolvable_master_addr_is_one_line(clean_env):
    with pytest.raises(ValueError, match=r"^MASTER_ADDR=no-such-host.invalid has no IPv4 address here"):
        use_gloo_interface({"MASTER_ADDR": "no-such-host.invalid", "WORLD_SIZE": "2"})


def _gloo_rank(rank, port, queue):
    """A rank of a 2-process CPU job with MASTER_ADDR=127.0.0.2: the default group, then a second gloo group (the
    asynchronous checkpoints' kind), one all-reduce on each."""
    os.environ.pop("GLOO_SOCKET_IFNAME", None)
    os.environ.update(MASTER_ADDR="127.0.0.2", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2")
    from dit_train.parallel.fsdp import init_distributed, shutdown_process_group

    init_distributed(timeout_minutes=1)
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(minutes=1))
    sums = [torch.ones(1), torch.ones(1)]
    dist.all_reduce(sums[0])
    dist.all_reduce(sums[1], group=group)
    queue.put((rank, os.environ.get("GLOO_SOCKET_IFNAME"), [t.item() for t in sums]))
    shutdown_process_group()


def test_two_gloo_ranks_on_127_0_0_2_bind_the_loopback_interface():
    import torch.multiprocessing as mp

    from conftest import free_port

    ctx = mp.get_context("forkserver")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_gloo_rank, args=(r, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        results = sorted(queue.get(timeout=120) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert results == [(r, loopback_interface(), [2.0, 2.0]) for r in range(2)]


def test_an_nccl_job_names_the_interface_before_its_async_checkpoint_group(clean_env, tmp_path):
    """The GPU path: no gloo default group, so the interface is set where the one gloo group is created."""
    from dit_train.runs.checkpoint_saver import CheckpointSaver

    clean_env.setenv("MASTER_ADDR", "127.0.0.2")
    seen = {}
    clean_env.setattr(dist, "is_initialized", lambda: True)
    clean_env.setattr(dist, "new_group", lambda **kw: seen.update(kw, env=os.environ.get("GLOO_SOCKET_IFNAME")))
    CheckpointSaver(str(tmp_path), keep_last=0, asynchronous=True, log_metrics=lambda s, m: None)
    assert seen["backend"] == "gloo" and seen["env"] == loopback_interface()
