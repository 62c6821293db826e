"""Count the operators and compiled kernels a step launches when part of it is torch.compile'd code
(benchmarks/host_overhead.py --compiled), where benchmarks/dispatch_counter.py cannot look: under an active
TorchDispatchMode compiled code falls back to eager.

The step runs under torch.profiler (CPU events only) with inductor's CPU kernels recording themselves
(torch._inductor.config.cpp.enable_kernel_profile, set by `kernel_events()` before anything is compiled). Counted,
by dispatch_counter's kinds:
  kernel      an inductor kernel (cpp_fused_* on CPU, triton_* on CUDA) or an operator that launches device work
  no_kernel   views and allocations
  collective  c10d / functional collectives
  sync        a device-to-host read
An operator is counted where a TorchDispatchMode would see it: a CompositeImplicitAutograd operator (aten::linear)
is not counted itself but through what it calls (t, addmm); calls made inside a counted operator (mm's
resolve_conj) are not counted again. tests/unit/test_launch_profile.py checks that the two counters agree on eager code.
Phases: the events inside a `phase(name)` range (record_function ranges named PREFIX + name) belong to it; the
rest to "other"."""

from __future__ import annotations

import contextlib
from collections import Counter

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from benchmarks.dispatch_counter import COLLECTIVE_NAMESPACES, NO_KERNEL

PREFIX = "phase:"
OP_NAMESPACES = {"aten", "prims", "fsdp", *COLLECTIVE_NAMESPACES}
KERNEL_MARKS = ("cpp_fused_", "triton_")  # inductor's generated kernels (graph_<i>_cpp_fused_... on CPU)


def kernel_events() -> None:
    """Make inductor's CPU kernels show in the profiler; call before the first compile."""
    import torch._inductor.config as inductor_config

    inductor_config.cpp.enable_kernel_profile = True


def _composite(name: str) -> str:
    """Which overloads of an operator (profiler name, no overload: "aten::linear") are CompositeImplicitAutograd,
    i.e. decomposed before a TorchDispatchMode sees anything: "all", "some" or "none"."""
    namespace, _, op = name.partition("::")
    packet = getattr(getattr(torch.ops, namespace, None), op, None)
    flags = []
    for o in packet.overloads() if packet is not None else ():
        try:
            flags.append(torch._C._dispatch_has_kernel_for_dispatch_key(
                name if o == "default" else f"{name}.{o}", "CompositeImplicitAutograd"))
        except RuntimeError:  # a TorchScript-only overload (aten::to.prim_Device): not in the dispatcher
            pass
    return "all" if flags and all(flags) else "some" if any(flags) else "none"


def _decomposed(event) -> bool:
    """Whether a TorchDispatchMode would see this operator event's children instead of it: every overload is
    composite (a no-op .to() dispatches nothing), or some are (aten::linear, not linear.out) and it called
    operators."""
    composite = _composite(event.name)
    return composite == "all" or (composite == "some" and any(kind_of_name(c.name) for c in event.cpu_children))


def kind_of_name(name: str) -> str | None:
    """dispatch_counter.kind_of for a profiler event's name; None for an event that is not an operator (a
    record_function range, an autograd node) or is an inductor kernel (see `count`)."""
    if any(mark in name for mark in KERNEL_MARKS):
        return "kernel"
    namespace, _, op = name.partition("::")
    if namespace not in OP_NAMESPACES or not op:
        return None
    if namespace in COLLECTIVE_NAMESPACES:
        return "collective"
    if op == "_local_scalar_dense":
        return "sync"
    packet = getattr(getattr(torch.ops, namespace, None), op, None)
    overloads = [getattr(packet, o) for o in packet.overloads()] if packet is not None else []
    if op in NO_KERNEL or any(o.is_view for o in overloads):
        return "no_kernel"
    return "kernel"


class LaunchProfile:
    """Profile a block of code and count its launches per phase: `calls` {phase: Counter(kind -> calls)}, `ops`
    {phase: Counter(event name -> calls)}."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        # inside_s / total_s: dispatch_counter's fields, here never filled (profiled time is not host time)
        self.calls, self.ops, self.inside_s, self.total_s = {}, {}, Counter(), Counter()

    @contextlib.contextmanager
    def phase(self, name: str):
        with record_function(PREFIX + name):
            yield

    @contextlib.contextmanager
    def profiling(self):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            yield
        self._count(prof.events())

    def _count(self, events) -> None:
        roots = [e for e in events if e.cpu_parent is None]
        for root in roots:
            self._visit(root, "other")

    def _visit(self, event, phase: str) -> None:
        name = event.name
        if name.startswith(PREFIX):
            phase = name[len(PREFIX):]
        kind = kind_of_name(name)
        if kind is not None and not _decomposed(event):
            self.calls.setdefault(phase, Counter())[kind] += 1
            self.ops.setdefault(phase, Counter())[name] += 1
            return
        for child in event.cpu_children:
            self._visit(child, phase)
