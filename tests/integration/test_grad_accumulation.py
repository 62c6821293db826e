"""Gradient accumulation (train.micro_batch_size): micro-batches of one rank's batch give the same training as the
whole batch at once, in one process and on 2 gloo ranks (FSDP2 reduce-scatters after the last micro-batch only)."""

import pytest

from conftest import compose, needs_fashion
from test_fsdp_train import TINY, assert_close, losses, spawn

pytestmark = needs_fashion


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from dit_train.trainer.loop import run

    root = tmp_path_factory.mktemp("accumulation")
    out = {k: root / k for k in ("whole", "micro", "two_micro")}
    run(compose(TINY + [f"run_dir={out['whole']}"]))
    run(compose(TINY + [f"run_dir={out['micro']}", "train.micro_batch_size=4"]))  # 12 images in 3 micro-batches
    spawn(2, [[f"run_dir={out['two_micro']}", "train.micro_batch_size=2"]])  # 6 per rank in 3 micro-batches
    return out


def test_micro_batches_equal_the_whole_batch_in_one_process(runs):
    for key in ("train/loss", "train/grad_norm", "val/loss"):
        assert_close(losses(runs["micro"], key), losses(runs["whole"], key), rtol=1e-5)


def test_micro_batches_on_two_ranks_equal_the_whole_batch(runs):
    for key in ("train/loss", "train/grad_norm", "val/loss"):
        assert_close(losses(runs["two_micro"], key), losses(runs["whole"], key), rtol=1e-5)


def test_a_micro_batch_that_does_not_divide_the_rank_batch_is_one_line():
    from dit_train.config import ConfigError, validate

    cfg = compose(TINY + ["run_dir=/tmp/unused", "train.micro_batch_size=4"])
    with pytest.raises(ConfigError, match=r"train.micro_batch_size=4 is not valid: must divide the per-rank batch 6"):
        validate(cfg, world_size=2)
