"""What the cost model reads from the model: its matrix shapes, AdamW elements, blocks and FLOPs (the preset built
on the meta device and routed as the optimizers route it), and the sharded optimizer's logical bytes per rank by
its own counting rules (collectives.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

from dit_train.optim.collectives import shard_rows
from dit_train.optim.owner_exchange import plan_exchanges


@dataclass(frozen=True)
class Shapes:
    matrices: tuple  # ((m, n), count) of the matrix-routed parameters, in the optimizer's stacking order
    rest: int  # elements on AdamW
    params: int
    blocks: tuple  # elements per block (FSDP2 units: parallel.blocks_per_fsdp_unit of them)
    flops_per_image: int  # forward + backward (model/flops.py's training_flops_per_image)
    model: object = field(default=None, compare=False)  # the model config, for counting the optimizer's ops


@lru_cache(maxsize=None)
def model_shapes(preset: str, hidden_size: int | None = None, depth: int | None = None,
                 num_heads: int | None = None) -> Shapes:
    """The preset built on the meta device, routed as the optimizers route it, and its FLOPs counted."""
    from dit_train.model.dit import load_preset

    return shapes_of(load_preset(preset, hidden_size, depth, num_heads))


def shapes_of(cfg) -> Shapes:
    """Shapes of the model a Hydra `model` node builds (on the meta device)."""
    from dit_train.model.dit import build_model
    from dit_train.model.flops import training_flops_per_image
    from dit_train.optim.routing import route_parameters

    model = build_model(cfg, device="meta")
    routing = route_parameters(model)
    groups: dict = {}
    for _, p in routing.matrix:
        groups[tuple(p.shape)] = groups.get(tuple(p.shape), 0) + 1
    return Shapes(tuple(groups.items()), sum(p.numel() for _, p in routing.adamw),
                  sum(p.numel() for p in model.parameters()),
                  tuple(sum(p.numel() for p in b.parameters()) for b in model.blocks), training_flops_per_image(cfg),
                  cfg)


def rownorm_buckets(cfg) -> list[tuple[int, int, int]]:
    """(B, m, n) of every bucket of B same-shape m x n matrices that the single-process RowNorm step runs its
    passes on (one compiled kernel each with compile_rownorm), for the model a `model` node builds: build_optimizer's
    matrix groups as the optimizer itself buckets them (matrix_optimizer._buckets), on the meta device."""
    from dit_train.model.dit import build_model
    from dit_train.optim.matrix_optimizer import _buckets
    from dit_train.optim.registry import build_optimizer

    optimizer = build_optimizer(build_model(cfg, device="meta"), {"name": "rownorm"})
    out = []
    for group in optimizer.param_groups:
        if group["kind"] == "matrix":
            shapes = [tuple(p.shape) for p in group["params"]]
            out += [(len(idx), *key[0]) for key, idx in _buckets(group["params"], shapes).items()]
    return out


def rank_bytes(shapes: Shapes, step: str, scale: str, mode: str, world: int, rank: int) -> dict[str, int]:
    """Bytes `rank` of `world` sends per collective in one optimizer step of kind `step`, as ShardComm counts
    them: an all-reduce its tensor, an all-gather (W - 1) x its input, an all-to-all what goes to other ranks."""
    if world == 1 or step == "adamw":
        return {}
    mats = [s for s, c in shapes.matrices for _ in range(c)]
    if step == "rownorm":
        tall = [n for m, n in mats if m > n]
        total = 4 * sum(tall)  # one fp32 sum of squares per column; wide rows are local
        if scale == "spectral":  # 3 power-iteration rounds: rows split (wide) 3 x c + |x|^2, columns split 2 x r + 1
            total += sum(4 * (3 * n + 1) for m, n in mats if m <= n) + sum(4 * (2 * n + 1) for n in tall)
        return {"all_reduce": total}
    if mode == "gather":  # (W - 1) padded bf16 shards of every matrix
        return {"all_gather": sum((world - 1) * -(-m // world) * n * 2 for m, n in mats)}
    sent = 0
    groups = {s: (s, c) for s, c in shapes.matrices}
    for ex in plan_exchanges(groups, world):  # my rows of others' matrices out, the others' rows of mine back
        (m, n), mine = ex.key, shard_rows(ex.key[0], world)[rank][1]
        owned = ex.counts[rank]
        sent += owned * (m - mine) * n * 2 + (ex.size - owned) * mine * n * 2
    return {"all_to_all": sent}


def mean_bytes(shapes: Shapes, step: str, scale: str, mode: str, world: int) -> float:
    """Per-rank logical optimizer bytes of one step, the mean over ranks (what bench_distributed reports)."""
    return sum(sum(rank_bytes(shapes, step, scale, mode, world, r).values()) for r in range(world)) / world
