"""Bytes each rank moves per training step through FSDP2's collectives (docs/scaling_out.md, "Communication per
step"), from the parameter counts of the real model: dit-comm-volume tabulates the presets, and the trainer
prints its own run's figure at start, with the part that crosses nodes.

Per rank and optimizer step, no gradient accumulation, ring bytes as the collectives send them, over a shard group
of S ranks and R replicas (HSDP; R = 1 is plain FSDP): forward all-gather of the bf16 compute weights
(S - 1) / S x P x 2; backward all-gather of every FSDP unit (a block, or parallel.blocks_per_fsdp_unit of them)
but the last (with reshard_after_forward) the same per unit; gradient reduce-scatter (S - 1) / S x P x the reduce
dtype's bytes; HSDP's all-reduce of each gradient shard across the replicas 2 (R - 1) / R x P / S x the reduce
dtype's bytes. The optimizer's own exchanges
(Muon and periodic_rowwise refresh steps) are counted by the sharded optimizer itself (opt/* metrics)."""

from __future__ import annotations

from dit_train.telemetry.byte_size import byte_unit

GB = 1e9


def fsdp_volumes(params: int, units: list[int], shard: int, replicas: int, reduce_bytes: int,
                 reshard: bool | int) -> dict:
    """Bytes per rank per step of each FSDP2 collective and `fsdp_total`, their sum. `units`: the parameters of
    each FSDP unit of blocks, in order. `reshard` is parallel.reshard_after_forward: true regathers every unit but
    the last in backward over the shard group, an integer N over groups of N ranks, false not at all."""
    P, S, R = params, shard, replicas
    regathered = sum(units[:-1]) if reshard is not False else 0
    group = reshard if type(reshard) is int and reshard > 1 else S
    out = {"ag_fwd": (S - 1) / S * P * 2, "ag_bwd": (group - 1) / group * regathered * 2,
           "rs": (S - 1) / S * P * reduce_bytes, "ar_replicas": 2 * (R - 1) / R * P / S * reduce_bytes}
    out["fsdp_total"] = out["ag_fwd"] + out["ag_bwd"] + out["rs"] + out["ar_replicas"]
    return out


def crossing_nodes(volumes: dict, replicas: int, nodes: int) -> float:
    """What of `volumes` leaves a node: nothing on one node; under HSDP (a shard group per node) the replicas'
    all-reduce; under plain FSDP over several nodes every collective's ring spans the nodes."""
    if nodes <= 1:
        return 0.0
    return volumes["ar_replicas"] if replicas > 1 else volumes["fsdp_total"]


def ranks_per_node(world_size: int) -> int:
    """torchrun's LOCAL_WORLD_SIZE, else Slurm's tasks per node ('8' or '8(x4)'), else all ranks on one node."""
    import os

    for name in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        value = os.environ.get(name, "").split("(")[0]
        if value.isdigit() and int(value) > 0:
            return int(value)
    return world_size


def describe_run(model, plan, world_size: int, ranks_per_node: int) -> str:
    """The start-up line of a sharded run: GB per rank per step through FSDP2, and how much of it crosses nodes."""
    from dit_train.parallel.fsdp import fsdp_units

    params = sum(p.numel() for p in model.parameters())
    units = [sum(p.numel() for b in unit for p in b.parameters())
             for unit in fsdp_units(model.blocks, plan.blocks_per_unit)]
    reduce_bytes = plan.reduce_dtype.itemsize
    shard = world_size // plan.replicate
    v = fsdp_volumes(params, units, shard, plan.replicate, reduce_bytes, plan.reshard_after_forward)
    nodes = max(1, world_size // max(1, ranks_per_node))
    crosses = crossing_nodes(v, plan.replicate, nodes)
    unit, size = byte_unit(v["fsdp_total"])  # both figures in one unit, the total's
    return (f"FSDP2 traffic per rank per step: {v['fsdp_total'] / size:.2f} {unit}, {crosses / size:.2f} {unit} of it "
            f"between nodes ({nodes} node(s) of {min(ranks_per_node, world_size)} ranks"
            f"{', HSDP' if plan.replicate > 1 else ''})")
