"""The environment the NCCL process group is created with (dit_train/backend_env.py, docs/scaling_out.md "When a
rank dies or hangs"): the current variable names only, torch's take-the-process-down error handling, the flight
recorder dumping on a timeout into the run folder, user settings kept. No GPU here: init_process_group is patched to
record what it would have been given."""

import datetime
import os

import pytest
import torch
import torch.distributed as dist

from conftest import compose
from dit_train import backend_env
from dit_train.backend_env import record_nccl_traces
from dit_train.parallel import init_distributed

NAMES = sorted({*backend_env.NCCL_DEFAULTS, *backend_env.NCCL_ALIASES,
                *(n for old in backend_env.NCCL_ALIASES.values() for n in old)})


@pytest.fixture
def clean_env(monkeypatch):
    """None of the NCCL variables set (all restored afterwards), a 2-rank torchrun environment, TF32 flags restored."""
    for name in NAMES:
        monkeypatch.delenv(name, raising=False)
    for name, value in (("WORLD_SIZE", "2"), ("RANK", "0"), ("LOCAL_RANK", "0")):
        monkeypatch.setenv(name, value)
    before = torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision
    yield monkeypatch
    torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision = before


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
    assert torch.backends.cuda.matmul.fp32_precision == "tf32"  # the model's fp32 matmuls (matmul_precision.py)


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
    assert not any(name in env for name in backend_env.DEPRECATED)
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
