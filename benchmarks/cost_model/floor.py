"""The first-principles floor of one optimizer step (`floor=True`): each phase at its memory or FLOP floor on
the busiest rank of W: the bytes per element of each elementwise pass (ELEMENT_BYTES), NS5 at the FLOPs the
automatic form executes (directions.ns5_executed_flops) plus `launch_s` per batched call, the whole-matrix
owner/gather schedule of benchmarks/model_owner_schedule.py, RowNorm's all-reduces as rings."""

from __future__ import annotations

from dit_train.optim.collectives import shard_rows
from dit_train.optim.directions import ns5_executed_flops
from benchmarks.cost_model.contender import Optim
from benchmarks.cost_model.hardware import Hardware, all_reduce_seconds
from benchmarks.cost_model.shapes import Shapes, rank_bytes
from benchmarks.model_owner_schedule import gather_schedule, owner_schedule, simulate


ADAMW_BYTES = 28  # fused AdamW: p, g, m, v read, p, m, v written, fp32

# Bytes per matrix element of the elementwise passes of one step (fp32 parameters, every read or write of a
# tensor counted once; docs/bench_optimizer.md, "The memory-traffic floor"):
# - refresh (NS5) step: momentum lerp 12 (G, M in; M out), the bf16 NS5 input stacked 10 (G, M in; U out),
#   weight decay 8, update 10 (W, bf16 D in; W out);
# - RowNorm step, torch ops: lerp 12, U formed 12, its row sums 4, decay 8, addcmul 12 = 48; the spectral scale's
#   5 power-iteration products read U 5 times: + 20;
# - RowNorm step, fused (compiled) kernels: frobenius in one pass 20 (wide: G, M, W read once, W, M written) or two pipelined
#   passes 28 (tall); spectral: momentum 16 (G, M in; M, U out), the power iteration's reads of U 8 (wide) or
#   12 (tall), update 12 (W, U in; W out).
ELEMENT_BYTES = {("refresh", "eager"): (40, 40), ("refresh", "compiled"): (40, 40),
                 ("frobenius", "eager"): (48, 48), ("spectral", "eager"): (68, 68),
                 ("frobenius", "compiled"): (20, 28), ("spectral", "compiled"): (36, 40)}  # (wide, tall)


def ns5_seconds(hw: Hardware):
    return lambda s, c: c * ns5_executed_flops(*s) / hw.ns5_rate(min(s)) + hw.launch_s if c else 0.0


def floor_step(shapes: Shapes, step: str, opt: Optim, hw: Hardware, world: int) -> dict[str, float]:
    """Seconds of one optimizer step of kind `step` ('elementwise', 'direction') at its first-principles floor on
    the busiest rank of `world`, each phase at its memory or FLOP floor (ELEMENT_BYTES, NS5's executed FLOPs, the
    owner/gather schedule of model_owner_schedule)."""
    rate = hw.memory_bytes_s * hw.memory_efficiency
    rest = -(-shapes.rest // world) * ADAMW_BYTES
    if step == "adamw":
        total = sum(m * n * c for (m, n), c in shapes.matrices) * ADAMW_BYTES / world
        return {"elementwise": (total + rest) / rate, "direction": 0.0}
    key = "refresh" if step == "refresh" else opt.scale
    wide, tall = ELEMENT_BYTES[(key, hw.rownorm_kernels)]
    moved = sum(c * shard_rows(m, world)[0][1] * n * (tall if m > n else wide) for (m, n), c in shapes.matrices)
    out = {"elementwise": (moved + rest) / rate}
    if step == "refresh":
        groups = dict(shapes.matrices)
        if world == 1:
            out["direction"] = sum(ns5_seconds(hw)(s, c) for s, c in groups.items())
        else:
            schedule = owner_schedule if opt.mode == "owner" else gather_schedule
            extra = () if opt.mode == "owner" else (16.0,)  # gather mode's bucket_mb default
            out["direction"] = simulate(schedule(groups, world, hw.net(), ns5_seconds(hw), *extra))[0]
    else:
        # on shards: the tall column sums in one all-reduce, then the spectral scale's 3 rounds
        tall = any(m > n for (m, n), _ in shapes.matrices)
        rounds = 0 if world == 1 else int(tall) + 3 * (opt.scale == "spectral")
        nbytes = sum(rank_bytes(shapes, "rownorm", opt.scale, opt.mode, world, 0).values())
        out["direction"] = rounds * all_reduce_seconds(hw, nbytes / rounds, world) if rounds else 0.0
    return out
