#!/usr/bin/env python
"""A cost model of one training step (docs/cost_model.md): forward + backward, FSDP2's collectives and the
optimizer's step, per preset x optimizer (K, RowNorm scale, distributed mode) x world size x hardware profile.
Every input comes from the real code: parameter shapes and FLOPs from the model built on the meta device
(model_flops), FSDP2 bytes from comm_volume.fsdp_volumes, and the optimizer step counted op by op on fake tensors
(one process: benchmarks/op_cost.py; W ranks: the real sharded step on a fake process group of W,
benchmarks/sharded_count.py, with the collectives and bytes the optimizer itself issues, in its own order of issues
and waits, replayed by benchmarks/sharded_schedule.py). The first-principles floor (`floor=True`: bytes and FLOPs
per element, the whole-matrix schedule of benchmarks/model_owner_schedule.py) is kept beside it.

    python -m benchmarks.cost_model --paper [--hardware h100|h200]         # the paper's table
    python -m benchmarks.cost_model --measure-host [--save benchmarks/host_profile.json]
    python -m benchmarks.cost_model --calibrate --bench-optimizer LOG --bench-distributed LOG

What it assumes (each a field of `Hardware`, stated in the profile):
- forward + backward run at `mfu` of the dense bf16 peak; FSDP2 prefetches the next block's all-gather and runs
  the reduce-scatter behind the next block's backward, so only the first block's all-gather and whatever
  communication exceeds the compute are exposed;
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

import argparse
import json
import os
import re
import sys
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from functools import lru_cache

from dit_train.parallel.comm_volume import fsdp_volumes
from dit_train.parallel.fsdp import fsdp_units
from dit_train.optim.collectives import shard_rows
from dit_train.optim.directions import ns5_executed_flops
from dit_train.optim.owner_exchange import plan_exchanges
from benchmarks.model_owner_schedule import Net, gather_schedule, owner_schedule, simulate
from benchmarks.op_cost import (OpRates, count_step, host_op_rates, measure_fused_rate, measure_op_rates,
                                median_seconds, seconds)
from benchmarks.ns5_gemm_rates import measure_ns5_gemms
from benchmarks.sharded_python import measure_python

PAPER_PRESETS = ("dit_1b3", "dit_4b", "dit_9b", "dit_15b")
PAPER_WORLDS = (8, 16, 32)
PAPER_GLOBAL_BATCH = 1024  # experiment=scaling_study's global batch
HOST_PROFILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "host_profile.json")
ADAMW_BYTES = 28  # fused AdamW: p, g, m, v read, p, m, v written, fp32


GPU_OP_S = 8e-6  # a GPU op's fixed cost: eager dispatch + launch (benchmarks/host_overhead.py's --launch-us default)


@dataclass(frozen=True)
class Hardware:
    name: str
    matmul_flops: float  # dense bf16 peak per device (data sheet), or the GEMM rate measured here (CPU)
    mfu: float  # assumed share of matmul_flops that forward + backward reach
    ns5_of_peak: float  # share of matmul_flops NS5's batched GEMMs reach (CPU: 1, the rate is measured at GEMMs)
    memory_bytes_s: float  # HBM (data sheet), or fused AdamW's streaming rate measured here (CPU)
    memory_efficiency: float
    intra_bytes_s: float  # per device and direction inside a node (NVLink; CPU: gloo between processes)
    inter_bytes_s: float  # per device and direction between nodes (InfiniBand)
    link_efficiency: float
    devices_per_node: int
    latency_s: float  # fixed cost of one collective
    launch_s: float  # fixed cost of one batched NS5 call
    rownorm_kernels: str  # "compiled": fused kernels (compile_rownorm auto on CUDA); "eager": torch ops (on CPU)
    ns5_rates: tuple = ()  # measured ((r, flop/s), ...) of NS5's GEMMs by the matrix's short side (CPU); else peak
    ops: OpRates | None = None  # measured rates of each op category (CPU); None: from the fields above (GPU)
    op_s: float = GPU_OP_S  # fixed cost of one dispatched op where `ops` is None (a GPU launch)

    def op_rates(self) -> OpRates:
        """What a counted op costs here (benchmarks/op_cost.py): measured on this host, or on a GPU every
        memory-bound category at memory_efficiency of HBM, GEMMs at ns5_of_peak of the peak, op_s per op."""
        if self.ops is not None:
            return self.ops
        hbm = self.memory_bytes_s * self.memory_efficiency
        return OpRates(hbm, hbm, hbm, hbm, self.op_s, hbm, hbm, ((1, self.matmul_flops * self.ns5_of_peak),))

    def ns5_rate(self, r: int) -> float:
        """flop/s of NS5 on matrices of short side r: the measured rate of the nearest measured r at or below it
        (small GEMMs run slower), else the assumed share of the peak."""
        if not self.ns5_rates:
            return self.matmul_flops * self.ns5_of_peak
        below = [rate for side, rate in self.ns5_rates if side <= r]
        return below[-1] if below else self.ns5_rates[0][1]

    def link(self, world: int) -> float:
        """Bytes/s of a collective over `world` consecutive ranks: NVLink inside one node, else InfiniBand."""
        raw = self.intra_bytes_s if world <= self.devices_per_node else self.inter_bytes_s
        return raw * self.link_efficiency

    def net(self) -> Net:
        return Net(self.inter_bytes_s * self.link_efficiency, self.intra_bytes_s * self.link_efficiency,
                   self.devices_per_node, self.latency_s)


# Data sheets: H100 SXM5 989.4 TFLOP/s dense bf16, 3.35 TB/s HBM3; H200 SXM 989.4, 4.8 TB/s HBM3e; both NVLink 4
# (900 GB/s both ways = 450 per direction) and one 400 Gbit/s NDR InfiniBand port per GPU (50 GB/s). The
# efficiencies are assumptions until the GPU check measures them (benchmarks/gpu_check.sh prints this model beside
# its measurements): MFU 0.40, NS5 at 0.5 of peak (batched bf16 bmm of 1.5k-4k matrices), 0.8 of HBM for
# streaming elementwise kernels, 0.8 of the links for NCCL rings (bus bandwidth), 30 us per collective and per
# batched NS5 call.
_GPU = dict(mfu=0.40, ns5_of_peak=0.5, memory_efficiency=0.8, intra_bytes_s=450e9, inter_bytes_s=50e9,
            link_efficiency=0.8, devices_per_node=8, latency_s=30e-6, launch_s=30e-6, rownorm_kernels="compiled")
PROFILES = {"h100": Hardware("H100 SXM", 989.4e12, memory_bytes_s=3.35e12, **_GPU),
            "h200": Hardware("H200 SXM", 989.4e12, memory_bytes_s=4.8e12, **_GPU)}


def gpu_profile(device_name: str) -> Hardware | None:
    """The profile of a CUDA device by its name (H200 before H100: 'NVIDIA H200' names neither twice)."""
    for key in ("h200", "h100"):
        if key in device_name.lower():
            return PROFILES[key]
    return None


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


@dataclass(frozen=True)
class Shapes:
    matrices: tuple  # ((m, n), count) of the matrix-routed parameters, in the optimizer's stacking order
    rest: int  # elements on AdamW
    params: int
    blocks: tuple  # elements per block (FSDP2 units: parallel.blocks_per_fsdp_unit of them)
    flops_per_image: int  # forward + backward (model_flops)
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


@dataclass(frozen=True)
class Optim:
    name: str  # adamw | muon | periodic_rowwise | rownorm
    K: int = 1
    scale: str = "spectral"  # rownorm_scale
    mode: str = "owner"  # distributed_mode

    def steps(self) -> list[str]:
        """The step kinds of one cycle: 'adamw', 'refresh' (NS5) or 'rownorm'."""
        return {"adamw": ["adamw"], "muon": ["refresh"], "rownorm": ["rownorm"],
                "periodic_rowwise": ["refresh"] + ["rownorm"] * (self.K - 1)}[self.name]

    def label(self) -> str:
        if self.name == "periodic_rowwise":
            return f"periodic_rowwise K={self.K} {self.scale} {self.mode}"
        return self.name + (f" {self.mode}" if self.name == "muon" else "")


# ---- logical bytes: the sharded optimizer's counting rules (collectives.py) ----------------------------------
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


# ---- time ------------------------------------------------------------------------------------------------------
def ns5_seconds(hw: Hardware):
    return lambda s, c: c * ns5_executed_flops(*s) / hw.ns5_rate(min(s)) + hw.launch_s if c else 0.0


def all_reduce_seconds(hw: Hardware, nbytes: float, world: int) -> float:
    return hw.latency_s + 2 * (world - 1) / world * nbytes / hw.link(world)


def counted_optimizer(step: str, scale: str, kernels: str) -> dict:
    """The single-process optimizer whose step of kind `step` op_cost.count_step counts (one process: W = 1)."""
    return {"adamw": {"name": "adamw"}, "refresh": {"name": "muon"},
            "rownorm": {"name": "rownorm", "rownorm_scale": scale, "compile_rownorm": kernels == "compiled"}}[step]


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
    a model: the first-principles floor on the busiest rank of `world`, each phase at its memory or FLOP floor
    (ELEMENT_BYTES, NS5's executed FLOPs, the owner/gather schedule of model_owner_schedule). W > 1 counted is
    sharded_optimizer's (predict)."""
    if not floor and shapes.model is not None:
        if world != 1:
            raise ValueError("optimizer_step counts one process; a sharded step is counted by sharded_optimizer")
        priced = {"elementwise": 0.0, "direction": 0.0}
        for rec in counted_records(shapes, step, opt.scale, hw.rownorm_kernels):
            priced["direction" if rec.phase == "direction" else "elementwise"] += seconds(rec, hw.op_rates())
        return priced
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


