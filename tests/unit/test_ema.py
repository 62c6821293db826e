"""The EMA update against a hand computation: decay min(decay, (1 + n) / (10 + n)) after the n-th update."""

import pytest
import torch

from dit_train.diffusion.ema import EMA


def test_ema_follows_the_warm_up_formula_by_hand():
    model = torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    ema = EMA(model, decay=0.5)
    expected = 1.0
    for n, value in enumerate([3.0, -2.0, 7.0, 0.5, 4.0], start=1):
        with torch.no_grad():
            model.weight.fill_(value)
        ema.update(model)
        d = min(0.5, (1 + n) / (10 + n))  # 2/11, 3/12, 4/13, 5/14, then the cap 0.5
        expected = d * expected + (1 - d) * value
        assert ema.num_updates == n
        assert ema.model.weight.item() == pytest.approx(expected, rel=1e-6), n
    assert ema.model.weight.item() == pytest.approx(3.1839160839, rel=1e-6)  # the same numbers, written out



def test_a_given_shadow_starts_from_the_models_weights():
    """The FSDP2 path builds the average's module itself (`shadow`, freshly initialised): EMA sets it to the
    model's weights and buffers, so the first updates average from the model, not from the shadow's own init."""
    torch.manual_seed(0)
    model, shadow = torch.nn.BatchNorm1d(3), torch.nn.BatchNorm1d(3)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([1.0, 2.0, 3.0]))
        model.running_mean.fill_(5.0)
    ema = EMA(model, decay=0.9, shadow=shadow)
    assert ema.model is shadow and not ema.model.training
    assert torch.equal(shadow.weight, model.weight) and torch.equal(shadow.running_mean, model.running_mean)
    ema.update(model)  # unchanged weights stay put
    assert torch.equal(shadow.weight, model.weight)


def test_sharded_update_averages_the_local_shards_in_one_dispatched_lerp():
    """Under FSDP2 the parameters are DTensors: the update averages each rank's local shard in place, as the hand
    formula says, and dispatches nothing but the one foreach lerp (before: a view and a detach per parameter,
    ~1,200 host calls per step at dit_15b)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from benchmarks.dispatch_counter import DispatchCounter
    from dit_train.parallel.memory_estimate import init_fake_process_group

    assert not dist.is_initialized()
    init_fake_process_group(2)
    try:
        mesh = init_device_mesh("cpu", (2,))

        def sharded(*rows):  # this rank's shards, as FSDP2 holds them: Parameter(DTensor)
            module = torch.nn.Module()
            for i, r in enumerate(rows):
                local_rows = torch.full((r, 3), float(i + 1))
                module.register_parameter(f"w{i}", torch.nn.Parameter(
                    DTensor.from_local(local_rows, mesh, [Shard(0)], run_check=False)))
            return module

        model, shadow = sharded(2, 1, 3), sharded(2, 1, 3)
        ema = EMA(model, decay=0.5, shadow=shadow.requires_grad_(False))
        with torch.no_grad():
            for p in model.parameters():
                p.to_local().fill_(5.0)
        counter = DispatchCounter()
        with counter, counter.phase("update"):
            ema.update(model)
        assert dict(counter.ops["update"]) == {"_foreach_lerp_.Scalar": 1}
        d = 2 / 11  # min(0.5, (1 + 1) / (10 + 1))
        for i, e in enumerate(ema.model.parameters()):
            assert isinstance(e, DTensor)
            assert torch.allclose(e.to_local(), torch.full_like(e.to_local(), d * (i + 1) + (1 - d) * 5.0))
    finally:
        dist.destroy_process_group()
