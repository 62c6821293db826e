#!/usr/bin/env python
"""The sharded optimizers (docs/algorithms.md §6–7) on an FSDP2-sharded DiT preset: optimizer time, exposed communication
and logical optimizer bytes per step and rank, for every contender side by side in one run, as ratios to
muon in gather mode (the paper's baseline).

N processes (`--nproc`, several values run one after the other) form one group: gloo on CPU, NCCL on CUDA (one
GPU per process), chosen automatically, so the same command runs on both. The model is built on the meta
device, sharded with the trainer's FSDP2 plan (parallel.apply_fsdp: every block, then the root), filled with random
weights and fixed random gradients (a step's cost does not depend on their values). Each repetition runs 3
consecutive optimizer steps (one periodic K=3 cycle: refresh, RowNorm, RowNorm) of every contender in turn, so
background load hits all of them alike; per step the ranks start together (barrier) and the step's time is the
slowest rank's; the table shows medians over repetitions of the 3-step average.

Columns: ms per optimizer step; its ratio to muon-gather; exposed communication (time waiting on collectives,
the `comm` phase, slowest rank); direction compute (`direction` phase, slowest rank); logical optimizer bytes per
step and rank as counted by the optimizer (mean over ranks, and the busiest rank); the bytes' ratio to
muon-gather; whole-matrix directions (NS5 / wide MUD) computed per step on the busiest rank.

    python -m benchmarks.bench_distributed --nproc 2 4 --preset dit_m --hidden-size 512 --depth 8
    python -m benchmarks.bench_distributed --ns5-check --preset dit_1b3 --depth 4   # bf16 NS5 vs GEMM rate, 1 device
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from collections import defaultdict
from datetime import timedelta

import torch


CYCLE = 3  # steps per repetition: one periodic_rowwise K=3 cycle
BASELINE = "muon-gather"
CONTENDERS = {
    "adamw": {"name": "adamw"},
    "muon-gather": {"name": "muon", "distributed_mode": "gather"},
    "muon-owner": {"name": "muon", "distributed_mode": "owner"},
    "periodic_rowwise K=3 gather": {"name": "periodic_rowwise", "K": 3, "distributed_mode": "gather"},
    "periodic_rowwise K=3 owner": {"name": "periodic_rowwise", "K": 3, "distributed_mode": "owner"},
    "rownorm": {"name": "rownorm"},
    "mud": {"name": "mud", "distributed_mode": "gather"},  # as its published rows were measured
}


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", type=int, nargs="+", default=[2], help="process counts to run, one group each")
    ap.add_argument("--preset", default="dit_m", help="conf/model/<preset>.yaml")
    ap.add_argument("--hidden-size", type=int, default=None, help="width override (heads: width // 64)")
    ap.add_argument("--depth", type=int, default=None, help="depth override")
    ap.add_argument("--repeats", type=int, default=5, help="timed repetitions (3 steps each), median reported")
    ap.add_argument("--warmup", type=int, default=1, help="untimed repetitions first")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads per process (default: CPU cores // processes, at least 1)")
    ap.add_argument("--bucket-mb", type=float, default=None, help="bucket_mb override for every matrix optimizer")
    ap.add_argument("--only", nargs="+", default=None, help=f"contenders to run (default all: {', '.join(CONTENDERS)})")
    ap.add_argument("--ns5-check", action="store_true",
                    help="instead: bf16 NS5 throughput against the bf16 GEMM rate on one device, preset's shapes")
    return ap.parse_args(argv)


def model_config(args):
    from dit_train.model.dit import load_preset

    return load_preset(args.preset, args.hidden_size, args.depth)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- one rank -------------------------------------------------------------------------------------------------
def sharded_model(cfg, device):
    from dit_train.model.dit import build_model
    from dit_train.parallel.fsdp import ParallelPlan, apply_fsdp

    model = build_model(cfg, device="meta")
    apply_fsdp(model, model.blocks, ParallelPlan(sharded=True))
    model.to_empty(device=device)
    g = torch.Generator(device=device).manual_seed(1234 + torch.distributed.get_rank())
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().normal_(0.0, 0.02, generator=g)
            p.grad = torch.zeros_like(p)
            p.grad.to_local().normal_(0.0, 1e-3, generator=g)
    return model


def join_process_group(rank: int, world: int, port: int, threads: int | None) -> torch.device:
    """A benchmark rank's device and process group: NCCL on its GPU, or gloo with the cores split between ranks."""
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.set_num_threads(threads or max(1, (os.cpu_count() or 1) // world))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world,
                            timeout=timedelta(seconds=600), device_id=device if cuda else None)
    return device


def rank_main(rank, world, port, args, out_path):
    import torch.distributed as dist

    from dit_train.optim.registry import build_optimizer
    from dit_train.parallel.fsdp import shutdown_process_group
    from dit_train.telemetry.clocks import PhaseTimer

    device = join_process_group(rank, world, port, args.threads)
    try:
        cfg = model_config(args)
        model = sharded_model(cfg, device)
        names = args.only or list(CONTENDERS)
        extra = {"lr": 1e-6, "weight_decay": 0.01}
        opts = {}
        for label in names:
            c = {**extra, **CONTENDERS[label]}
            if args.bucket_mb and c["name"] != "adamw":
                c["bucket_mb"] = args.bucket_mb
            opts[label] = build_optimizer(model, c)
        timer = PhaseTimer(enabled=True, device=device)
        for opt in opts.values():
            opt.use_timer(timer)
        records = []  # (rep, label, step in cycle, wall s, phases, whole-matrix directions)
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        for rep in range(args.warmup + args.repeats):
            for label, opt in opts.items():
                for k in range(CYCLE):
                    sync()
                    dist.barrier()
                    timer.collect()
                    t0 = time.perf_counter()
                    opt.step()
                    sync()
                    wall = time.perf_counter() - t0
                    phases = timer.collect()
                    if rep >= args.warmup:
                        records.append((rep, label, k, wall, phases, getattr(opt, "last_whole_matrices", 0)))
            if rank == 0:
                print(f"  [{world} ranks] repetition {rep + 1}/{args.warmup + args.repeats} done", file=sys.stderr,
                      flush=True)
        everyone = [None] * world
        dist.all_gather_object(everyone, records)
        if rank == 0:
            from dit_train.optim.routing import route_parameters

            shapes = defaultdict(int)
            for _, p in route_parameters(model).matrix:
                shapes[tuple(p.shape)] += 1
            info = {"world": world, "device": str(device), "threads": torch.get_num_threads(),
                    "params": sum(p.numel() for p in model.parameters()), "shapes": dict(shapes),
                    "backend": dist.get_backend(), "width": cfg.hidden_size, "depth": cfg.depth,
                    "routing": opts[BASELINE].routing_table if BASELINE in opts else ""}
            torch.save({"info": info, "records": everyone}, out_path)
        # every rank past its last collective, and rank 0 (the store's host) the last to leave
        shutdown_process_group()
    finally:
        if dist.is_initialized():  # an exception before the shutdown: leave without waiting for the others
            dist.destroy_process_group()


# ---- the table ------------------------------------------------------------------------------------------------
def summarise(result) -> dict:
    """Per contender: medians over repetitions of the per-step averages (slowest rank for times)."""
    by = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))  # label -> rep -> quantity -> values
    world = len(result["records"])
    for rank, records in enumerate(result["records"]):
        for rep, label, k, wall, ph, whole in records:
            d = by[label][rep]
            d[("wall", k)].append(wall)
            d[("comm", k)].append(ph.get("time/comm", 0.0))
            d[("direction", k)].append(ph.get("time/direction", 0.0))
            d[("bytes", k, rank)].append(ph.get("comm_bytes/total", 0.0))
            d[("whole", k)].append(whole)
    out = {}
    for label, reps in by.items():
        per_rep = defaultdict(list)
        for rep, d in reps.items():
            per_rep["wall"].append(sum(max(d[("wall", k)]) for k in range(CYCLE)) / CYCLE)
            per_rep["comm"].append(sum(max(d[("comm", k)]) for k in range(CYCLE)) / CYCLE)
            per_rep["direction"].append(sum(max(d[("direction", k)]) for k in range(CYCLE)) / CYCLE)
            per_rank = [sum(d[("bytes", k, r)][0] for k in range(CYCLE)) / CYCLE for r in range(world)]
            per_rep["bytes_mean"].append(sum(per_rank) / world)
            per_rep["bytes_max"].append(max(per_rank))
            per_rep["whole"].append(sum(max(d[("whole", k)]) for k in range(CYCLE)) / CYCLE)
        out[label] = {k: statistics.median(v) for k, v in per_rep.items()}
        out[label]["wall_min"] = min(per_rep["wall"])
    return out


