"""The sharded optimizer step on W GPUs: counted on the real sharded step (benchmarks/sharded_count.py: fake
tensors, a fake process group of W) on the ranks that can be the slowest, and replayed on a compute and a
communication stream per rank (benchmarks/sharded_schedule.py) at a hardware profile's rates and links."""

from __future__ import annotations

from benchmarks.cost_model.contender import Optim, optimizer_config
from benchmarks.cost_model.hardware import Hardware, all_reduce_seconds
from benchmarks.cost_model.shapes import Shapes


_COUNTED_STEPS: dict = {}  # (shapes, step_key, world, rank, gpu) -> one counted step (sharded_count.counted_step)
_OWNED: dict = {}  # (shapes, distributed_mode, world, gpu) -> NS5 flops per rank by the owner plan, or None


def step_key(opt: Optim, kind: str) -> tuple:
    """What a contender's counted step of kind `kind` depends on. Each kind's step is set (sharded_count.
    STEP_OF_KIND), so K only mixes the steps (periodic_rowwise K=3 and K=5 share them); the refresh step is NS5
    with the distributed mode's exchange, the same ops for Muon and periodic_rowwise of any RowNorm scale, so a
    paper cell counts it once per mode instead of once per contender."""
    if kind == "refresh":
        return kind, opt.mode
    return kind, opt.name, opt.scale, opt.mode


def _count_ranks(shapes: Shapes, opts: list, world: int, rank: int, gpu: bool) -> None:
    """Count `rank`'s steps of the kinds of the contenders not counted yet, on one fake sharded model, each step
    with the config of the first contender that needs it (the others share it: step_key); the owner plan is read
    where a refresh step is counted."""
    from benchmarks.sharded_count import count_step_kinds

    todo, claimed = {}, set()
    for o in opts:
        kinds = [k for k in sorted(set(o.steps()))
                 if (shapes, step_key(o, k), world, rank, gpu) not in _COUNTED_STEPS and step_key(o, k) not in claimed]
        claimed.update(step_key(o, k) for k in kinds)
        if kinds:
            todo[o] = (optimizer_config(o), kinds)
    if not todo:
        return
    for o, counted in count_step_kinds(shapes.model, todo, world, rank, gpu).items():
        for kind, step in counted.steps.items():
            _COUNTED_STEPS[(shapes, step_key(o, kind), world, rank, gpu)] = step
        if "refresh" in counted.steps:
            _OWNED[(shapes, o.mode, world, gpu)] = counted.owned


def heaviest_rank(owned: list | None) -> int:
    """The rank computing the most NS5 flops by the optimizer's own owner assignment (ties: the lower rank); 0
    where every rank computes the same (gather mode, no NS5)."""
    return 0 if not owned else max(range(len(owned)), key=lambda r: (owned[r], -r))


def counted_ranks(shapes: Shapes, opts: list, world: int, gpu: bool) -> dict:
    """{contender: {rank: {kind: counted step}}} for the ranks that can be the slowest: rank 0 (the largest dim-0
    shards: the most elementwise work, and in gather mode as much NS5 as any rank) and, in owner mode, the rank
    that owns the most NS5 flops (read from rank 0's optimizer: its cached exchange plan, the same on every rank).
    Each step counted once per (shapes, step_key, W, rank) in a run."""
    _count_ranks(shapes, opts, world, 0, gpu)
    heavy = {o: heaviest_rank(_OWNED.get((shapes, o.mode, world, gpu)) if "refresh" in o.steps() else None)
             for o in opts}
    for rank in sorted(set(heavy.values()) - {0}):
        _count_ranks(shapes, [o for o in opts if heavy[o] == rank], world, rank, gpu)
    return {o: {r: {k: _COUNTED_STEPS[(shapes, step_key(o, k), world, r, gpu)] for k in sorted(set(o.steps()))}
                for r in sorted({0, heavy[o]})} for o in opts}


def collective_seconds(c, world: int, hw: Hardware, rank: int) -> float:
    """A counted collective (sharded_count.Collective) of `rank` on the hardware's links: its latency + a ring
    all-reduce's 2 (W - 1) / W of its tensor or an all-gather's bytes at the slowest link of the group (NVLink
    inside a node, InfiniBand across nodes); an all-to-all's bytes to ranks of its own node at NVLink and to other
    nodes at InfiniBand, both at once (the slower decides)."""
    if c.op == "all_reduce":
        return all_reduce_seconds(hw, c.tensor, world)
    if c.op == "all_gather":
        return hw.latency_s + c.sent / hw.link(world)
    node = rank // hw.devices_per_node
    inter = sum(b for r, b in enumerate(c.to) if r // hw.devices_per_node != node)
    return hw.latency_s + max(inter / (hw.inter_bytes_s * hw.link_efficiency),
                              (c.sent - inter) / (hw.intra_bytes_s * hw.link_efficiency))


def gpu_replayed(ranks: dict, hw: Hardware, world: int) -> dict:
    """One step counted on some ranks ({rank: counted step}) replayed on GPUs (sharded_schedule.replayed): each
    rank's ops in order on its compute stream at hw.op_rates(), the collectives in issue order on one
    communication stream, each starting when every counted rank has issued it (its compute before the issue done)
    and the previous one is done, lasting collective_seconds of the busiest counted rank; a wait holds the compute
    stream until its collective is done. Adds `slowest`: the rank that ends last (ties: the one blocked least)."""
    from benchmarks.sharded_schedule import collectives_of, replayed

    order = sorted(ranks)
    steps = [ranks[r] for r in order]
    durations = [max(collective_seconds(st.collectives[c], world, hw, r) for r, st in zip(order, steps))
                 for c in range(collectives_of(steps))]
    out = replayed(steps, hw.op_rates(), durations)
    out["slowest"] = order[max(range(len(order)), key=lambda i: (out["ends"][i], -out["waited"][i]))]
    return out


def sharded_optimizer(shapes: Shapes, opt: Optim, hw: Hardware, world: int) -> dict:
    """Each step kind of `opt` on W GPUs, counted on the real sharded step (sharded_count.count_step_kinds: fake
    tensors, a fake process group of W, the contender's config through apply_fsdp and build_optimizer; the CUDA
    path where the profile's RowNorm kernels are compiled) on rank 0 and the rank owning the most NS5 flops
    (counted_ranks), replayed together on the hardware (gpu_replayed): {"steps": {kind: the step's seconds},
    "slowest": {kind: the rank that ends it}, "bytes": {kind: rank 0's logical bytes}, "ranks": the ranks
    counted}."""
    ranks = counted_ranks(shapes, [opt], world, hw.rownorm_kernels == "compiled")[opt]
    kinds = list(ranks[0])
    done = {k: gpu_replayed({r: steps[k] for r, steps in ranks.items()}, hw, world) for k in kinds}
    return {"steps": {k: done[k]["total_s"] for k in kinds}, "slowest": {k: done[k]["slowest"] for k in kinds},
            "bytes": {k: sum(c.sent for c in ranks[0][k].collectives) for k in kinds}, "ranks": sorted(ranks)}
