"""benchmarks/launch_profile.py, the launch counter of compiled steps (host_overhead.py --compiled): on eager code it
counts what the TorchDispatchMode counter (benchmarks/dispatch_counter.py) counts; a compiled elementwise chain is
one fused kernel."""

from collections import Counter

import torch
from torch import nn

from benchmarks.dispatch_counter import DispatchCounter
from benchmarks.launch_profile import LaunchProfile, kernel_events


def step(model, x):
    model.zero_grad(set_to_none=True)
    model(x).sum().backward()


def make():
    torch.manual_seed(0)
    return nn.Sequential(nn.LayerNorm(4), nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4)), torch.randn(2, 4)


def test_eager_counts_equal_the_dispatch_counters():
    model, x = make()
    step(model, x)  # warm-up
    dispatch = DispatchCounter()
    with dispatch, dispatch.phase("step"):
        step(model, x)
    profiled = LaunchProfile()
    with profiled.profiling(), profiled.phase("step"):
        step(model, x)
    assert profiled.calls["step"] == dispatch.calls["step"]
    by_op = Counter()  # the dispatch counter names overloads (sum.default, sum.dim_IntList), the profiler does not
    for name, n in dispatch.ops["step"].items():
        by_op[name.split(".")[0]] += n
    assert Counter({name.split("::")[1]: n for name, n in profiled.ops["step"].items()}) == by_op


def test_a_compiled_elementwise_chain_is_one_fused_kernel():
    kernel_events()
    f = torch.compile(lambda x: (x * 2 + 1).relu().sin())
    x = torch.randn(64)
    f(x)
    profiled = LaunchProfile()
    with profiled.profiling(), profiled.phase("f"):
        f(x)
    assert profiled.calls["f"]["kernel"] == 1, profiled.ops["f"]
    assert all("cpp_fused" in name for name, _ in profiled.ops["f"].items() if profiled.calls["f"]["kernel"])