TIME_SLACK = 1.2  # a measured time may exceed its floor by 20% (bookkeeping, noise) and still meet it


def targets(s: dict, info: dict, args, p: int) -> list[tuple[str, float, float, str]]:
    """(line, measured ratio, target, derivation). Bytes: a K=3 cycle's floor is its refresh step's bytes plus two
    RowNorm steps' (the tall column sums, the spectral scale's power-iteration all-reduces), counted by the cost
    model under the optimizer's own rules (benchmarks/cost_model/shapes.py's rank_bytes; tests/unit/test_cost_model.py checks it
    against the optimizer's count). Time: a K=3 cycle cannot beat one muon step (its refresh) plus two RowNorm
    steps measured in the same run, so its floor is (muon-<mode> + 2 rownorm) / 3; target 1.2x that."""
    from benchmarks.cost_model.shapes import mean_bytes, model_shapes

    base, out = s[BASELINE], []
    shapes = model_shapes(args.preset, info["width"], info["depth"])
    refresh_gather = mean_bytes(shapes, "refresh", "spectral", "gather", p)
    rownorm = mean_bytes(shapes, "rownorm", "spectral", "gather", p) / refresh_gather
    for mode in ("gather", "owner"):
        k3, muon = s.get(f"periodic_rowwise K=3 {mode}"), s.get(f"muon-{mode}")
        if not k3:
            continue
        refresh = mean_bytes(shapes, "refresh", "spectral", mode, p) / refresh_gather
        out.append((f"periodic K=3 {mode}: logical bytes / muon-gather", k3["bytes_mean"] / base["bytes_mean"],
                    (refresh + 2 * rownorm) / 3 * 1.0005,
                    f"(refresh {refresh:.3f} + 2 x RowNorm step {rownorm:.4f}) / 3 of muon-gather's bytes"))
        if muon and "rownorm" in s:
            floor = (muon["wall"] + 2 * s["rownorm"]["wall"]) / 3 / base["wall"]
            out.append((f"periodic K=3 {mode}: optimizer time / muon-gather", k3["wall"] / base["wall"],
                        TIME_SLACK * floor, f"{TIME_SLACK:g} x (muon-{mode} + 2 x rownorm) / 3 = {TIME_SLACK:g} x "
                                            f"{floor:.3f} of muon-gather, measured here"))
    owner = s.get("muon-owner")
    if owner:  # owner mode sends 2 (p - 1) / p^2 of the matrices per rank on average, gather mode (p - 1) / p
        out.append(("muon-owner bytes per rank (mean) / muon-gather", owner["bytes_mean"] / base["bytes_mean"],
                    2 / p, "2 / p: each row out to its owner and back, against (p - 1) / p gathered"))
        out.append(("muon-owner bytes, busiest rank / muon-gather", owner["bytes_max"] / base["bytes_mean"], 2 / p,
                    "2 / p when owners hold equal bytes (they are balanced by NS5 flops)"))
    return out


