#!/usr/bin/env python
"""The whole-matrix exchange behind backward (optimizer.overlap_exchange, optim/backward_overlap.py): exposed
communication of muon (a refresh every step) in owner or gather mode (--mode) with the exchange in the step ("off")
and started in FSDP2's post-reduce hooks ("on"), side by side in one run.

N gloo processes (NCCL on CUDA) train one FSDP2-sharded DiT preset (the trainer's sharding plan) on random data:
per step forward, backward, optimizer step, each optimizer in turn in every round (both hold their own momentum;
the weights they move are the same model's), so background load hits both alike; the "on" optimizer's hooks
are switched off for the "off" step's backward, so that backward carries no exchange. Per step the ranks start
together (barrier) and the slowest rank counts. Columns: exposed communication inside the step (`comm` phase:
waiting on collectives), the optimizer step, backward, and backward + step; medians over rounds with [min, max].

    python -m benchmarks.bench_backward_overlap --mode owner --hidden-size 384 --depth 6 --rounds 8
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch


from benchmarks.bench_distributed import free_port, join_process_group, model_config

MODES = {"off": False, "on": True}


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--preset", default="dit_m")
    ap.add_argument("--hidden-size", type=int, default=384)
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--batch", type=int, default=4, help="images per rank and step")
    ap.add_argument("--rounds", type=int, default=8, help="timed rounds (one step of each mode per round)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--mode", choices=("owner", "gather"), default="owner", help="optimizer.distributed_mode")
    ap.add_argument("--bucket-mb", type=float, default=4.0, help="gather mode's bucket size")
    ap.add_argument("--threads", type=int, default=None)
    return ap.parse_args(argv)


def rank_main(rank, world, port, args, out_path):
    import torch.distributed as dist

    from dit_train.diffusion.flow import velocity_loss
    from dit_train.model.dit import build_model
    from dit_train.optim.registry import build_optimizer
    from dit_train.parallel.fsdp import ParallelPlan, apply_fsdp, shutdown_process_group
    from dit_train.telemetry.clocks import PhaseTimer

    device = join_process_group(rank, world, port, args.threads)
    cuda = device.type == "cuda"
    try:
        cfg = model_config(argparse.Namespace(preset=args.preset, hidden_size=args.hidden_size, depth=args.depth))
        torch.manual_seed(0)
        model = build_model(cfg, device=device)
        apply_fsdp(model, model.blocks, ParallelPlan(sharded=True))
        opts = {mode: build_optimizer(model, {"name": "muon", "lr": 1e-6, "weight_decay": 0.0,
                                              "distributed_mode": args.mode, "bucket_mb": args.bucket_mb,
                                              "overlap_exchange": on})
                for mode, on in MODES.items()}
        timer = PhaseTimer(enabled=True, device=device)
        for opt in opts.values():
            opt.use_timer(timer)
        g = torch.Generator(device=device).manual_seed(rank)
        shape = (args.batch, cfg.in_channels, cfg.image_size, cfg.image_size)
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        records = []
        for r in range(args.warmup + args.rounds):
            for mode, opt in opts.items():
                x = torch.randn(shape, generator=g, device=device)
                eps = torch.randn(shape, generator=g, device=device)
                t = torch.rand(args.batch, generator=g, device=device)
                y = torch.randint(0, cfg.num_classes, (args.batch,), generator=g, device=device)
                for other in opts.values():  # only the measured optimizer's hooks exchange in this backward
                    if other is not opt and other._overlap is not None:
                        other._overlap._valid = False  # reset by its zero_grad below
                sync()
                dist.barrier()
                timer.collect()
                t0 = time.perf_counter()
                with timer.phase("backward"):
                    velocity_loss(model, x, t, eps, y=y).backward()
                    sync()
                t1 = time.perf_counter()
                opt.gradients_scaled(False)  # no clipping here: the prefetch is used
                opt.step()
                sync()
                t2 = time.perf_counter()
                ph = timer.collect()
                for other in opts.values():
                    other.zero_grad(set_to_none=True)
                if r >= args.warmup:
                    records.append((r, mode, t1 - t0, t2 - t1, ph.get("time/comm", 0.0),
                                    opt.step_info().get("opt/exchanged_in_backward", 0.0)))
        everyone = [None] * world
        dist.all_gather_object(everyone, records)
        if rank == 0:
            torch.save({"records": everyone, "params": sum(p.numel() for p in model.parameters())}, out_path)
        # every rank past its last collective, and rank 0 (the store's host) the last to leave
        shutdown_process_group()
    finally:
        if dist.is_initialized():  # an exception before the shutdown: leave without waiting for the others
            dist.destroy_process_group()


def report(result, args) -> str:
    per = {}  # (round, mode) -> slowest rank's (backward, step, comm), and matrices exchanged in backward
    for records in result["records"]:
        for r, mode, bwd, step, comm, used in records:
            old = per.get((r, mode), (0.0, 0.0, 0.0, used))
            per[(r, mode)] = (max(old[0], bwd), max(old[1], step), max(old[2], comm), used)
    bucket = f", bucket_mb {args.bucket_mb:g}" if args.mode == "gather" else ""
    lines = [f"### muon, {args.mode} mode, {args.nproc} processes, {args.preset} width {args.hidden_size} depth "
             f"{args.depth}, {result['params'] / 1e6:.1f}M params, {args.batch} images/rank{bucket}, "
             f"{args.rounds} rounds: median [min, max] ms", "",
             "| exchange | exposed comm in step | optimizer step | backward | backward + step | matrices behind backward |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    med = {}
    for mode in MODES:
        rows = [v for (r, m), v in sorted(per.items()) if m == mode]
        cols = [[v[0] for v in rows], [v[1] for v in rows], [v[2] for v in rows], [v[0] + v[1] for v in rows]]
        med[mode] = [statistics.median(c) for c in cols]
        cell = [f"{statistics.median(c) * 1e3:.1f} [{min(c) * 1e3:.1f}, {max(c) * 1e3:.1f}]" for c in cols]
        lines.append(f"| {mode} | {cell[2]} | {cell[1]} | {cell[0]} | {cell[3]} | {rows[0][3]:.0f} |")
    on, off = med["on"], med["off"]
    comm_ratio = on[2] / off[2] if off[2] else float("nan")
    total_ratio = on[3] / off[3]
    lines += ["", "targets (ratios of medians, on / off):",
              f"- exposed comm in the step: {comm_ratio:.3f}, target <= 0.5: {'met' if comm_ratio <= 0.5 else 'MISSED'}",
              f"- backward + step: {total_ratio:.3f}, target <= 1.0: {'met' if total_ratio <= 1.0 else 'MISSED'}"]
    return "\n".join(lines)


def main(argv=None):
    import tempfile

    import torch.multiprocessing as mp

    args = parse(argv)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.pt")
        mp.start_processes(rank_main, args=(args.nproc, free_port(), args, out), nprocs=args.nproc,
                           start_method="spawn")
        print(report(torch.load(out, weights_only=True), args))


if __name__ == "__main__":
    main()
