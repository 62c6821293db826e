"""Default run-folder names that stay unique when many jobs start in the same second (a Slurm job array does):
the time stamp gets the Slurm job (and array task) id when there is one and a few random hex digits always."""

from __future__ import annotations

import functools
import os
import secrets


@functools.lru_cache(maxsize=None)  # one value per process: Hydra may resolve the folder name more than once
def run_suffix() -> str:
    env = os.environ
    job = env.get("SLURM_ARRAY_JOB_ID") or env.get("SLURM_JOB_ID")
    task = env.get("SLURM_ARRAY_TASK_ID")
    slurm = f"j{job}{'_' + task if task else ''}-" if job else ""
    return slurm + secrets.token_hex(3)