# ---- the sharded step, counted (benchmarks/sharded_count.py) and replayed on GPUs (sharded_schedule.py) -------
def optimizer_config(opt: Optim) -> dict:
    """The optimizer config of a contender, as build_optimizer takes it."""
    cfg = {"name": opt.name}
    if opt.name in ("muon", "periodic_rowwise"):
        cfg["distributed_mode"] = opt.mode
    if opt.name == "periodic_rowwise":
        cfg["K"] = opt.K
    if opt.name in ("periodic_rowwise", "rownorm"):
        cfg["rownorm_scale"] = opt.scale
    return cfg


_SHARDED_KINDS: dict = {}  # (shapes, counted(contender), world, rank, gpu) -> sharded_count.count_step_kinds' entry


def counted(opt: Optim) -> tuple:
    """What a contender's counted steps depend on: each kind's step is set (sharded_count.STEP_OF_KIND), so K only
    mixes them (the cycle's mean) and periodic_rowwise K=3 and K=5 of one scale share their counts."""
    return opt.name, opt.scale, opt.mode


def _count_ranks(shapes: Shapes, opts: list, world: int, rank: int, gpu: bool) -> None:
    """Count `rank`'s steps of every kind of the contenders not counted yet, on one fake sharded model (each with
    its own config: the first of those that share their counts)."""
    from benchmarks.sharded_count import count_step_kinds

    todo = {}
    for o in opts:
        if (shapes, counted(o), world, rank, gpu) not in _SHARDED_KINDS:
            todo.setdefault(counted(o), (optimizer_config(o), sorted(set(o.steps()))))
    if todo:
        for key, steps in count_step_kinds(shapes.model, todo, world, rank, gpu).items():
            _SHARDED_KINDS[(shapes, key, world, rank, gpu)] = steps


