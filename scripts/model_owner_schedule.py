#!/usr/bin/env python
"""A discrete-event model of the whole-matrix direction stage (NS5) of one refresh step on W GPUs: the owner
schedule (dit_train/optim/owner_exchange.py: one all-to-all per shape group each way, IN_FLIGHT groups in flight),
against the per-bucket owner schedule it replaced and gather mode (whole_matrix_exchange.py), both with
`--bucket-mb` buckets. Prints, per preset and W, the stage's time against the busiest rank's ideal share (total
NS5 flops / W at the NS5 rate); target: owner <= 1.3x ideal.

    python scripts/model_owner_schedule.py [--presets dit_1b3 dit_4b dit_9b dit_15b] [--worlds 8 16 32]
        [--tflops 500] [--inter-gbit 200] [--nvlink-gbyte 450] [--gpus-per-node 8] [--bucket-mb 16]
    python scripts/model_owner_schedule.py --measure-cpu --cpu-speedup 2000   # NS5 rate per shape measured here

The matrices are the real preset's (built on the meta device, routed as the optimizer routes them). Each rank
has a compute stream and one communication stream; what the model assumes:
- a batched NS5 of L matrices of one shape takes L x ns5_flops / rate + `--launch-us` (its ~20 kernel launches);
  the rate is `--tflops`, or with --measure-cpu this machine's bf16 NS5 rate per shape (timed at 1/`--cpu-shrink`
  of each dimension) times `--cpu-speedup`;
- collectives run one at a time per rank, in issue order (NCCL: one stream per process group), each starting when
  every rank has issued it and the compute issued before it on every rank is done (PyTorch makes the
  communication stream wait for the current stream), and lasting `--latency-us` plus the slowest rank's transfer:
  per rank max(bytes to/from other nodes / inter-node rate, bytes to/from its own node / NVLink rate), ranks
  `--gpus-per-node` to a node; an all-gather moves (W - 1)/W of a bucket through every rank at the rate of
  the slowest link in the ring;
- a compute waits for the collective it reads; copies (assembling matrices, packing) are not modelled, and
  compute and communication overlap fully.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import defaultdict
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from dit_train.optim.collectives import shard_rows  # noqa: E402
from dit_train.optim.directions import ns5_flops  # noqa: E402
from dit_train.optim.owner_exchange import IN_FLIGHT, PER_RANK, plan_exchanges  # noqa: E402
from dit_train.optim.whole_matrix_exchange import plan_buckets  # noqa: E402

PRESETS = ("dit_1b3", "dit_4b", "dit_9b", "dit_15b")
BF16 = 2


@dataclass
class Net:
    inter_bytes_s: float  # per GPU, to other nodes
    nvlink_bytes_s: float  # per GPU, within a node
    gpus_per_node: int
    latency_s: float

    def node(self, r: int) -> int:
        return r // self.gpus_per_node

    def all_to_all(self, sent: list[list[float]]) -> float:
        """sent[a][b]: bytes from rank a to rank b."""
        w, worst = len(sent), 0.0
        for r in range(w):
            io = {"inter": [0.0, 0.0], "intra": [0.0, 0.0]}
            for q in range(w):
                if q == r:
                    continue
                link = "intra" if self.node(q) == self.node(r) else "inter"
                io[link][0] += sent[r][q]
                io[link][1] += sent[q][r]
            worst = max(worst, max(io["inter"]) / self.inter_bytes_s, max(io["intra"]) / self.nvlink_bytes_s)
        return self.latency_s + worst

    def all_gather(self, total_bytes: float, w: int) -> float:
        rate = self.nvlink_bytes_s if w <= self.gpus_per_node else self.inter_bytes_s
        return self.latency_s + total_bytes * (w - 1) / w / rate


# ---- the simulator ----------------------------------------------------------------------------------------------
@dataclass(eq=False)  # compared by identity: the same collective on every rank's program
class Coll:
    seconds: float


@dataclass
class Compute:
    after: int  # index of the collective it reads
    seconds: float


def simulate(programs: list[list]) -> tuple[float, list[float], float]:
    """programs[r]: rank r's ops in issue order, Coll (the same sequence on every rank, durations taken from rank
    0's) and Compute. Returns (time when everything is done, each rank's compute busy time, the communication
    stream's busy time: the network floor of the schedule)."""
    w = len(programs)
    colls = [[op for op in prog if isinstance(op, Coll)] for prog in programs]
    n_coll = len(colls[0])
    assert all(len(c) == n_coll for c in colls), "every rank issues the same collectives"
    issued_after = [[0.0] * n_coll for _ in range(w)]  # compute-stream time at the issue of each collective
    end = [None] * n_coll
    busy, compute_free = [0.0] * w, [0.0] * w
    pos, next_coll = [0] * w, [0] * w
    comm_free = 0.0
    progress = True
    while progress:
        progress = False
        for r in range(w):  # run each rank until it needs a collective that has not been timed yet
            prog = programs[r]
            while pos[r] < len(prog):
                op = prog[pos[r]]
                if isinstance(op, Coll):
                    issued_after[r][next_coll[r]] = compute_free[r]
                    next_coll[r] += 1
                else:
                    if end[op.after] is None:
                        break
                    start = max(compute_free[r], end[op.after])
                    compute_free[r] = start + op.seconds
                    busy[r] += op.seconds
                pos[r] += 1
                progress = True
        for c in range(n_coll):  # in order, time every collective that all ranks have issued
            if end[c] is not None:
                continue
            if not all(next_coll[r] > c for r in range(w)):
                break
            start = max([comm_free] + [issued_after[r][c] for r in range(w)])
            end[c] = comm_free = start + colls[0][c].seconds
            progress = True
    assert all(p == len(prog) for p, prog in zip(pos, programs)), "deadlock in the schedule"
    return max([comm_free] + compute_free), busy, sum(c.seconds for c in colls[0])