def report(result, args) -> str:
    info, s = result["info"], summarise(result)
    p = info["world"]
    base = s.get(BASELINE)
    lines = [f"### {p} process(es): {info['backend']} on {info['device'].split(':')[0]}, {info['threads']} thread(s) "
             f"each; {args.preset} width {info['width']} depth {info['depth']}, {info['params'] / 1e6:.1f}M params",
             "",
             "| optimizer | opt ms/step | / muon-gather | exposed comm ms | direction ms | MB/step/rank (mean) | "
             "MB busiest rank | bytes / muon-gather | whole-matrix directions/step (busiest rank) |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for label in CONTENDERS:
        if label not in s:
            continue
        r = s[label]
        t_ratio = f"{r['wall'] / base['wall']:.2f}" if base else "-"
        b_ratio = f"{r['bytes_mean'] / base['bytes_mean']:.3f}" if base and base["bytes_mean"] else "-"
        lines.append(f"| {label} | {r['wall'] * 1e3:.1f} | {t_ratio} | {r['comm'] * 1e3:.1f} | "
                     f"{r['direction'] * 1e3:.1f} | {r['bytes_mean'] / 2**20:.2f} | {r['bytes_max'] / 2**20:.2f} | "
                     f"{b_ratio} | {r['whole']:.1f} |")
    lines.append("")
    if base and p > 1:
        lines.append("targets (ratios of medians; each target a floor derived as shown):")
        for name, value, goal, why in targets(s, info, args, p):
            lines.append(f"- {name}: {value:.3f}, target <= {goal:.3f} ({why}): "
                         f"{'met' if value <= goal else 'MISSED'}")
        lines.append("")
    lines.append("matrix shapes: " + ", ".join(f"{B}x{m}x{n}" for (m, n), B in sorted(info["shapes"].items())))
    return "\n".join(lines)


def run_group(world: int, args) -> dict:
    import tempfile

    import torch.multiprocessing as mp

    # the ranks fork from one server that imported this script, torch and the optimizers once (for all groups);
    # "spawn" re-imported them in every rank, seconds of CPU each that the ranks' 2-core host shares. torch._dynamo
    # too: every rank imported it anyway (its first meta-device op and its optimizer step do), ~0.8 s each
    mp.set_forkserver_preload(["__main__", "dit_train.optim.registry", "torch.distributed.fsdp", "torch._dynamo"])
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.pt")
        mp.start_processes(rank_main, args=(world, free_port(), args, out), nprocs=world,
                           start_method="forkserver")
        return torch.load(out, weights_only=True)


# ---- bf16 NS5 against the GEMM rate ----------------------------------------------------------------------------
def ns5_speed(model_cfg, device: torch.device, repeats: int) -> dict:
    """The optimizer's batched bf16 NS5 (newton_schulz5: automatic Gram form where it applies, and the plain
    iteration) over the matrix shapes of `model_cfg`, and bf16 bmm of the plain iteration's GEMMs at the same
    shapes; medians of `repeats` timed passes after one warm-up. Returns the shapes, the plain iteration's flops
    (credited to every variant) and seconds per pass of each."""
    from dit_train.model.dit import build_model
    from dit_train.optim.directions import newton_schulz5, ns5_flops
    from dit_train.optim.routing import route_parameters

    shapes = defaultdict(int)
    for _, p in route_parameters(build_model(model_cfg, device="meta")).matrix:
        shapes[tuple(p.shape)] += 1
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    flops = sum(B * ns5_flops(m, n) for (m, n), B in shapes.items())
    data = {s: torch.randn(B, *s, device=device).bfloat16() for s, B in shapes.items()}
    gemm = {}
    for (m, n), B in shapes.items():
        r, c = min(m, n), max(m, n)
        gemm[(m, n)] = (torch.randn(B, r, c, device=device).bfloat16(), torch.randn(B, r, r, device=device).bfloat16())
    ws = {s: {} for s in shapes}

    def timed(fn):
        times = []
        for _ in range(repeats + 1):
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - t0)
        return statistics.median(times[1:])

    def gemms():
        for X, A in gemm.values():
            for _ in range(5):
                torch.bmm(X, X.mT)
                torch.bmm(A, A)
                torch.bmm(A, X)

    def ns5(gram):
        for s, X in data.items():
            newton_schulz5(X, dtype=torch.bfloat16, gram=gram, workspace=ws[s])

    return {"shapes": dict(shapes), "flops": flops, "gemm_s": timed(gemms), "auto_s": timed(lambda: ns5(None)),
            "plain_s": timed(lambda: ns5(False))}