def heaviest_rank(owned: list | None) -> int:
    """The rank computing the most NS5 flops by the optimizer's own owner assignment (ties: the lower rank); 0
    where every rank computes the same (gather mode, no NS5)."""
    return 0 if not owned else max(range(len(owned)), key=lambda r: (owned[r], -r))


def counted_ranks(shapes: Shapes, opts: list, world: int, gpu: bool) -> dict:
    """{contender: {rank: {kind: counted step}}} for the ranks that can be the slowest: rank 0 (the largest dim-0
    shards: the most elementwise work, and in gather mode as much NS5 as any rank) and, in owner mode, the rank
    that owns the most NS5 flops (read from rank 0's optimizer: its cached exchange plan, the same on every rank).
    Counted once per (shapes, contender's counted(), W, rank) in a run."""
    _count_ranks(shapes, opts, world, 0, gpu)
    heavy = {o: heaviest_rank(_SHARDED_KINDS[(shapes, counted(o), world, 0, gpu)].owned) for o in opts}
    for rank in sorted(set(heavy.values()) - {0}):
        _count_ranks(shapes, [o for o in opts if heavy[o] == rank], world, rank, gpu)
    return {o: {r: _SHARDED_KINDS[(shapes, counted(o), world, r, gpu)].steps for r in sorted({0, heavy[o]})}
            for o in opts}


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


def forward_backward(shapes: Shapes, hw: Hardware, world: int, images_per_rank: int,
                     reduce_bytes: int = 4, blocks_per_unit: int = 1) -> dict[str, float]:
    """Compute at the assumed MFU, and the exposed part of FSDP2's collectives (plain FSDP over `world`, units of
    `blocks_per_unit` blocks: parallel.blocks_per_fsdp_unit)."""
    compute = shapes.flops_per_image * images_per_rank / (hw.matmul_flops * hw.mfu)
    if world == 1:
        return {"compute": compute, "fsdp": 0.0, "fsdp_exposed": 0.0}
    units = [sum(u) for u in fsdp_units(shapes.blocks, blocks_per_unit)]
    v = fsdp_volumes(shapes.params, units, world, 1, reduce_bytes, True)
    calls = 3 * len(units)  # per unit: all-gather forward, all-gather backward, reduce-scatter
    comm = v["fsdp_total"] / hw.link(world) + calls * hw.latency_s
    first = hw.latency_s + (world - 1) / world * units[0] * 2 / hw.link(world)
    return {"compute": compute, "fsdp": comm, "fsdp_exposed": first + max(0.0, comm - compute)}


def predict(shapes: Shapes, opt: Optim, hw: Hardware, world: int, images_per_rank: int = 0,
            floor: bool = False) -> dict:
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
        fb = forward_backward(shapes, hw, world, images_per_rank)
        out.update(fb, step=fb["compute"] + fb["fsdp_exposed"] + out["optimizer"])
    return out


def describe_prediction(model_cfg, optimizer_cfg, world: int, images_per_rank: int, device_name: str,
                        network: bool = True) -> str:
    """One line for the GPU check: this model's step time for the configuration on the device's profile;
    network=False for a rank whose peers are a fake process group (collectives free: only the compute and memory
    of one rank of `world`)."""
    hw = gpu_profile(device_name)
    if hw is None:
        return f"no cost-model profile for {device_name}"
    if not network:
        hw = replace(hw, intra_bytes_s=float("inf"), inter_bytes_s=float("inf"), latency_s=0.0)
    opt = Optim(optimizer_cfg.get("name", "muon"), int(optimizer_cfg.get("K", 1) or 1),
                optimizer_cfg.get("rownorm_scale", "spectral"), optimizer_cfg.get("distributed_mode", "owner"))
    p = predict(shapes_of(model_cfg), opt, hw, world, images_per_rank)
    return (f"cost model ({hw.name}, MFU {hw.mfu:g}): step {p['step'] * 1e3:.0f} ms = fwd+bwd "
            f"{p['compute'] * 1e3:.0f} + FSDP exposed {p['fsdp_exposed'] * 1e3:.0f} + optimizer "
            f"{p['optimizer'] * 1e3:.0f} (cycle mean)")


# ---- this host as a hardware profile ---------------------------------------------------------------------------
NS5_SIDES = (128, 256, 512, 1024)  # short sides at which the host's NS5 GEMM rate is measured


def gemm_rates_by_side(threads: int) -> list[list]:
    """[[r, flop/s], ...] of the plain NS5 iteration's three bf16 bmm's on 8 x r x 4r, by short side r."""
    import torch

    torch.set_num_threads(threads)
    rates = []
    for r in NS5_SIDES:
        B, c = 8, 4 * r
        X, A = torch.randn(B, r, c).bfloat16(), torch.randn(B, r, r).bfloat16()
        seconds = median_seconds(lambda: (torch.bmm(X, X.mT), torch.bmm(A, A), torch.bmm(A, X)))
        rates.append([r, B * (4 * r * r * c + 2 * r ** 3) / seconds])
    return rates