# ---- the schedules ----------------------------------------------------------------------------------------------
def rows(m: int, w: int) -> list[int]:
    return [k for _, k in shard_rows(m, w)]


def owner_schedule(groups: dict, w: int, net: Net, ns5_s, in_flight: int = IN_FLIGHT,
                   per_rank: int = PER_RANK) -> list[list]:
    """owner_exchange.owner_directions: per exchange one all-to-all in, a batched NS5 per owner, one back."""
    exchanges = plan_exchanges({s: (s, c) for s, c in groups.items()}, w, per_rank)
    inbound, back, compute = [], [], []
    for ex in exchanges:
        (m, n), counts, rs = ex.key, ex.counts, rows(ex.key[0], w)
        inbound.append(Coll(net.all_to_all([[counts[o] * rs[r] * n * BF16 for o in range(w)] for r in range(w)])))
        back.append(Coll(net.all_to_all([[counts[o] * rs[r] * n * BF16 for r in range(w)] for o in range(w)])))
        compute.append([ns5_s((m, n), counts[r]) for r in range(w)])
    programs = []
    for r in range(w):
        prog = [inbound[i] for i in range(min(in_flight, len(exchanges)))]
        for i in range(len(exchanges)):
            prog.append(Compute(_coll_index(prog, inbound[i]), compute[i][r]))
            prog.append(back[i])
            if i + in_flight < len(exchanges):
                prog.append(inbound[i + in_flight])
        programs.append(prog)
    return programs


def _coll_index(prog: list, coll: Coll) -> int:
    return [op for op in prog if isinstance(op, Coll)].index(coll)


