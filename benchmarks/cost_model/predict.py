"""The cost model's prediction of one training step: forward + backward at an assumed MFU, FSDP2's exposed
collectives, and the optimizer's step counted from the code (one process: benchmarks/op_cost.py; W ranks:
sharded.py) or at its floor (floor.py), averaged over the optimizer's cycle.

What it assumes (each a field of `Hardware`, stated in the profile):
- forward + backward: the model's ops counted on fake tensors and priced per op where the profile has `compute`
  rates (compute.py: GEMMs on a measured rate curve, memory-bound ops at HBM, a launch each, the recompute of
  activation checkpointing), else model FLOPs at `mfu` of the dense bf16 peak; FSDP2 prefetches the next
  block's all-gather and runs the reduce-scatter behind the next block's backward, so only the first block's
  all-gather and whatever communication exceeds the compute are exposed;
- the optimizer's counted ops: GEMMs at `ns5_of_peak` of the peak, every memory-bound op at `memory_efficiency`
  of the memory bandwidth, `op_s` per op (launch); the floor instead runs NS5 at `ns5_of_peak` on the flops the
  automatic form executes (directions.ns5_executed_flops) plus `launch_s` per batched call, and the elementwise
  phases move the bytes per element of `ELEMENT_BYTES`;
- a collective takes `latency_s` plus its bytes at `link_efficiency` of the slowest link it crosses (NVLink
  inside a node, InfiniBand between nodes); a ring all-reduce moves 2 (W - 1) / W of its tensor; an all-to-all
  its bytes to its own node's ranks at NVLink and to other nodes' at InfiniBand, both at once;
- the optimizer step follows backward (optimizer.overlap_exchange is off by default): nothing of it overlaps the
  forward/backward; inside it, on GPUs, each collective runs on a communication stream beside the ops issued
  after it until the code waits for it (gpu_replayed); the step is the slowest counted rank's.
"""

from __future__ import annotations

from dit_train.parallel.comm_volume import fsdp_volumes
from dit_train.parallel.fsdp import fsdp_units
from benchmarks.cost_model.compute import compute_seconds
from benchmarks.cost_model.contender import Optim, counted_optimizer
from benchmarks.cost_model.floor import floor_step
from benchmarks.cost_model.hardware import Hardware, gpu_profile, no_network
from benchmarks.cost_model.shapes import Shapes, mean_bytes, shapes_of
from benchmarks.cost_model.sharded import sharded_optimizer
from benchmarks.op_cost import count_step, seconds


_COUNTS: dict = {}


def counted_records(shapes: Shapes, step: str, scale: str, kernels: str) -> list:
    """op_cost.count_step's records of one step of kind `step` at these shapes (cached per shapes and step)."""
    optimizer = counted_optimizer(step, scale, kernels)
    key = (shapes, tuple(sorted(optimizer.items())))
    if key not in _COUNTS:
        _COUNTS[key] = count_step(shapes.model, optimizer)
    return _COUNTS[key]


def optimizer_step(shapes: Shapes, step: str, opt: Optim, hw: Hardware, world: int,
                   floor: bool = False) -> dict[str, float]:
    """Seconds of one optimizer step of kind `step`: 'elementwise' (momentum, update, AdamW) and 'direction' (NS5
    with its exchange, or RowNorm with its all-reduces). One process, counted (where the shapes carry their
    model): the ops the real step dispatches (op_cost.count_step) at hw.op_rates(). floor=True, or shapes without
    a model: floor.floor_step. W > 1 counted is sharded_optimizer's (predict)."""
    if floor or shapes.model is None:
        return floor_step(shapes, step, opt, hw, world)
    if world != 1:
        raise ValueError("optimizer_step counts one process; a sharded step is counted by sharded_optimizer")
    priced = {"elementwise": 0.0, "direction": 0.0}
    for rec in counted_records(shapes, step, opt.scale, hw.rownorm_kernels):
        priced["direction" if rec.phase == "direction" else "elementwise"] += seconds(rec, hw.op_rates())
    return priced


def compute_term(shapes: Shapes, hw: Hardware, images_per_rank: int,
                 activation_checkpointing: bool = False) -> float:
    """Seconds of forward + backward on one rank: counted from the model and priced per op (compute.py) where the
    profile has `compute` rates (H200, H100), else model FLOPs at the assumed `mfu` (host profiles; there the
    recompute of activation checkpointing is not priced: an MFU of model FLOPs holds it)."""
    if hw.compute is not None:
        return compute_seconds(shapes, hw.compute, hw.memory_bytes_s, images_per_rank,
                               activation_checkpointing)["compute"]
    if hw.mfu is None:
        raise ValueError(f"profile {hw.name} has neither compute rates nor an mfu: forward + backward has no price")
    return shapes.flops_per_image * images_per_rank / (hw.matmul_flops * hw.mfu)


