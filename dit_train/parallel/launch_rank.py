"""This process's rank as its launcher set it, read before any process group exists: torchrun's RANK, else srun's
SLURM_PROCID (srun without torchrun), else 0. Torch-free: the command line's check runs before torch is imported."""

from __future__ import annotations

import os


def launch_rank(environ=os.environ) -> int:
    return int(environ.get("RANK", environ.get("SLURM_PROCID", "0")))