def measure_compute(threads: int) -> dict:
    """bf16 GEMM rates by short side r (the plain NS5 iteration's three bmm's on 8 x r x 4r), the streaming
    rate of torch's fused AdamW (28 B per element over 32M fp32 elements, far beyond the caches) and each op
    category's rate (op_cost.measure_op_rates, measure_fused_rate) and NS5's own matmuls (ns5_gemm_rates: every
    bmm/baddbmm it dispatches on a grid of shapes and batches, ~5 s of CPU at 1 thread), `threads` threads."""
    import torch

    _progress(f"{threads} thread(s): GEMM rates by side")
    rates = gemm_rates_by_side(threads)
    params = [torch.zeros(4 << 20, requires_grad=True) for _ in range(8)]
    for p in params:
        p.grad = torch.randn_like(p)
    adamw = torch.optim.AdamW(params, lr=1e-3, fused=True)
    _progress(f"{threads} thread(s): fused AdamW")
    stream = median_seconds(adamw.step)
    del params, adamw
    _progress(f"{threads} thread(s): op categories (stream, convert, reduce, matvec, dispatch, square GEMMs)")
    ops = measure_op_rates(threads)
    _progress(f"{threads} thread(s): the compiled RowNorm passes (compiles on the first run)")
    ops["fused"] = measure_fused_rate(threads)
    _progress(f"{threads} thread(s): NS5's own matmuls (op, layout, shape, batch)")
    return {"gemm_flops": max(rate for _, rate in rates), "ns5_rates": rates,
            "memory_bytes_s": ADAMW_BYTES * 32 * 2**20 / stream, "ops": ops, "ns5_gemms": measure_ns5_gemms(threads)}


def _progress(what: str) -> None:
    print(f"  measuring {what} ...", file=sys.stderr, flush=True)


def _gloo_rank(rank: int, world: int, port: int, queue, numel: int, work_numel: int, rounds: int) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    try:
        inp = torch.zeros(numel)
        out = torch.empty(world * inp.numel())
        tiny = torch.zeros(1)
        gather = median_seconds(lambda: (dist.barrier(), dist.all_gather_into_tensor(out, inp)))
        barrier = median_seconds(dist.barrier)
        latency = median_seconds(lambda: (dist.all_reduce(tiny), dist.barrier())) - barrier
        busy = _busy_latency_s(tiny, work_numel, rounds)
        sent = (world - 1) * inp.numel() * 4  # what one rank sends (collectives.py's all-gather count)
        cpu = _collective_cpu(lambda: dist.all_gather_into_tensor(out, inp), sent, tiny, rounds)
        if rank == 0:
            queue.put({"link_bytes_s": sent / max(gather - barrier - latency, 1e-9), "latency_s": max(latency, 0.0),
                       "busy_latency_s": busy, **cpu})
    finally:
        dist.destroy_process_group()


def _busy_latency_s(tiny, work_numel: int, rounds: int) -> float:
    """The cost of a collective between processes that compute between collectives, as the optimizer's ranks do
    (when processes outnumber the cores, a peer may be descheduled when the others arrive): every rank runs
    `rounds` x (an add over work_numel fp32 elements, a 4-byte all-reduce), against the same adds alone, all
    ranks at once in both; the difference per round."""
    import torch
    import torch.distributed as dist

    a, b = torch.randn(work_numel), torch.randn(work_numel)
    work = lambda: torch.add(a, b, out=a)  # noqa: E731
    alone = median_seconds(lambda: (dist.barrier(), [work() for _ in range(rounds)], dist.barrier()))
    synced = median_seconds(lambda: (dist.barrier(), [(work(), dist.all_reduce(tiny)) for _ in range(rounds)],
                                      dist.barrier()))
    return max(synced - alone, 0.0) / rounds


def other_threads_cpu_s() -> float | None:
    """CPU seconds run so far by this process's threads other than the calling one (Linux schedstat; None where it
    cannot be read): on a benchmark rank's main thread, gloo's worker and transport threads (torch's intra-op pool
    is idle between ops)."""
    me, total = threading.get_native_id(), 0
    try:
        for tid in os.listdir("/proc/self/task"):
            if int(tid) != me:
                with open(f"/proc/self/task/{tid}/schedstat") as f:
                    total += int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return total / 1e9


def _collective_cpu(gather, sent: int, tiny, calls: int) -> dict:
    """The CPU gloo's own threads spend on one rank for a collective (sharded_schedule charges it to the compute
    an asynchronous collective overlaps): {"cpu_s_per_call": a 4-byte all-reduce's, "cpu_s_per_byte": the
    all-gather's beyond that, per byte this rank sends (as many arrive)}, each less a barrier's, over `calls`
    calls; {} where the threads' CPU cannot be read."""
    import torch.distributed as dist

    def per_call(fn) -> float | None:
        dist.barrier()
        start = other_threads_cpu_s()
        for _ in range(calls):
            fn()
            dist.barrier()
        end = other_threads_cpu_s()
        return None if start is None or end is None else (end - start) / calls

    barrier, call, gathered = per_call(lambda: None), per_call(lambda: dist.all_reduce(tiny)), per_call(gather)
    if barrier is None or call is None or gathered is None:
        return {}
    return {"cpu_s_per_call": max(call - barrier, 0.0), "cpu_s_per_byte": max(gathered - barrier - call, 0.0) / sent}