def ns5_check(args) -> str:
    """ns5_speed on one device (CUDA when present), as a markdown table."""
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = model_config(args)
    r = ns5_speed(cfg, device, max(3, args.repeats))
    flops, t_gemm, t_auto, t_plain = r["flops"], r["gemm_s"], r["auto_s"], r["plain_s"]
    rate = flops / t_gemm
    return "\n".join([
        f"### bf16 NS5 speed on {device.type} ({torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU'}), "
        f"{args.preset} width {cfg.hidden_size} depth {cfg.depth}: "
        + ", ".join(f"{B}x{m}x{n}" for (m, n), B in sorted(r["shapes"].items())),
        "",
        "| what | ms | TFLOP/s (plain-iteration flops) | / GEMM rate |",
        "| --- | ---: | ---: | ---: |",
        f"| bf16 bmm, the plain iteration's GEMMs | {t_gemm * 1e3:.1f} | {rate / 1e12:.1f} | 1.00 |",
        f"| newton_schulz5, automatic (Gram form where c >= 2r) | {t_auto * 1e3:.1f} | {flops / t_auto / 1e12:.1f} | "
        f"{flops / t_auto / rate:.2f} |",
        f"| newton_schulz5, plain iteration | {t_plain * 1e3:.1f} | {flops / t_plain / 1e12:.1f} | "
        f"{flops / t_plain / rate:.2f} |",
        "",
        f"NS5 flops per full pass (plain iteration): {flops / 1e9:.1f} GFLOP",
    ])


def main(argv=None):
    args = parse(argv)
    if args.ns5_check:
        print(ns5_check(args), flush=True)
        return
    unknown = [c for c in args.only or () if c not in CONTENDERS]
    if unknown:
        raise SystemExit(f"--only {unknown}: choose from {', '.join(CONTENDERS)}")
    if torch.cuda.is_available() and max(args.nproc) > torch.cuda.device_count():
        raise SystemExit(f"--nproc {max(args.nproc)} needs as many GPUs; {torch.cuda.device_count()} visible")
    cmd = "python -m benchmarks.bench_distributed " + " ".join(sys.argv[1:] if argv is None else argv)
    print(f"# distributed optimizer benchmark: `{cmd}`; torch {torch.__version__}", flush=True)
    for world in args.nproc:
        t0 = time.time()
        result = run_group(world, args)
        print(report(result, args), flush=True)
        try:
            load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
        except OSError:
            load = "n/a"
        print(f"wall {time.time() - t0:.0f} s; load average after (1, 5, 15 min): {load} on {os.cpu_count()} CPUs\n",
              flush=True)


if __name__ == "__main__":
    main()
