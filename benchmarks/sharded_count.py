"""What each rank of W dispatches in the sharded optimizer steps benchmarks/bench_distributed.py times, in order
(docs/cost_model.md, "Calibration on this host"): the distributed half of the counted model.

Counting: bench_distributed's setup on fake tensors under a fake process group of W ranks, this process rank r
(count_sharded_steps' `rank`): the model built on meta and sharded by apply_fsdp (every block, then the root), a
gradient on every parameter, build_optimizer with the contender's config (lr 1e-6, weight decay 0.01). One cycle of
CYCLE steps makes the state and workspaces; the next CYCLE steps are counted, each under an op_cost.OpCounter:
every dispatched op an OpRecord (packing, unpacking, the per-matrix ops on the local rows, the owner's NS5), and
every collective (c10d) a Collective with the bytes this rank sends under the optimizer's own rules
(optim/collectives.py: an all-reduce its tensor, an all-gather (W - 1) x its input, an all-to-all what goes to
other ranks). The optimizer's own count (ShardComm's timer.add_bytes) is kept beside it (`accounted`), so the two
can be compared (tests/unit/test_sharded_count.py). The order of ops, issues and waits (`events`) is what
benchmarks/sharded_schedule.py replays to price the step with the overlap the code has.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from benchmarks.op_cost import OpCounter

CYCLE = 3  # bench_distributed's steps per repetition (one periodic_rowwise K=3 cycle)
BENCH_BASE = {"lr": 1e-6, "weight_decay": 0.01}  # bench_distributed's hyperparameters


@dataclass(frozen=True)
class Collective:
    phase: str
    op: str  # all_reduce | all_gather | all_to_all
    sent: int  # bytes this rank sends, counted as ShardComm counts them
    tensor: int  # bytes of the tensor reduced (all_reduce), else == sent


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def collective_of(phase: str, name: str, args, world: int, rank: int = 0) -> Collective:
    """The Collective of a c10d call by its op name (allreduce_, _allgather_base_, alltoall_base_, ...)."""
    if name.startswith("allreduce"):
        tensors = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
        n = sum(map(_nbytes, tensors))
        return Collective(phase, "all_reduce", n, n)
    if "allgather" in name:
        n = (world - 1) * _nbytes(args[1])
        return Collective(phase, "all_gather", n, n)
    if name.startswith("alltoall"):
        inp, in_splits = args[1], list(args[4]) if len(args) > 4 and args[4] else []
        size = inp.element_size()
        sent = (sum(in_splits) - in_splits[rank]) * size if in_splits else _nbytes(inp) * (world - 1) // world
        return Collective(phase, "all_to_all", sent, sent)
    raise ValueError(f"no byte rule for the collective {name}")


class ShardedCounter(OpCounter):
    """An OpCounter that keeps collectives apart (`collectives`, with the bytes `rank` of `world` sends) and the
    order of everything (`events`): ("op", OpRecord), ("issue", i) of collectives[i], ("wait", i) where the
    optimizer waits for it (handles_tracked) or, for a blocking collective, right after its issue."""

    def __init__(self, world: int, rank: int = 0, **kwargs):
        super().__init__(**kwargs)
        self.world, self.rank = world, rank
        self.collectives: list[Collective] = []
        self.events: list[tuple] = []
        self.waited_later: set[int] = set()  # collectives whose handle the optimizer waits for later

    def reset(self) -> None:
        super().reset()
        self.collectives, self.events, self.waited_later = [], [], set()

    def issue(self, c: Collective) -> None:
        self.collectives.append(c)
        self.events.append(("issue", len(self.collectives) - 1))

    def _observe(self, func, args, kwargs, out) -> None:
        from benchmarks.dispatch_counter import kind_of

        if kind_of(func) == "collective" and self._region is None:
            self.issue(collective_of(self.current, func.__name__.split(".")[0], args, self.world, self.rank))
            return
        before = len(self.records)
        super()._observe(func, args, kwargs, out)
        self.events += [("op", rec) for rec in self.records[before:]]


class _Accounting:
    """The optimizer's timer during a count: its phase marks attribute the calls; the bytes ShardComm counts are
    kept per call (the reference the count is checked against)."""

    def __init__(self, counter: ShardedCounter):
        self.phase = counter.phase
        self.added: list[tuple[str, int]] = []

    def add_bytes(self, collective: str, nbytes: int) -> None:
        self.added.append((collective, nbytes))


@contextlib.contextmanager
def empty_all_to_alls_counted(counter: ShardedCounter):
    """memory_estimate.empty_all_to_all_inputs_allowed (the fake group refuses an all-to-all with an empty input
    and a non-empty output, which owner mode issues when this rank owns none of an exchange's matrices, and it
    skips them), with each skipped call recorded as the collective it is: it sends nothing, still waits for its
    peers."""
    import torch.distributed as dist

    from dit_train.parallel.memory_estimate import empty_all_to_all_inputs_allowed

    with empty_all_to_all_inputs_allowed():
        skipping = dist.all_to_all_single

        def all_to_all_single(output, input, *args, **kwargs):
            if input.numel() == 0:
                counter.issue(Collective(counter.current, "all_to_all", 0, 0))
            return skipping(output, input, *args, **kwargs)

        dist.all_to_all_single = all_to_all_single
        try:
            yield
        finally:
            dist.all_to_all_single = skipping


@contextlib.contextmanager
def handles_tracked(counter: ShardedCounter):
    """ShardComm's asynchronous collectives (all_reduce, all_gather, all_to_all) remember which counted collective
    their handle is, and ShardComm.wait records ("wait", i) for it; a collective issued otherwise (all_reduce_)
    blocks, and its wait is placed right after its issue."""
    from dit_train.optim.collectives import ShardComm

    real = {name: getattr(ShardComm, name) for name in ("all_reduce", "all_gather", "all_to_all", "wait")}
    handles: dict[int, int] = {}

    def started(name):
        def call(self, *args, **kwargs):
            work = real[name](self, *args, **kwargs)
            handles[id(work)] = len(counter.collectives) - 1
            counter.waited_later.add(len(counter.collectives) - 1)
            return work
        return call

    def wait(self, work, phases):
        counter.events.append(("wait", handles.pop(id(work))))
        return real["wait"](self, work, phases)

    for name in ("all_reduce", "all_gather", "all_to_all"):
        setattr(ShardComm, name, started(name))
    ShardComm.wait = wait
    try:
        yield
    finally:
        for name, fn in real.items():
            setattr(ShardComm, name, fn)


def with_blocking_waits(events: list[tuple], waited_later: set) -> list[tuple]:
    """The events with a wait right after the issue of every collective not waited for later (a blocking call)."""
    out = []
    for ev in events:
        out.append(ev)
        if ev[0] == "issue" and ev[1] not in waited_later:
            out.append(("wait", ev[1]))
    return out


def count_sharded_steps(model_cfg, optimizer: dict, world: int, steps: int = CYCLE,
                        rank: int = 0) -> list[SimpleNamespace]:
    """`rank`'s counted steps (after one warm-up cycle) of build_optimizer(model, BENCH_BASE + optimizer) on
    model_cfg's model sharded over a fake group of `world`: per step SimpleNamespace(records, collectives,
    accounted, events), accounted being ShardComm's own (collective, bytes) calls, events the ops, issues and
    waits in order (ShardedCounter)."""
    import torch.distributed as dist

    from dit_train.model.dit import build_model
    from dit_train.optim.registry import build_optimizer
    from dit_train.parallel.fsdp import ParallelPlan, apply_fsdp, fsdp_mesh
    from dit_train.parallel.memory_estimate import init_fake_process_group

    if dist.is_initialized():
        raise RuntimeError("count_sharded_steps makes its own fake process group: one is already initialised")
    init_fake_process_group(world, rank)
    try:
        counter = ShardedCounter(world, rank, allow_non_fake_inputs=True)
        plan = ParallelPlan(sharded=True)
        model = build_model(model_cfg, device="meta")
        apply_fsdp(model, model.blocks, plan, mesh=fsdp_mesh(plan, "cpu"))
        out = []
        with counter, empty_all_to_alls_counted(counter), handles_tracked(counter), torch.no_grad():
            model.to_empty(device="cpu")
            for p in model.parameters():
                p.grad = torch.zeros_like(p)
            opt = build_optimizer(model, {**BENCH_BASE, **optimizer})
            if getattr(opt, "compile_rownorm", None) == "auto":
                opt.compile_rownorm = False  # auto is eager on CPU, where bench_distributed runs
            timer = _Accounting(counter)
            opt.use_timer(timer)
            for _ in range(CYCLE):
                opt.step()
            for _ in range(steps):
                counter.reset()
                timer.added = []
                opt.step()
                out.append(SimpleNamespace(records=counter.records, collectives=counter.collectives,
                                           accounted=timer.added,
                                           events=with_blocking_waits(counter.events, counter.waited_later)))
        return out
    finally:
        dist.destroy_process_group()


def wire_seconds(c: Collective, world: int, link_bytes_s: float, latency_s: float) -> float:
    """A collective on gloo: its latency + what this rank puts on the wire at the measured rate (a ring
    all-reduce sends 2 (W - 1) / W of its tensor)."""
    wire = 2 * (world - 1) / world * c.tensor if c.op == "all_reduce" else c.sent
    return latency_s + wire / link_bytes_s