def measure_gloo(world: int, numel: int = 4 << 20, work_numel: int = 1 << 18, rounds: int = 20) -> dict:
    """gloo between `world` processes on this host: the bytes/s one rank sends in an all-gather, the fixed cost
    of a collective (a 4-byte all-reduce) between otherwise idle processes, its cost between processes that
    compute between collectives (busy_latency_s), and the CPU gloo's threads spend per collective and per byte
    (_collective_cpu): numel fp32 elements gathered per rank (16 MB), work_numel per add between rounds of the
    busy measure (1 MB, ~0.1-1 ms), `rounds` of it and of each CPU measure (tests shrink them)."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    mp.start_processes(_gloo_rank, args=(world, port, queue, numel, work_numel, rounds), nprocs=world,
                       start_method="spawn")
    return queue.get(timeout=10)


def measure_host(worlds=(2, 4)) -> dict:
    cores = os.cpu_count() or 1
    threads = sorted({1, cores})
    compute = {str(t): measure_compute(t) for t in threads}
    gloo, python = {}, {}
    for w in worlds:
        _progress(f"gloo between {w} processes")
        gloo[str(w)] = measure_gloo(w)
        _progress(f"Python per op of the sharded step, rank 0 of {w} (shrunk model)")
        python[str(w)] = measure_python(w)
    return {"cores": cores, "compute": compute, "gloo": gloo, "python": python,
            "load_average": list(os.getloadavg())}


def host_profile(measured: dict, processes: int = 1) -> Hardware:
    """This host as the profile of one of `processes` processes sharing its cores, each with the benchmarks'
    cores // processes threads (at least one): rates of that thread count, times the share of the cores a
    process gets when there are more threads than cores."""
    threads = max(1, measured["cores"] // processes)
    share = core_share(measured, processes)
    rates = measured["compute"][str(threads)]
    if "ops" not in rates:
        raise ValueError("the host profile has no op rates (measured before op_cost.py): run --measure-host again")
    gloo = measured["gloo"].get(str(processes), {"link_bytes_s": float("inf"), "latency_s": 0.0})
    ops = host_op_rates(rates["ops"], rates["ns5_rates"], rates["memory_bytes_s"],
                        rates.get("ns5_gemms", ())).shared(share)
    return Hardware(f"this host ({processes} process(es) x {threads} thread(s))", rates["gemm_flops"] * share,
                    mfu=1.0, ns5_of_peak=1.0, memory_bytes_s=rates["memory_bytes_s"] * share, memory_efficiency=1.0,
                    intra_bytes_s=gloo["link_bytes_s"], inter_bytes_s=gloo["link_bytes_s"], link_efficiency=1.0,
                    devices_per_node=max(processes, 1), latency_s=gloo["latency_s"], launch_s=0.0,
                    rownorm_kernels="eager", ns5_rates=tuple((r, f * share) for r, f in rates["ns5_rates"]), ops=ops)


# ---- calibration against the CPU benchmarks' logs ---------------------------------------------------------------
# bench_optimizer's row -> (optimizer, step kind or None for the cycle average, RowNorm kernels)
BENCH_OPTIMIZER_ROWS = {
    "adamw": (Optim("adamw"), None, "eager"),
    "muon": (Optim("muon"), None, "eager"),
    "rownorm": (Optim("rownorm"), None, "eager"),  # the shipped config: compile_rownorm auto is eager on CPU
    "periodic_rowwise refresh step": (Optim("periodic_rowwise", 3), "refresh", "eager"),
    "periodic_rowwise non-refresh step, rownorm_scale=frobenius, eager":
        (Optim("periodic_rowwise", 3, "frobenius"), "rownorm", "eager"),
    "periodic_rowwise non-refresh step, rownorm_scale=spectral, eager":
        (Optim("periodic_rowwise", 3, "spectral"), "rownorm", "eager"),
    "periodic_rowwise non-refresh step, rownorm_scale=frobenius, compile_rownorm":
        (Optim("periodic_rowwise", 3, "frobenius"), "rownorm", "compiled"),
    "periodic_rowwise non-refresh step, rownorm_scale=spectral, compile_rownorm":
        (Optim("periodic_rowwise", 3, "spectral"), "rownorm", "compiled"),
    "periodic_rowwise K=3 average, rownorm_scale=spectral, compile_rownorm":
        (Optim("periodic_rowwise", 3, "spectral"), None, "compiled"),
}
# bench_optimizer's contenders in its phases line -> (optimizer, step kind, kernels)
BENCH_OPTIMIZER_PHASES = {
    "muon": (Optim("muon"), "refresh", "eager"), "rownorm": (Optim("rownorm"), "rownorm", "eager"),
    "periodic_rowwise non-refresh": (Optim("rownorm", scale="frobenius"), "rownorm", "eager"),
    "periodic_rowwise non-refresh compiled": (Optim("rownorm", scale="frobenius"), "rownorm", "compiled"),
    "periodic_rowwise non-refresh spectral compiled": (Optim("rownorm"), "rownorm", "compiled"),
}
BENCH_DISTRIBUTED_ROWS = {
    "adamw": Optim("adamw"), "muon-gather": Optim("muon", mode="gather"), "muon-owner": Optim("muon"),
    "periodic_rowwise K=3 gather": Optim("periodic_rowwise", 3, mode="gather"),
    "periodic_rowwise K=3 owner": Optim("periodic_rowwise", 3), "rownorm": Optim("rownorm"),
}
_ROW = re.compile(r"^\| ([^|]+?) \| ([0-9.]+) \|(.*)$")


def _model_of(line: str) -> tuple[str, int, int]:
    m = re.search(r"(dit_\w+) width (\d+) depth (\d+)", line)
    if not m:
        raise ValueError(f"no 'PRESET width W depth D' in: {line.strip()}")
    return m.group(1), int(m.group(2)), int(m.group(3))


def parse_bench_optimizer(text: str) -> tuple[tuple, dict[str, float]]:
    """((preset, width, depth), {row: median seconds}) from bench_optimizer's output."""
    model = _model_of(next(line for line in text.splitlines() if line.startswith("# optimizer step benchmark")))
    rows = {}
    for line in text.splitlines():
        m = _ROW.match(line)
        if m and m.group(1) in BENCH_OPTIMIZER_ROWS:
            rows[m.group(1)] = float(m.group(2)) / 1e3
    return model, rows


def parse_phases(text: str) -> dict[str, dict[str, float]]:
    """{contender: {phase: median seconds}} from bench_optimizer's 'phases (median ms):' line."""
    line = next((x for x in text.splitlines() if x.startswith("phases (median ms): ")), "")
    out = {}
    for part in line.removeprefix("phases (median ms): ").split("; ") if line else []:
        name, _, phases = part.rpartition(": ")
        out[name] = {p.rsplit(" ", 1)[0]: float(p.rsplit(" ", 1)[1]) / 1e3 for p in phases.split(", ")}
    return out