def old_owner_schedule(groups: dict, w: int, net: Net, ns5_s, bucket_mb: float) -> list[list]:
    """The per-bucket owner exchange this schedule replaced: buckets of bucket_mb, owners by greedy NS5 flops per
    bucket; bucket b+1's inbound exchange issued before bucket b is computed, its return after."""
    buckets = plan_buckets({(s,): c for s, c in groups.items()}, BF16, bucket_mb * 2**20)
    load, owner = [0] * w, {}
    for bucket in buckets:
        for it in sorted(bucket, key=lambda it: -ns5_flops(*it.shape)):
            o = min(range(w), key=lambda q: (load[q], q))
            owner[it], load[o] = o, load[o] + ns5_flops(*it.shape)
    inbound, back, compute = [], [], []
    for bucket in buckets:
        to, fro = [[0.0] * w for _ in range(w)], [[0.0] * w for _ in range(w)]
        per_rank = [defaultdict(int) for _ in range(w)]
        for it in bucket:
            (m, n), o = it.shape, owner[it]
            per_rank[o][(m, n)] += 1
            for r, k in enumerate(rows(m, w)):
                to[r][o] += k * n * BF16
                fro[o][r] += k * n * BF16
        inbound.append(Coll(net.all_to_all(to)))
        back.append(Coll(net.all_to_all(fro)))
        compute.append([sum(ns5_s(s, c) for s, c in per_rank[r].items()) for r in range(w)])
    programs = []
    for r in range(w):
        prog = [inbound[0]]
        for b in range(len(buckets)):
            if b + 1 < len(buckets):
                prog.append(inbound[b + 1])
            prog.append(Compute(_coll_index(prog, inbound[b]), compute[b][r]))
            prog.append(back[b])
        programs.append(prog)
    return programs


