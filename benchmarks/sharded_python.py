"""The Python a sharded optimizer step spends per dispatched op on this host, with compute removed: a rate of the
host profile (`python -m benchmarks.cost_model --measure-host`, its "python" entry) that the distributed calibration
lines price every counted op with, on top of op_cost's rates (whose fixed cost per op is a bare 8-element add:
~1 us, which does not see the owner exchange's per-matrix Python: plans, splits, views, handles, phase switches).

Method (host_overhead.py's shrunk step): bench_distributed's setup (apply_fsdp, build_optimizer with the
contender's config) on rank 0 of a fake process group of W, on real tensors, the model shrunk to 4 channels per
head (same blocks, same matrices and exchanges, next to no arithmetic). Each step runs under a DispatchCounter with
the optimizer's phase marks: per phase class, the thread CPU time less the time inside the dispatched operators
less the counter's own cost per call (dispatch_counter.per_call_overhead_s), over the kernel calls of the class,
i.e. seconds of Python per op. Classes: "direction" (the direction stage: its ops and its waits on collectives)
and "other" (momentum, update, AdamW and the step's Python outside the phases). Thread CPU time: a loaded machine
does not inflate it, but a process sharing a core gets only its share of it (cost_model.measure_host.host_profile divides).

What the shrunk model changes: a dimension that does not scale with the width (the timestep MLP's 256 frequencies,
the patch embedding's inputs) can split or merge shape groups: dit_m width 256 has 23 matrices in 6 shape groups,
shrunk to 16 in 7 (the timestep MLP's 256 x 256 input layer no longer has the width's shape), i.e. an exchange or
a bucket more or fewer; the rate is per op, so the structure's Python is carried over, not its op count.
"""

from __future__ import annotations

import statistics
import time

import torch

from benchmarks.sharded_count import BENCH_BASE, CYCLE

# step kind -> bench_distributed's contender that runs it every step
KIND_CONTENDERS = {"adamw": {"name": "adamw"}, "refresh gather": {"name": "muon", "distributed_mode": "gather"},
                   "refresh owner": {"name": "muon", "distributed_mode": "owner"}, "rownorm": {"name": "rownorm"}}
REFERENCE = ("dit_m", 256, 4)  # bench_distributed's model in docs/cost_model.md, shrunk as below
CLASSES = ("direction", "other")


def shrunk(model_cfg):
    """The model with 4 channels per head (host_overhead's shrunk step)."""
    cfg = model_cfg.copy() if hasattr(model_cfg, "copy") else dict(model_cfg)
    cfg.hidden_size = 4 * cfg.num_heads
    return cfg


class _Phases:
    def __init__(self, counter):
        self.phase = counter.phase

    def add_bytes(self, collective: str, nbytes: int) -> None:
        pass


def python_per_op(model_cfg, optimizer: dict, world: int, repeats: int = 3) -> dict[str, float]:
    """Median seconds of Python per kernel op, per class, over `repeats` cycles of CYCLE steps of
    build_optimizer(shrunk model, BENCH_BASE + optimizer) on rank 0 of a fake group of `world`."""
    import torch.distributed as dist

    from benchmarks.dispatch_counter import DispatchCounter, per_call_overhead_s
    from dit_train.model.dit import build_model
    from dit_train.optim.registry import build_optimizer
    from dit_train.parallel.fsdp import ParallelPlan, apply_fsdp, fsdp_mesh
    from dit_train.parallel.memory_estimate import empty_all_to_all_inputs_allowed, init_fake_process_group

    if dist.is_initialized():
        raise RuntimeError("python_per_op makes its own fake process group: one is already initialised")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    init_fake_process_group(world)
    try:
        plan = ParallelPlan(sharded=True)
        model = build_model(shrunk(model_cfg), device="meta")
        apply_fsdp(model, model.blocks, plan, mesh=fsdp_mesh(plan, "cpu"))
        model.to_empty(device="cpu")
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in model.parameters():
                p.to_local().normal_(0.0, 0.02, generator=g)
                p.grad = torch.zeros_like(p)
                p.grad.to_local().normal_(0.0, 1e-3, generator=g)
        overhead = per_call_overhead_s(DispatchCounter)
        counter = DispatchCounter()
        per: dict[str, list[float]] = {c: [] for c in CLASSES}
        with empty_all_to_all_inputs_allowed(), torch.no_grad():
            opt = build_optimizer(model, {**BENCH_BASE, **optimizer})
            if getattr(opt, "compile_rownorm", None) == "auto":
                opt.compile_rownorm = False  # auto is eager on CPU, where bench_distributed runs
            opt.use_timer(_Phases(counter))
            for _ in range(CYCLE):
                opt.step()
            for _ in range(repeats * CYCLE):
                counter.reset()
                with counter:
                    start = time.thread_time()
                    opt.step()
                    whole = time.thread_time() - start
                for cls, value in _per_op(counter, whole, overhead).items():
                    per[cls].append(value)
        return {cls: statistics.median(v) for cls, v in per.items()}
    finally:
        dist.destroy_process_group()
        torch.set_num_threads(threads)


def _per_op(counter, whole: float, overhead: float) -> dict[str, float]:
    """Seconds of Python per kernel op of each class in one counted step of `whole` thread seconds."""
    python, ops = dict.fromkeys(CLASSES, 0.0), dict.fromkeys(CLASSES, 0)
    marked = 0.0
    for phase, calls in counter.calls.items():
        cls = "direction" if phase in ("direction", "comm") else "other"
        ops[cls] += calls.get("kernel", 0)
        python[cls] -= counter.inside_s[phase] + sum(calls.values()) * overhead
    for phase, total in counter.total_s.items():
        python["direction" if phase in ("direction", "comm") else "other"] += total
        marked += total
    python["other"] += whole - marked  # the step's Python outside any phase mark
    return {cls: max(0.0, python[cls]) / ops[cls] if ops[cls] else 0.0 for cls in CLASSES}


def measure_python(world: int, reference=REFERENCE) -> dict[str, dict[str, float]]:
    """{step kind: {class: seconds of Python per op}} on the shrunk reference model, rank 0 of `world`."""
    from dit_train.model.dit import load_preset

    cfg = load_preset(*reference)
    return {kind: python_per_op(cfg, optimizer, world) for kind, optimizer in KIND_CONTENDERS.items()}