def phase_rows(measured: dict, optimizer_log: str) -> list[tuple]:
    """(contender, phase, counted s, measured s) for bench_optimizer's phases line."""
    from benchmarks.op_cost import phase_seconds

    (preset, width, depth), _ = parse_bench_optimizer(optimizer_log)
    shapes = model_shapes(preset, width, depth)
    rows = []
    for name, phases in parse_phases(optimizer_log).items():
        if name not in BENCH_OPTIMIZER_PHASES:
            continue
        opt, step, kernels = BENCH_OPTIMIZER_PHASES[name]
        hw = host_profile(measured, 1)
        counted = phase_seconds(counted_records(shapes, step, opt.scale, kernels), hw.op_rates())
        rows += [(name, ph, counted.get(ph, 0.0), sec) for ph, sec in sorted(phases.items()) if ph != "adamw"]
    return rows


def phase_table(rows: list[tuple]) -> str:
    lines = ["| bench_optimizer contender | phase | counted | measured | counted / measured |",
             "| --- | --- | ---: | ---: | ---: |"]
    lines += [f"| {name} | {ph} | {c * 1e3:.1f} ms | {m * 1e3:.1f} ms | {c / m if m else float('nan'):.2f} |"
              for name, ph, c, m in rows]
    return "\n".join(lines)


def parse_bench_distributed(text: str) -> dict[int, tuple[tuple, dict[str, tuple[float, float]]]]:
    """{processes: ((preset, width, depth), {row: (median seconds, mean MB per rank)})} from bench_distributed."""
    out: dict = {}
    current = None
    for line in text.splitlines():
        head = re.match(r"^### (\d+) process", line)
        if head:
            current = int(head.group(1))
            out[current] = (_model_of(line), {})
            continue
        m = _ROW.match(line)
        if current and m and m.group(1) in BENCH_DISTRIBUTED_ROWS:
            cols = [c.strip() for c in m.group(3).split("|")]
            out[current][1][m.group(1)] = (float(m.group(2)) / 1e3, float(cols[3]) * 2**20)
    return out


def calibration_rows(measured: dict, optimizer_log: str | None, distributed_log: str | None) -> list[tuple]:
    """(benchmark, processes, row, predicted, floor, measured, unit): predicted counted from the code, floor the
    first-principles floor (seconds; for bench_distributed also bytes rows, where both are the optimizer's count)."""
    rows = []
    if optimizer_log:
        (preset, width, depth), times = parse_bench_optimizer(optimizer_log)
        shapes = model_shapes(preset, width, depth)
        for label, sec in times.items():
            opt, step, kernels = BENCH_OPTIMIZER_ROWS[label]
            hw = replace(host_profile(measured, 1), rownorm_kernels=kernels)
            p, f = (predict(shapes, opt, hw, 1, floor=floor) for floor in (False, True))
            pick = (lambda q: q["steps"][step]) if step else (lambda q: q["optimizer"])
            rows.append(("bench_optimizer", 1, label, pick(p), pick(f), sec, "s"))
    if distributed_log:
        for procs, ((preset, width, depth), found) in parse_bench_distributed(distributed_log).items():
            shapes = model_shapes(preset, width, depth)
            hw = host_profile(measured, procs)
            for label, (sec, nbytes) in found.items():
                opt = BENCH_DISTRIBUTED_ROWS[label]
                f = predict(shapes, opt, hw, procs, floor=True)
                p = sharded_step(shapes, label, measured, procs)
                rows.append(("bench_distributed", procs, label, p["total_s"], f["optimizer"], sec, "s"))
                if nbytes:
                    rows.append(("bench_distributed", procs, label + " (MB/step/rank)", f["bytes"], f["bytes"],
                                 nbytes, "B"))
    return rows


_SHARDED: dict = {}


def sharded_cycle(shapes: Shapes, label: str, procs: int) -> list[list]:
    """bench_distributed's contender `label` counted on every rank of a fake group of `procs`
    (sharded_count.count_sharded_steps, cached): cycle[k][r] is step k on rank r."""
    from benchmarks.bench_distributed import CONTENDERS
    from benchmarks.sharded_count import count_sharded_steps

    key = (shapes, label, procs)
    if key not in _SHARDED:
        ranks = [count_sharded_steps(shapes.model, CONTENDERS[label], procs, rank=r) for r in range(procs)]
        _SHARDED[key] = [list(step) for step in zip(*ranks, strict=True)]
    return _SHARDED[key]


def step_kinds(opt: Optim, steps: int) -> list[str]:
    """The kinds of sharded_python's rates of `steps` consecutive steps from a cycle's start."""
    kinds = [k if k != "refresh" else f"refresh {opt.mode}" for k in opt.steps()]
    return [kinds[i % len(kinds)] for i in range(steps)]


