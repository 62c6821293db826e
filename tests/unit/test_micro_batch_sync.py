"""Gradient accumulation under FSDP2 reduce-scatters after every micro-batch (trainer/loop.py micro_batch_sync):
FSDP2's no-sync mode would keep the whole unsharded fp32 gradient on every rank until the last micro-batch (+56 GiB
at dit_15b). The memory estimate's bounds did not notice that mode switched on; this checks the flag itself, on a
fake process group of 2 ranks."""

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from dit_train.parallel.memory_estimate import init_fake_process_group
from dit_train.trainer.loop import micro_batch_sync


@pytest.fixture
def sharded_model():
    ours = not dist.is_initialized()  # a group left by another test in this worker is not ours to destroy
    init_fake_process_group(world_size=2)
    try:
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
        for layer in model:
            fully_shard(layer)
        fully_shard(model)
        yield model
    finally:
        if ours:
            dist.destroy_process_group()


def reduces_gradients(model) -> list[bool]:
    return [m._get_fsdp_state()._fsdp_param_group.reduce_grads for m in model.modules()
            if hasattr(m, "_get_fsdp_state") and m._get_fsdp_state()._fsdp_param_group is not None]


@pytest.mark.parametrize("last", [False, True])
def test_every_micro_batch_reduce_scatters_its_gradient(sharded_model, last):
    plan = SimpleNamespace(sharded=True, replicate=1)
    optimizer = torch.optim.SGD(sharded_model.parameters(), lr=0.1)
    micro_batch_sync(sharded_model, plan, optimizer, last=last)
    flags = reduces_gradients(sharded_model)
    assert len(flags) == 2 and all(flags)
