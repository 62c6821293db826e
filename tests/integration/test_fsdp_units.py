"""parallel.blocks_per_fsdp_unit on CPU/gloo: 2 ranks with two of the three blocks in one FSDP2 unit (the last unit
holding the remaining block) train exactly as with one block per unit, and as the single process of the same
global batch; a checkpoint written with units of 2 resumes with units of 1 (the units are not in the checkpoint).

One module fixture makes the runs: the single-process reference in this process, one 2-rank spawn for the rest.
"""

import json
from unittest import mock

import pytest

from conftest import compose, needs_fashion
from test_fsdp_train import TINY, assert_close, losses
from test_sharded_optim import spawn

pytestmark = needs_fashion

THREE_BLOCKS = [o for o in TINY if not o.startswith("model.depth=")] + ["model.depth=3"]


def train_jobs(rank, world, jobs):
    """Each job's run, with what it handed to fully_shard recorded (modules per call) in its run folder."""
    import torch.distributed.fsdp as fsdp

    from dit_train.trainer.loop import run

    real = fsdp.fully_shard
    for overrides in jobs:
        calls = []

        def spy(module, **kwargs):
            calls.append(len(module) if isinstance(module, list) else 1)
            return real(module, **kwargs)

        with mock.patch.object(fsdp, "fully_shard", spy):
            run(compose(overrides))
        if rank == 0:
            run_dir = next(o.split("=", 1)[1] for o in overrides if o.startswith("run_dir="))
            with open(f"{run_dir}/fully_shard_calls.json", "w") as f:
                json.dump(calls, f)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("fsdp_units")
    from dit_train.trainer.loop import run

    run(compose(THREE_BLOCKS + [f"run_dir={root / 'single'}"]))
    ck2 = root / "units_of_2" / "checkpoints" / "step_00000002.dcp"
    spawn(train_jobs, 2, [THREE_BLOCKS + [f"run_dir={root / 'units_of_1'}"],
                          THREE_BLOCKS + [f"run_dir={root / 'units_of_2'}", "parallel.blocks_per_fsdp_unit=2"],
                          THREE_BLOCKS + [f"run_dir={root / 'resumed_as_1'}", f"train.resume={ck2}"]])
    return {k: root / k for k in ("single", "units_of_1", "units_of_2", "resumed_as_1")}


def test_the_units_are_what_fully_shard_was_given(runs):
    """The trained model and the EMA shadow: per unit one call, then the root (the model itself)."""
    read = lambda name: json.loads((runs[name] / "fully_shard_calls.json").read_text())
    assert read("units_of_1") == [1, 1, 1, 1] * 2
    assert read("units_of_2") == [2, 1, 1] * 2  # three blocks by two: the last unit holds the third


def test_two_blocks_per_unit_train_as_one_block_per_unit_and_as_one_process(runs):
    for key in ("train/loss", "train/grad_norm", "val/loss"):
        # the same gradients summed over the same two ranks, in one reduce-scatter per unit instead of per block
        assert losses(runs["units_of_2"], key) == losses(runs["units_of_1"], key), key
        assert_close(losses(runs["units_of_2"], key), losses(runs["single"], key), rtol=1e-5)


def test_a_checkpoint_of_units_of_2_resumes_with_units_of_1(runs):
    assert losses(runs["resumed_as_1"]) == {k: v for k, v in losses(runs["units_of_2"]).items() if k > 2}
    assert losses(runs["resumed_as_1"], "val/loss") == {4: losses(runs["units_of_2"], "val/loss")[4]}