def core_share(measured: dict, procs: int) -> float:
    """The share of a core each of bench_distributed's threads gets on this host: `procs` processes of
    cores // procs threads (at least one each)."""
    cores = measured["cores"]
    return min(1.0, cores / (procs * max(1, cores // procs)))


def python_rates(measured: dict, procs: int) -> dict | None:
    """{step kind: {class: seconds of Python per op}} of a process of `procs` (measured on one thread, divided by
    the share of a core it gets, as host_profile shares the op rates), or None where the profile has none."""
    python = measured.get("python", {}).get(str(procs))
    if python is None:
        return None
    share = core_share(measured, procs)
    return {kind: {cls: v / share for cls, v in rates.items()} for kind, rates in python.items()}


def collective_cpu_rates(measured: dict, procs: int) -> tuple[float, float] | None:
    """(seconds per collective, seconds per byte on the wire) that gloo's threads take from a process's share of
    the cores (measure_gloo's CPU, divided by core_share), or None where the profile has not measured them."""
    gloo = measured["gloo"][str(procs)]
    if "cpu_s_per_call" not in gloo:
        return None
    share = core_share(measured, procs)
    return gloo["cpu_s_per_call"] / share, gloo["cpu_s_per_byte"] / share


def sharded_step(shapes: Shapes, label: str, measured: dict, procs: int) -> dict:
    """bench_distributed's contender `label` on `procs` processes of this host: every rank's counted step replayed
    with the overlap the code has (sharded_schedule), ops at a process's share of the cores plus the Python per
    op where the profile has it, collectives at the gloo latency between busy processes where the profile has it
    (else between idle ones) and its bandwidth, and their CPU (gloo's threads) taken from the compute they overlap
    where the profile has it (collective_cpu_rates); the slowest rank's step, averaged over the cycle."""
    from benchmarks.sharded_schedule import mean_scheduled

    cycle = sharded_cycle(shapes, label, procs)
    gloo = measured["gloo"][str(procs)]
    latency = gloo.get("busy_latency_s", gloo["latency_s"])
    python = python_rates(measured, procs)
    per_step = [python[k] for k in step_kinds(BENCH_DISTRIBUTED_ROWS[label], len(cycle))] if python else None
    return mean_scheduled(cycle, host_profile(measured, procs).op_rates(), procs, gloo["link_bytes_s"], latency,
                          per_step, collective_cpu_rates(measured, procs))


def calibration_table(rows: list[tuple]) -> str:
    lines = ["| benchmark | processes | line | predicted (counted) | floor | measured | predicted / measured |",
             "| --- | ---: | --- | ---: | ---: | ---: | ---: |"]
    for bench, procs, label, pred, floor, meas, unit in rows:
        f = (lambda v: f"{v * 1e3:.1f} ms") if unit == "s" else (lambda v: f"{v / 2**20:.2f} MB")
        lines.append(f"| {bench} | {procs} | {label} | {f(pred)} | {f(floor)} | {f(meas)} | {pred / meas:.2f} |")
    timed = [pred / meas for *_, pred, _, meas, unit in rows if unit == "s"]
    inside = sum(0.75 <= r <= 1.25 for r in timed)
    lines.append(f"\n{inside} of {len(timed)} time lines within +-25% (predicted / measured "
                 f"{min(timed):.2f}-{max(timed):.2f})" if timed else "")
    return "\n".join(lines)


def sharded_table(measured: dict, distributed_log: str) -> str:
    """Where the counted step goes, per bench_distributed line and phase, against the log's phases (each the
    slowest rank's): the direction phase's ops (with their Python), the waits on collectives the schedule leaves
    exposed against the exposed wait measured, the other ops (momentum, update, AdamW) against the wall time less
    both."""
    lines = ["| processes | line | ops (rank 0) | collectives | Python priced | collectives' CPU charged | "
             "direction: predicted / measured | exposed wait: predicted / measured | collectives run (latency + "
             "wire) | other ops: predicted / rest of the wall | step: predicted / measured |",
             "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    ms = lambda a, b: f"{a * 1e3:.1f} / {b * 1e3:.1f} ms"  # noqa: E731
    logged = parse_distributed_phases(distributed_log)
    for procs, ((preset, width, depth), found) in parse_bench_distributed(distributed_log).items():
        shapes = model_shapes(preset, width, depth)
        for label, (sec, _) in found.items():
            p = sharded_step(shapes, label, measured, procs)
            comm, direction = logged[procs][label]
            lines.append(f"| {procs} | {label} | {p['ops']:.0f} | {p['collectives']:.1f} | "
                         f"{p['python_s'] * 1e3:.1f} ms | {p['collective_cpu_s'] * 1e3:.1f} ms | "
                         f"{ms(p['direction_s'], direction)} | "
                         f"{ms(p['exposed_s'], comm)} | {(p['latency_s'] + p['wire_s']) * 1e3:.1f} ms | "
                         f"{ms(p['other_s'], sec - comm - direction)} | {ms(p['total_s'], sec)} |")
    return "\n".join(lines)


def parse_distributed_phases(text: str) -> dict[int, dict[str, tuple[float, float]]]:
    """{processes: {row: (exposed comm s, direction s)}} from bench_distributed's 'exposed comm ms' and
    'direction ms' columns (each the slowest rank's)."""
    out: dict = {}
    current = None
    for line in text.splitlines():
        head = re.match(r"^### (\d+) process", line)
        if head:
            current = out.setdefault(int(head.group(1)), {})
            continue
        m = _ROW.match(line)
        if current is not None and m and m.group(1) in BENCH_DISTRIBUTED_ROWS:
            cols = m.group(3).split("|")  # after the ratio column: exposed comm, direction, ...
            current[m.group(1)] = (float(cols[1]) / 1e3, float(cols[2]) / 1e3)
    return out


# ---- the paper's table ---------------------------------------------------------------------------------------
PAPER_HEADLINE = {"optimizer": (-54.3, -46.9), "step": (-24.3, -15.7), "bytes": (-66.7, -66.7)}


def paper_contenders(mode: str) -> list[Optim]:
    """Muon and periodic_rowwise K=3 and K=5 with each RowNorm scale, all in distributed_mode `mode`."""
    return [Optim("muon", mode=mode)] + [Optim("periodic_rowwise", K, scale, mode)
                                         for K in (3, 5) for scale in ("frobenius", "spectral")]


def paper_table(hw: Hardware, presets=PAPER_PRESETS, worlds=PAPER_WORLDS, mode: str = "gather") -> str:
    """periodic_rowwise K=3 and K=5 (each RowNorm scale) against Muon, both in `mode`, at the scaling study's
    global batch: change of optimizer time, step time and logical optimizer bytes (rank 0's), each cell's optimizer
    counted on the sharded step at that preset and W and replayed on the hardware (sharded_optimizer), with the
    CPU seconds the counting took."""
    lines = [f"{hw.name}; {asdict(hw)}; global batch {PAPER_GLOBAL_BATCH}; distributed_mode {mode} for both; "
             "optimizer steps counted on the real sharded step (fake tensors, a fake process group of W) on rank 0 "
             "and the rank owning the most NS5 flops, replayed together (compute and communication streams)",
             "",
             "| preset | GPUs | Muon: fwd+bwd ms | FSDP exposed ms | optimizer ms | step ms | "
             "ranks counted (slowest) | periodic_rowwise | optimizer time | step time | logical bytes | counting s |",
             "| --- | ---: | ---: | ---: | ---: | ---: | --- | --- | ---: | ---: | ---: | ---: |"]
    total = 0.0
    for preset in presets:
        shapes = model_shapes(preset)
        for world in worlds:
            batch = PAPER_GLOBAL_BATCH // world
            contenders = paper_contenders(mode)
            start = time.process_time()
            ranks = counted_ranks(shapes, contenders, world, hw.rownorm_kernels == "compiled")
            counting = time.process_time() - start
            total += counting
            base = predict(shapes, contenders[0], hw, world, batch)
            for opt in contenders[1:]:
                p = predict(shapes, opt, hw, world, batch)
                pct = lambda k: f"{100 * (p[k] / base[k] - 1):+.1f}%"  # noqa: E731
                slow = ", ".join(f"{k} {r}" for k, r in sorted(p["slowest"].items()))
                lines.append(f"| {preset} | {world} | {base['compute'] * 1e3:.0f} | "
                             f"{base['fsdp_exposed'] * 1e3:.0f} | {base['optimizer'] * 1e3:.0f} | "
                             f"{base['step'] * 1e3:.0f} | {', '.join(map(str, sorted(ranks[opt])))} ({slow}) | "
                             f"K={opt.K} {opt.scale} | {pct('optimizer')} | {pct('step')} | {pct('bytes')} | "
                             f"{counting:.0f} |")
    lo, hi = PAPER_HEADLINE["optimizer"], PAPER_HEADLINE["step"]
    lines.append(f"\nthe paper's headline: optimizer time {lo[0]} to {lo[1]}%, step time {hi[0]} to {hi[1]}%, "
                 f"logical communication {PAPER_HEADLINE['bytes'][0]}%")
    lines.append(f"counting: {total:.0f} s of CPU (process time) for the {len(presets) * len(worlds)} cells, every "
                 "contender's counted steps of each cell on one fake sharded model per counted rank")
    return "\n".join(lines)


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    what = ap.add_mutually_exclusive_group(required=True)
    what.add_argument("--paper", action="store_true", help="the paper's table: presets x 8/16/32 GPUs")
    what.add_argument("--measure-host", action="store_true", help="measure this host's profile (GEMM, memory, gloo)")
    what.add_argument("--calibrate", action="store_true", help="predicted vs measured for the benchmarks' logs")
    ap.add_argument("--hardware", choices=sorted(PROFILES), default="h100")
    ap.add_argument("--mode", choices=("gather", "owner"), default="gather",
                    help="--paper: distributed_mode of both Muon and periodic_rowwise")
    ap.add_argument("--presets", nargs="+", default=list(PAPER_PRESETS), choices=PAPER_PRESETS)
    ap.add_argument("--worlds", nargs="+", type=int, default=list(PAPER_WORLDS))
    ap.add_argument("--save", default=HOST_PROFILE, help="--measure-host: where the profile goes (JSON)")
    ap.add_argument("--profile", default=HOST_PROFILE, help="--calibrate: the measured host profile")
    ap.add_argument("--bench-optimizer", help="--calibrate: a saved output of benchmarks/bench_optimizer.py")
    ap.add_argument("--bench-distributed", help="--calibrate: a saved output of benchmarks/bench_distributed.py")
    args = ap.parse_args(argv)
    if any(w < 2 or PAPER_GLOBAL_BATCH % w for w in args.worlds):
        ap.error(f"--worlds {args.worlds} is not valid: each >= 2 and dividing the global batch {PAPER_GLOBAL_BATCH}")
    if args.calibrate:
        if not (args.bench_optimizer or args.bench_distributed):
            ap.error("--calibrate needs --bench-optimizer LOG and/or --bench-distributed LOG")
        for path in (args.profile, args.bench_optimizer, args.bench_distributed):
            if path and not os.path.isfile(path):
                ap.error(f"{path} does not exist" + (" (run --measure-host first)" if path == args.profile else ""))
    return args


def main(argv=None) -> int:
    args = parse(argv)
    if args.measure_host:
        measured = measure_host()
        with open(args.save, "w") as f:
            json.dump(measured, f, indent=1)
        print(json.dumps(measured, indent=1))
        return 0
    if args.calibrate:
        with open(args.profile) as f:
            measured = json.load(f)
        logs = [open(p).read() if p else None for p in (args.bench_optimizer, args.bench_distributed)]
        print(calibration_table(calibration_rows(measured, *logs)))
        if logs[0]:
            print("\nwhere the time goes (bench_optimizer's phases line, counted at this profile's rates):\n")
            print(phase_table(phase_rows(measured, logs[0])))
        if logs[1]:
            print("\nwhere the distributed step goes (every rank counted on a fake process group and replayed with "
                  "the code's overlap, at this profile's rates; each column the slowest rank's):\n")
            print(sharded_table(measured, logs[1]))
        return 0
    print(paper_table(PROFILES[args.hardware], args.presets, args.worlds, args.mode))
    return 0


if __name__ == "__main__":
    sys.exit(main())
