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


@functools.lru_cache(maxsize=None)  # one value per submitting process: every job of the sweep under one folder
def submission_id() -> str:
    """The folder of one submission's submitit files (launcher=slurm: <sweep>/.submitit/<this>/%j): a name no
    folder from elsewhere can already hold. submitit's submitting process unpickles <folder>/<job id>_<task>_
    result.pkl with plain pickle as soon as that file exists, so in a sweep folder handed over, pickles planted
    under `.submitit/<job id>/` for the cluster's next job ids ran as code in the user's process."""
    return secrets.token_hex(8)
