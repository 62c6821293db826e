"""Count the operators a piece of eager PyTorch code dispatches, and the host thread's CPU time spent inside them, to
estimate its host cost on a GPU without one (benchmarks/host_overhead.py).

Every top-level aten/c10d call is counted once, by kind:
  kernel      an operator that launches device work (elementwise, GEMM, reductions, copies, foreach ops)
  no_kernel   views and allocations: metadata only on a GPU (no launch)
  collective  c10d / functional collectives (a NCCL launch each)
  sync        a device-to-host read (.item(), .tolist(): aten._local_scalar_dense)
Calls made while handling another call (a fake tensor's decompositions) are not counted again.

DispatchCounter counts on real tensors; FakeDispatchCounter is a FakeTensorMode that counts, so meta-built FSDP2
models can be stepped at full size (after DTensor has unwrapped its local shards, so the count is per rank).
Time is the thread's CPU time (time.thread_time: a loaded machine does not inflate it)."""

from __future__ import annotations

import contextlib
import time
from collections import Counter

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

KINDS = ("kernel", "no_kernel", "collective", "sync")
NO_KERNEL = {"empty", "empty_strided", "new_empty", "new_empty_strided", "empty_like", "detach", "lift_fresh",
             "alias", "_unsafe_view", "set_", "_has_compatible_shallow_copy_type", "resize_", "promote_types",
             "_record_function_enter_new", "_record_function_exit"}  # the last two: profiler ranges, host only
COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional", "_c10d_functional_autograd")


def _is_metadata_query(func) -> bool:
    """prim::device and the like: fake tensors answer property queries through the dispatcher, real ones do not."""
    return func._schema.name.startswith("prim::")


def kind_of(func) -> str:
    name = func._schema.name  # "aten::mul.Tensor" -> namespace "aten", op "mul"
    namespace, op = name.split("::")[0], func.__name__.split(".")[0]
    if namespace in COLLECTIVE_NAMESPACES:
        return "collective"
    if op == "_local_scalar_dense":
        return "sync"
    if func.is_view or op in NO_KERNEL:
        return "no_kernel"
    return "kernel"


class _Counting:
    """Counts per phase: calls {phase: Counter(kind -> calls)}, ops {phase: Counter(op name -> calls)}, inside_s
    {phase: thread CPU seconds inside the counted calls}, total_s {phase: thread CPU seconds of the phase}; kinds
    {op name: kind}."""

    def _reset_counts(self) -> None:
        self.calls, self.ops, self.inside_s, self.total_s, self.kinds = {}, {}, Counter(), Counter(), {}
        self.current, self._depth = "other", 0

    @contextlib.contextmanager
    def phase(self, name: str):
        """Attribute the calls made inside, and the thread time, to `name` (phases do not nest)."""
        self.current, start = name, time.thread_time()
        try:
            yield
        finally:
            self.total_s[name] += time.thread_time() - start
            self.current = "other"

    def _observe(self, func, args, kwargs, out) -> None:
        """Called once per counted call with its arguments and result (a subclass records what it needs:
        benchmarks/op_cost.py, the bytes and FLOPs of each call); nothing here."""

    def _counted(self, func, call, args=(), kwargs=None):
        if self._depth:
            return call()
        self._depth += 1
        start = time.thread_time()
        try:
            out = call()
        finally:
            elapsed = time.thread_time() - start
            self._depth -= 1
        self.inside_s[self.current] += elapsed
        if out is not NotImplemented and not _is_metadata_query(func):
            # NotImplemented: a tensor subclass (DTensor) unwraps and dispatches again
            kind = self.kinds[func.__name__] = kind_of(func)
            self.calls.setdefault(self.current, Counter())[kind] += 1
            self.ops.setdefault(self.current, Counter())[func.__name__] += 1
            self._observe(func, args, kwargs or {}, out)
        return out


class DispatchCounter(_Counting, TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self._reset_counts()

    def reset(self) -> None:
        self._reset_counts()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self._counted(func, lambda: func(*args, **(kwargs or {})), args, kwargs)


class FakeDispatchCounter(_Counting, FakeTensorMode):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._reset_counts()

    def reset(self) -> None:
        self._reset_counts()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self._counted(func, lambda: FakeTensorMode.__torch_dispatch__(self, func, types, args, kwargs), args,
                             kwargs)


def per_call_overhead_s(counter_cls=FakeDispatchCounter, calls: int = 2000) -> float:
    """Thread CPU seconds a counted call spends outside the counted window (entering the Python mode, wrapping its
    arguments): an artefact of counting, subtracted from the Python time measured around counted code."""
    counter = counter_cls()
    with counter:
        a, b = torch.ones(8), torch.ones(8)
        for _ in range(50):  # warm caches
            a.add(b)
        counter.reset()
        with counter.phase("probe"):
            for _ in range(calls):
                a.add(b)
    # the probe loop's own Python (a for loop and an attribute call, ~0.1 us) is counted as artefact too: a bias
    # towards a smaller host estimate of that size per op
    return max(0.0, (counter.total_s["probe"] - counter.inside_s["probe"]) / calls)
