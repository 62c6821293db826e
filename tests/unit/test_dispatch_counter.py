"""benchmarks/dispatch_counter.py, the operator counter of benchmarks/host_overhead.py, on a model small enough to
count by hand: Linear(4, 8) -> ReLU -> sum, forward and backward."""

import torch
from torch import nn

from benchmarks.dispatch_counter import DispatchCounter, FakeDispatchCounter, kind_of, per_call_overhead_s

# forward: t (view), addmm, relu, sum; backward: ones_like (the seed), expand (view), threshold_backward, mm (weight
# grad), sum (bias grad), view, t (views); AccumulateGrad's detach per parameter (views)
HAND_KERNELS = {"addmm", "relu", "sum", "ones_like", "threshold_backward", "mm"}


def step(model, x):
    model.zero_grad(set_to_none=True)
    model(x).sum().backward()


def counted(counter, make):
    with counter:
        model, x = make()
        step(model, x)  # warm-up: first-call work out of the count
        counter.reset()
        with counter.phase("step"):
            step(model, x)
    return counter


def make():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU()), torch.randn(2, 4)


def test_kernels_are_the_hand_count():
    c = counted(DispatchCounter(), make)
    kernels = {op.split(".")[0] for op in c.ops["step"] if c.kinds[op] == "kernel"}
    assert kernels == HAND_KERNELS
    assert c.calls["step"]["kernel"] == 7  # sum twice: the loss and the bias gradient
    assert c.calls["step"]["no_kernel"] > 0 and "collective" not in c.calls["step"]


def test_fake_tensors_dispatch_what_real_tensors_do():
    """The full-size estimate runs on fake tensors: the same step must count the same operators as on real ones
    (the fake tensors' property queries, prim::device, are not counted)."""
    real = counted(DispatchCounter(), make)
    fake = counted(FakeDispatchCounter(), make)
    assert fake.ops["step"] == real.ops["step"]
    assert fake.total_s["step"] >= fake.inside_s["step"] > 0


def test_collectives_and_syncs_are_told_apart():
    assert kind_of(torch.ops.c10d.allreduce_.default) == "collective"
    assert kind_of(torch.ops.aten._local_scalar_dense.default) == "sync"
    assert kind_of(torch.ops.aten.view.default) == "no_kernel"
    assert kind_of(torch.ops.aten.mul.Tensor) == "kernel"


def test_per_call_overhead_is_small_and_positive():
    assert 0 <= per_call_overhead_s(DispatchCounter, calls=200) < 1e-3
