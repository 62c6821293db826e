"""What each rank of W dispatches in a sharded optimizer step, in order (docs/cost_model.md): the distributed half
of the counted model, for bench_distributed's lines on this host (--calibrate) and the paper's table (--paper).

Counting: the model built on meta and sharded by apply_fsdp (every block, then the root) over a fake process group
of W ranks, this process rank r (`rank`: its dim-0 shards; rank 0 holds the largest), a gradient on every
parameter, build_optimizer with the contender's config (lr 1e-6, weight decay 0.01), stepped on fake tensors under
an op_cost.OpCounter: every dispatched op an OpRecord (packing, unpacking, the per-matrix ops on the local rows, the
owner's NS5), and every collective (c10d) a Collective with the bytes this rank sends under the optimizer's own
rules (optim/collectives.py: an all-reduce its tensor, an all-gather (W - 1) x its input, an all-to-all what goes
to other ranks, per destination). The optimizer's own count (ShardComm's timer.add_bytes) is kept beside it
(`accounted`), so the two can be compared (tests/unit/test_sharded_count.py). The order of ops, issues and waits
(`events`) is what benchmarks/sharded_schedule.py replays, at this host's rates or a GPU's.

Two ways to count: count_sharded_steps (bench_distributed's cycle: CYCLE warm-up steps, then CYCLE counted, as it
runs on CPU) and count_step_kinds (one step of each kind, refresh or RowNorm, of several contenders on one sharded
model; gpu=True: the CUDA path, compile_rownorm auto compiled and counted as fused regions, whole-matrix workspaces
not kept).
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
    to: tuple = ()  # all_to_all: bytes this rank sends to each rank (0 to itself)


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
        to = [n * inp.element_size() for n in in_splits] if in_splits else [_nbytes(inp) // world] * world
        to[rank] = 0
        return Collective(phase, "all_to_all", sum(to), sum(to), tuple(to))
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

    @contextlib.contextmanager
    def fused(self, name: str, elements: int = 0):
        """OpCounter.fused, its one record an event where the region ends (a compiled kernel runs there)."""
        before = len(self.records)
        with super().fused(name, elements):
            yield
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
                counter.issue(Collective(counter.current, "all_to_all", 0, 0, (0,) * counter.world))
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


@contextlib.contextmanager
def fake_sharded_model(model_cfg, world: int, rank: int, counter: ShardedCounter, gpu: bool = False):
    """model_cfg's model on fake tensors, sharded as `rank` of a fake group of `world`, with a gradient on every
    parameter, inside the counter with its collectives' issues and waits tracked (and, gpu=True, torch.compile
    counted as fused regions)."""
    import torch.distributed as dist

    from benchmarks.op_cost import compiled_as_fused
    from dit_train.model.dit import build_model
    from dit_train.parallel.fsdp import ParallelPlan, apply_fsdp, fsdp_mesh
    from dit_train.parallel.memory_estimate import init_fake_process_group

    if dist.is_initialized():
        raise RuntimeError("a sharded count makes its own fake process group: one is already initialised")
    init_fake_process_group(world, rank)
    try:
        plan = ParallelPlan(sharded=True)
        model = build_model(model_cfg, device="meta")
        apply_fsdp(model, model.blocks, plan, mesh=fsdp_mesh(plan, "cpu"))
        with contextlib.ExitStack() as stack:
            for cm in (counter, empty_all_to_alls_counted(counter), handles_tracked(counter), torch.no_grad()):
                stack.enter_context(cm)
            if gpu:
                stack.enter_context(compiled_as_fused(counter))
            model.to_empty(device="cpu")
            for p in model.parameters():
                p.grad = torch.zeros_like(p)
            yield model
    finally:
        dist.destroy_process_group()


def optimizer_under_count(model, optimizer: dict, counter: ShardedCounter, gpu: bool = False):
    """(build_optimizer(model, BENCH_BASE + optimizer), its accounting timer): as it runs on CPU (compile_rownorm
    auto resolves to eager on CPU tensors, as bench_distributed runs it), or gpu=True as it runs on CUDA, where auto
    compiles the RowNorm passes and the whole-matrix workspaces are not kept between steps."""
    from dit_train.optim.directions import RowNorm
    from dit_train.optim.registry import build_optimizer

    opt = build_optimizer(model, {**BENCH_BASE, **optimizer})
    if gpu and hasattr(opt, "directions"):
        opt.keep_whole_matrix_workspaces = False
        if optimizer.get("compile_rownorm", "auto") == "auto":
            opt.compile_rownorm = any(isinstance(d, RowNorm) for d in opt.directions.values())
    timer = _Accounting(counter)
    opt.use_timer(timer)
    return opt, timer


def counted_step(opt, counter: ShardedCounter, timer: _Accounting) -> SimpleNamespace:
    """One counted step: SimpleNamespace(records, collectives, accounted, events); the counter is reset after it
    too, so that uncounted steps do not add to its lists."""
    counter.reset()
    timer.added = []
    opt.step()
    out = SimpleNamespace(records=counter.records, collectives=counter.collectives, accounted=timer.added,
                          events=with_blocking_waits(counter.events, counter.waited_later))
    counter.reset()
    timer.added = []
    return out


def count_sharded_steps(model_cfg, optimizer: dict, world: int, steps: int = CYCLE,
                        rank: int = 0) -> list[SimpleNamespace]:
    """`rank`'s counted steps (after one warm-up cycle) of build_optimizer(model, BENCH_BASE + optimizer) on
    model_cfg's model sharded over a fake group of `world`, as bench_distributed runs them on CPU: per step
    SimpleNamespace(records, collectives, accounted, events), accounted being ShardComm's own (collective, bytes)
    calls, events the ops, issues and waits in order (ShardedCounter)."""
    counter = ShardedCounter(world, rank, allow_non_fake_inputs=True)
    with fake_sharded_model(model_cfg, world, rank, counter) as model:
        opt, timer = optimizer_under_count(model, optimizer, counter)
        for _ in range(CYCLE):
            opt.step()
        return [counted_step(opt, counter, timer) for _ in range(steps)]


STEP_OF_KIND = {"refresh": 0, "rownorm": 1}  # a periodic optimizer's step index of each kind (refresh at 0 mod K)


def count_step_kinds(model_cfg, contenders: dict, world: int, rank: int = 0,
                     gpu: bool = False) -> dict[object, SimpleNamespace]:
    """For contenders {label: (optimizer config, step kinds)}, on one sharded model: `rank`'s counted step of each
    kind ('refresh': NS5, 'rownorm'; 'adamw'), set through the matrix groups' step index as op_cost.count_steps
    sets it, after one warm-up step of each kind. Per label SimpleNamespace(steps={kind: counted_step}, owned):
    owned[r] the NS5 flops rank r computes in owner mode by the optimizer's own assignment (its cached exchange
    plan, the same on every rank), else None."""
    from dit_train.optim.directions import ns5_flops

    counter = ShardedCounter(world, rank, allow_non_fake_inputs=True)
    out = {}
    with fake_sharded_model(model_cfg, world, rank, counter, gpu) as model:
        for label, (optimizer, kinds) in contenders.items():
            opt, timer = optimizer_under_count(model, optimizer, counter, gpu)
            steps = {}
            for counted in (False, True):
                for kind in kinds:
                    for group in opt.param_groups:
                        if group.get("kind") == "matrix":
                            group["step"] = STEP_OF_KIND.get(kind, 0)
                    if counted:
                        steps[kind] = counted_step(opt, counter, timer)
                    else:
                        opt.step()
                        counter.reset()
            cache = opt.__dict__.get("_exchange_cache")
            owned = None if cache is None else [sum(ex.counts[r] * ns5_flops(*ex.key[0]) for ex in cache[1])
                                                for r in range(world)]
            out[label] = SimpleNamespace(steps=steps, owned=owned)
            del opt
    return out


def wire_bytes(c: Collective, world: int) -> float:
    """What this rank puts on the wire in a collective: a ring all-reduce sends 2 (W - 1) / W of its tensor, the
    others what they count as sent."""
    return 2 * (world - 1) / world * c.tensor if c.op == "all_reduce" else c.sent


def wire_seconds(c: Collective, world: int, link_bytes_s: float, latency_s: float) -> float:
    """A collective on gloo: its latency + what this rank puts on the wire at the measured rate."""
    return latency_s + wire_bytes(c, world) / link_bytes_s
