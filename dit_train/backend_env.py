"""Environment variables the NCCL process group reads, set before it is created where the user has not set them
(docs/scaling_out.md, "When a rank dies or hangs").

- TORCH_NCCL_ASYNC_ERROR_HANDLING=3: a collective that outlives parallel.timeout_minutes takes the process down
  (SIGABRT) without trying to abort the communicators, which can hang on a broken network. It is torch's own
  default, set explicitly so that a run started by srun alone behaves as documented; torchrun sets 1 (abort the
  communicators first, then the process) for its workers, which is kept. The deprecated spelling
  NCCL_ASYNC_ERROR_HANDLING (and NCCL_BLOCKING_WAIT, NCCL_DESYNC_DEBUG) is moved to the current name, its value
  kept: torch warns about the old one on every rank.
- The flight recorder: the last TORCH_FR_BUFFER_SIZE collectives of every rank, written on a timeout
  (TORCH_NCCL_DUMP_ON_TIMEOUT) to TORCH_FR_DUMP_TEMP_FILE<rank>, which `record_nccl_traces` points into the run
  folder once it is known (torch opens the file at the first dump). `python -m torch.distributed.flight_recorder.fr_trace
  <folder>` then says which collective which rank was stuck in.
"""

from __future__ import annotations

import os

import torch.distributed as dist

# current name -> the older spellings torch still reads
NCCL_ALIASES = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": ("NCCL_ASYNC_ERROR_HANDLING",),
    "TORCH_NCCL_BLOCKING_WAIT": ("NCCL_BLOCKING_WAIT",),
    "TORCH_NCCL_DESYNC_DEBUG": ("NCCL_DESYNC_DEBUG",),
    "TORCH_FR_BUFFER_SIZE": ("TORCH_NCCL_TRACE_BUFFER_SIZE",),
    "TORCH_FR_DUMP_TEMP_FILE": ("TORCH_NCCL_DEBUG_INFO_TEMP_FILE",),
}
DEPRECATED = ("NCCL_ASYNC_ERROR_HANDLING", "NCCL_BLOCKING_WAIT", "NCCL_DESYNC_DEBUG")  # torch warns about these
NCCL_DEFAULTS = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1", "TORCH_FR_BUFFER_SIZE": "2000"}
TRACE_FOLDER = "nccl_traces"


def _is_set(environ, name: str) -> bool:
    return any(n in environ for n in (name, *NCCL_ALIASES.get(name, ())))


def use_nccl_environment(environ=os.environ) -> None:
    """Before the NCCL group is created: the deprecated spellings renamed (values kept), then NCCL_DEFAULTS for
    what neither spelling sets."""
    for current, old in NCCL_ALIASES.items():
        for name in old:
            if name in DEPRECATED and name in environ:
                value = environ.pop(name)
                environ.setdefault(current, value)
    for name, value in NCCL_DEFAULTS.items():
        if not _is_set(environ, name):
            environ[name] = value


def record_nccl_traces(run_dir: str, environ=os.environ) -> None:
    """Every rank, once the run folder is agreed: an NCCL group's flight-recorder dumps go to
    run_dir/nccl_traces/rank_<rank> (unless the user chose a place). Nothing for other backends."""
    if not dist.is_initialized() or dist.get_backend() != "nccl" or _is_set(environ, "TORCH_FR_DUMP_TEMP_FILE"):
        return
    folder = os.path.join(run_dir, TRACE_FOLDER)
    os.makedirs(folder, exist_ok=True)
    environ["TORCH_FR_DUMP_TEMP_FILE"] = os.path.join(folder, "rank_")