def forward_backward(shapes: Shapes, hw: Hardware, world: int, images_per_rank: int,
                     reduce_bytes: int = 4, blocks_per_unit: int = 1,
                     activation_checkpointing: bool = False) -> dict[str, float]:
    """Compute (compute_term), and the exposed part of FSDP2's collectives (plain FSDP over `world`, units of
    `blocks_per_unit` blocks: parallel.blocks_per_fsdp_unit)."""
    compute = compute_term(shapes, hw, images_per_rank, activation_checkpointing)
    if world == 1:
        return {"compute": compute, "fsdp": 0.0, "fsdp_exposed": 0.0}
    units = [sum(u) for u in fsdp_units(shapes.blocks, blocks_per_unit)]
    v = fsdp_volumes(shapes.params, units, world, 1, reduce_bytes, True)
    calls = 3 * len(units)  # per unit: all-gather forward, all-gather backward, reduce-scatter
    comm = v["fsdp_total"] / hw.link(world) + calls * hw.latency_s
    first = hw.latency_s + (world - 1) / world * units[0] * 2 / hw.link(world)
    return {"compute": compute, "fsdp": comm, "fsdp_exposed": first + max(0.0, comm - compute)}


def predict(shapes: Shapes, opt: Optim, hw: Hardware, world: int, images_per_rank: int = 0,
            floor: bool = False, activation_checkpointing: bool = False) -> dict:
    """Per-step averages over one cycle of `opt` (K steps for periodic_rowwise): optimizer seconds, logical bytes
    per rank, each step kind's seconds, and with images_per_rank the whole step's seconds. Counted from the code
    (one process: op_cost's count, with its phases; W > 1: the sharded step counted on the ranks that can be the
    slowest and replayed on the hardware, sharded_optimizer, bytes rank 0's), or the first-principles floor
    (floor=True, or shapes without a model; bytes the mean over ranks)."""
    kinds = opt.steps()
    if world > 1 and not floor and shapes.model is not None:
        sharded = sharded_optimizer(shapes, opt, hw, world)
        out = {"optimizer": sum(sharded["steps"][k] for k in kinds) / len(kinds),
               "bytes": sum(sharded["bytes"][k] for k in kinds) / len(kinds), "steps": sharded["steps"],
               "slowest": sharded["slowest"]}
    else:
        per = {k: optimizer_step(shapes, k, opt, hw, world, floor) for k in set(kinds)}
        out = {"optimizer": sum(sum(per[k].values()) for k in kinds) / len(kinds),
               "elementwise": sum(per[k]["elementwise"] for k in kinds) / len(kinds),
               "direction": sum(per[k]["direction"] for k in kinds) / len(kinds),
               "bytes": sum(mean_bytes(shapes, k, opt.scale, opt.mode, world) for k in kinds) / len(kinds),
               "steps": {k: sum(v.values()) for k, v in per.items()}}
    if images_per_rank:
        fb = forward_backward(shapes, hw, world, images_per_rank, activation_checkpointing=activation_checkpointing)
        out.update(fb, step=fb["compute"] + fb["fsdp_exposed"] + out["optimizer"])
    return out


def describe_prediction(model_cfg, optimizer_cfg, world: int, images_per_rank: int, device_name: str,
                        network: bool = True, activation_checkpointing: bool = False) -> str:
    """One line for the GPU check: this model's step time for the configuration on the device's profile;
    network=False for a rank whose peers are a fake process group (collectives free: only the compute and memory
    of one rank of `world`); activation_checkpointing: the blocks' forward recomputed in backward (priced where the
    profile counts forward + backward, compute_term)."""
    hw = gpu_profile(device_name)
    if hw is None:
        return f"no cost-model profile for {device_name}"
    if not network:
        hw = no_network(hw)
    opt = Optim(optimizer_cfg.get("name", "muon"), int(optimizer_cfg.get("K", 1) or 1),
                optimizer_cfg.get("rownorm_scale", "spectral"), optimizer_cfg.get("distributed_mode", "owner"))
    p = predict(shapes_of(model_cfg), opt, hw, world, images_per_rank,
                activation_checkpointing=activation_checkpointing)
    how = (f"fwd+bwd counted{', AC' if activation_checkpointing else ''}" if hw.compute is not None
           else f"MFU {hw.mfu:g}")
    return (f"cost model ({hw.name}, {how}): step {p['step'] * 1e3:.0f} ms = fwd+bwd "
            f"{p['compute'] * 1e3:.0f} + FSDP exposed {p['fsdp_exposed'] * 1e3:.0f} + optimizer "
            f"{p['optimizer'] * 1e3:.0f} (cycle mean)")
