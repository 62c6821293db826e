"""Is NS5 priced at what it takes? One process, side by side: the optimizer's own NS5 direction on the matrices of
a calibration model (stacked per shape, as Muon stacks them, with a reused workspace), timed; and the cost model's
price of the same direction phase as op_cost counts it, from rates measured in this same run: NS5's own matmuls
(ns5_gemm_rates.py) and, for comparison, the square and NS5-mix GEMM rates by side that priced them before.

    python -m benchmarks.ns5_price_check [--preset dit_m --hidden-size 512 --depth 8] [--threads 1] [--cpu-time]

--cpu-time (one thread only): every time is the thread's CPU time, not wall time, so that a loaded host's waits for
a core drop out of both sides; it checks the mechanism, not this host's idle rates.
"""

from __future__ import annotations

import argparse
import os
import sys
from contextlib import nullcontext
from dataclasses import replace

import torch

from benchmarks.cost_model.measure_host import gemm_rates_by_side
from benchmarks.cost_model.predict import counted_records
from benchmarks.cost_model.shapes import model_shapes
from benchmarks.ns5_gemm_rates import measure_ns5_gemms, ns5_group
from benchmarks.op_cost import host_op_rates, measure_op_rates, median_seconds, seconds, thread_clock
from dit_train.optim.directions import NS5


def real_direction_seconds(shapes, repeats: int) -> float:
    """Median seconds of Muon's direction phase run for real: NS5 (bf16, 5 steps, automatic form) on every shape
    group's [count, m, n] bf16 stack, each with its own workspace."""
    group = ns5_group()
    ns5 = NS5()
    stacks = [(torch.randn(count, m, n).bfloat16(), {}) for (m, n), count in shapes.matrices]
    return median_seconds(lambda: [ns5(U, group, ws) for U, ws in stacks], repeats)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="dit_m")
    ap.add_argument("--hidden-size", type=int, default=512)
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--cpu-time", action="store_true", help="thread CPU time instead of wall time (--threads 1)")
    args = ap.parse_args(argv)
    if args.cpu_time and args.threads != 1:
        ap.error(f"--cpu-time measures one thread's CPU time: it needs --threads 1, not {args.threads}")
    if args.threads < 1 or args.repeats < 1:
        ap.error("--threads and --repeats must be >= 1")
    shapes = model_shapes(args.preset, args.hidden_size, args.depth)
    records = [r for r in counted_records(shapes, "refresh", "spectral", "eager") if r.phase == "direction"]
    load = os.getloadavg()
    torch.set_num_threads(args.threads)
    with thread_clock() if args.cpu_time else nullcontext():
        real = real_direction_seconds(shapes, args.repeats)
        ops = measure_op_rates(args.threads)
        rates = host_op_rates(ops, gemm_rates_by_side(args.threads), 1.0, measure_ns5_gemms(args.threads))
        real_again = real_direction_seconds(shapes, args.repeats)
    by_side = replace(rates, ns5=())
    priced = {name: sum(seconds(rec, r) for rec in records) for name, r in (("ns5", rates), ("by side", by_side))}
    gemm = {name: sum(seconds(rec, r) for rec in records if rec.category == "gemm")
            for name, r in (("ns5", rates), ("by side", by_side))}
    clock = "thread CPU time" if args.cpu_time else "wall time"
    print(f"# NS5 priced vs run: {args.preset} width {args.hidden_size} depth {args.depth}, {args.threads} thread(s), "
          f"{clock}; load average {load[0]:.1f} before, {os.getloadavg()[0]:.1f} after")
    print(f"matrices {shapes.matrices}; direction phase counted: {len(records)} ops "
          f"({sum(r.category == 'gemm' for r in records)} GEMMs)")
    print(f"real NS5 direction: {real * 1e3:.1f} ms before the rates were measured, {real_again * 1e3:.1f} after")
    mean = (real + real_again) / 2
    for name in ("ns5", "by side"):
        print(f"priced, GEMMs at {'NS5 own matmul rates' if name == 'ns5' else 'the square / mix rates by side'}: "
              f"{priced[name] * 1e3:.1f} ms (GEMMs {gemm[name] * 1e3:.1f}); priced / real {priced[name] / mean:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
