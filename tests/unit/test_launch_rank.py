"""This process's rank as its launcher set it, before any process group: torchrun's RANK, else srun's
SLURM_PROCID, else 0."""

import pytest

from dit_train.parallel.launch_rank import launch_rank


@pytest.mark.parametrize("environ, rank", [({}, 0), ({"RANK": "0"}, 0), ({"RANK": "3"}, 3),
                                           ({"SLURM_PROCID": "5"}, 5), ({"RANK": "2", "SLURM_PROCID": "7"}, 2)])
def test_launch_rank(environ, rank):
    assert launch_rank(environ) == rank