def gather_schedule(groups: dict, w: int, net: Net, ns5_s, bucket_mb: float) -> list[list]:
    """whole_matrix_exchange.gather_directions: per bucket one all-gather, every rank computes every matrix."""
    buckets = plan_buckets({(s,): c for s, c in groups.items()}, BF16, bucket_mb * 2**20)
    gathers, compute = [], []
    for bucket in buckets:
        by_shape = defaultdict(int)
        for it in bucket:
            by_shape[it.shape] += 1
        size = sum(w * -(-m // w) * n * BF16 * c for (m, n), c in by_shape.items())
        gathers.append(Coll(net.all_gather(size, w)))
        compute.append(sum(ns5_s(s, c) for s, c in by_shape.items()))
    programs = []
    for r in range(w):
        prog = [gathers[0]]
        for b in range(len(buckets)):
            if b + 1 < len(buckets):
                prog.append(gathers[b + 1])
            prog.append(Compute(_coll_index(prog, gathers[b]), compute[b]))
        programs.append(prog)
    return programs


# ---- inputs -----------------------------------------------------------------------------------------------------
def preset_groups(preset: str) -> dict[tuple[int, int], int]:
    """{(m, n): count} of the preset's matrix parameters, in the order the optimizer stacks them."""
    from dit_train.model.dit import build_model, load_preset
    from dit_train.optim.routing import route_parameters

    groups: dict = {}
    for _, p in route_parameters(build_model(load_preset(preset), device="meta")).matrix:
        groups[tuple(p.shape)] = groups.get(tuple(p.shape), 0) + 1
    return groups


def measured_rates(shapes, shrink: int, speedup: float) -> dict:
    """flop/s of this machine's batched bf16 NS5 per shape, timed at 1/shrink of each dimension, x speedup."""
    import torch

    from dit_train.optim.directions import newton_schulz5

    out = {}
    for m, n in shapes:
        a, b = max(1, m // shrink), max(1, n // shrink)
        X = torch.randn(2, a, b).bfloat16()
        ws: dict = {}
        newton_schulz5(X, workspace=ws)
        t0 = time.perf_counter()
        for _ in range(3):
            newton_schulz5(X, workspace=ws)
        out[(m, n)] = 3 * 2 * ns5_flops(a, b) / (time.perf_counter() - t0) * speedup
    return out


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", nargs="+", default=list(PRESETS))
    ap.add_argument("--worlds", type=int, nargs="+", default=[8, 16, 32])
    ap.add_argument("--tflops", type=float, default=500.0, help="bf16 NS5 rate per GPU, TFLOP/s")
    ap.add_argument("--launch-us", type=float, default=30.0, help="fixed cost of one batched NS5 call")
    ap.add_argument("--inter-gbit", type=float, default=200.0, help="inter-node bandwidth per GPU, Gbit/s")
    ap.add_argument("--nvlink-gbyte", type=float, default=450.0, help="NVLink bandwidth per GPU and direction, GB/s")
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--latency-us", type=float, default=30.0, help="fixed cost of one collective")
    ap.add_argument("--bucket-mb", type=float, default=16.0, help="bucket size of the old owner and gather schedules")
    ap.add_argument("--in-flight", type=int, default=IN_FLIGHT, help="groups in flight in the owner schedule")
    ap.add_argument("--per-rank", type=int, default=PER_RANK,
                    help="matrices per rank in one owner exchange (0: a whole shape group)")
    ap.add_argument("--measure-cpu", action="store_true", help="NS5 rate per shape measured here (see --cpu-*)")
    ap.add_argument("--cpu-shrink", type=int, default=8, help="with --measure-cpu: time NS5 at 1/k of each dim")
    ap.add_argument("--cpu-speedup", type=float, default=2000.0, help="with --measure-cpu: GPU / this CPU")
    args = ap.parse_args(argv)
    for name in ("tflops", "inter_gbit", "nvlink_gbyte", "gpus_per_node", "in_flight", "bucket_mb", "cpu_shrink",
                 "cpu_speedup"):
        if getattr(args, name) <= 0:
            ap.error(f"--{name.replace('_', '-')}={getattr(args, name)} is not valid; expected > 0")
    if min(args.worlds) < 2:
        ap.error(f"--worlds {args.worlds} is not valid; expected world sizes >= 2")
    bad = [p for p in args.presets if p not in PRESETS]
    if bad:
        ap.error(f"--presets {bad} not valid; choose from {', '.join(PRESETS)}")
    return args


def main(argv=None) -> None:
    args = parse(argv)
    net = Net(args.inter_gbit * 1e9 / 8, args.nvlink_gbyte * 1e9, args.gpus_per_node, args.latency_us * 1e-6)
    print(f"NS5 {'measured here x %g' % args.cpu_speedup if args.measure_cpu else '%g TFLOP/s' % args.tflops}, "
          f"{args.launch_us:g} us per batched call; {args.inter_gbit:g} Gbit/s between nodes, "
          f"{args.nvlink_gbyte:g} GB/s NVLink, {args.gpus_per_node} GPUs per node, {args.latency_us:g} us per "
          f"collective; old schedules: {args.bucket_mb:g} MB buckets; owner: matrices per rank per exchange "
          f"{args.per_rank or 'all of a group'}, {args.in_flight} exchanges in flight\n")
    print("| preset | W | ideal share s | owner s | / ideal | owner busiest NS5 s | owner network s | old owner s | "
          "/ ideal | gather s | / ideal | target owner <= 1.3x ideal |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for preset in args.presets:
        groups = preset_groups(preset)
        rate = measured_rates(groups, args.cpu_shrink, args.cpu_speedup) if args.measure_cpu else \
            {s: args.tflops * 1e12 for s in groups}
        ns5_s = lambda s, c: c * ns5_flops(*s) / rate[s] + args.launch_us * 1e-6 if c else 0.0  # noqa: E731
        total = sum(c * ns5_flops(*s) / rate[s] for s, c in groups.items())
        for w in args.worlds:
            ideal = total / w
            owner, busy, network = simulate(owner_schedule(groups, w, net, ns5_s, args.in_flight, args.per_rank))
            old, *_ = simulate(old_owner_schedule(groups, w, net, ns5_s, args.bucket_mb))
            gather, *_ = simulate(gather_schedule(groups, w, net, ns5_s, args.bucket_mb))
            verdict = "met" if owner <= 1.3 * ideal else "MISSED"
            if owner > 1.3 * ideal and network > 1.3 * ideal:
                verdict += f" (bandwidth-bound: network alone {network / ideal:.2f}x)"
            print(f"| {preset} | {w} | {ideal:.3f} | {owner:.3f} | {owner / ideal:.2f} | {max(busy):.3f} | "
                  f"{network:.3f} | "
                  f"{old:.3f} | {old / ideal:.1f} | {gather:.3f} | {gather / ideal:.1f} | {verdict} |")


if __name__ == "__main__":
    main()
