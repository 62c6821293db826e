"""The cost model's command line: `python -m benchmarks.cost_model --paper | --measure-host | --calibrate |
--calibrate-h200`."""

from __future__ import annotations

import argparse
import json
import os

from benchmarks import cost_model
from benchmarks.cost_model.calibration import (calibration_rows, calibration_table, phase_rows, phase_table,
                                               sharded_table)
from benchmarks.cost_model.hardware import PROFILES, ns5_from_gemm_curve
from benchmarks.cost_model.measure_host import (HOST_PROFILE, PROFILE_KEYS, REQUIRED_PROFILE_KEYS, measure_host,
                                                 profile_problem)
from benchmarks.cost_model.paper import PAPER_GLOBAL_BATCH, PAPER_PRESETS, PAPER_WORLDS, paper_table


def parse(argv=None):
    ap = argparse.ArgumentParser(prog="python -m benchmarks.cost_model",
                                 description=cost_model.__doc__.split("\n\n")[0])
    what = ap.add_mutually_exclusive_group(required=True)
    what.add_argument("--paper", action="store_true", help="the paper's table: presets x 8/16/32 GPUs")
    what.add_argument("--measure-host", action="store_true", help="measure this host's profile (GEMM, memory, gloo)")
    what.add_argument("--calibrate", action="store_true", help="predicted vs measured for the benchmarks' logs")
    what.add_argument("--calibrate-h200", action="store_true",
                      help="the H200 profile's forward + backward against the three GPU check runs "
                           "(docs/gpu_check_runs/), with the fit of its two parameters")
    ap.add_argument("--hardware", choices=sorted(PROFILES), default="h100")
    ap.add_argument("--mode", choices=("gather", "owner"), default="gather",
                    help="--paper: distributed_mode of both Muon and periodic_rowwise")
    ap.add_argument("--presets", nargs="+", default=list(PAPER_PRESETS), choices=PAPER_PRESETS)
    ap.add_argument("--worlds", nargs="+", type=int, default=list(PAPER_WORLDS))
    ap.add_argument("--ns5-from-gemm-curve", nargs="+", type=int, default=[], metavar="SIDE",
                    help="--paper: NS5's rate at these short sides from the profile's GEMM curve, not the nearest "
                         "measured side's at or below (a sensitivity; e.g. 2560 3072 for dit_4b and dit_9b)")
    ap.add_argument("--save", default=HOST_PROFILE, help="--measure-host: where the profile goes (JSON)")
    ap.add_argument("--profile", default=HOST_PROFILE, help="--calibrate: the measured host profile")
    ap.add_argument("--bench-optimizer", help="--calibrate: a saved output of benchmarks/bench_optimizer.py")
    ap.add_argument("--bench-distributed", help="--calibrate: a saved output of benchmarks/bench_distributed.py")
    args = ap.parse_args(argv)
    args.hw = PROFILES[args.hardware]
    if args.ns5_from_gemm_curve:
        try:
            args.hw = ns5_from_gemm_curve(args.hw, args.ns5_from_gemm_curve)
        except ValueError as e:
            ap.error(f"--ns5-from-gemm-curve: {e}")
    if any(w < 2 or PAPER_GLOBAL_BATCH % w for w in args.worlds):
        ap.error(f"--worlds {args.worlds} is not valid: each >= 2 and dividing the global batch {PAPER_GLOBAL_BATCH}")
    if args.calibrate:
        if not (args.bench_optimizer or args.bench_distributed):
            ap.error("--calibrate needs --bench-optimizer LOG and/or --bench-distributed LOG")
        for path in (args.profile, args.bench_optimizer, args.bench_distributed):
            if path and not os.path.isfile(path):
                file_error(ap, f"{path} does not exist" + (" (run --measure-host first)" if path == args.profile else ""))
        args.measured = read_profile(ap, args.profile)
    return args


def file_error(ap, message: str) -> None:
    """argparse's error line and exit 2, without the usage above it: the arguments were right, the file is not."""
    ap.exit(2, f"{ap.prog}: error: {message}\n")


def read_profile(ap, path: str) -> dict:
    """The host profile at `path`, or a one-line error (exit 2) naming the file, what is wrong and the
    valid keys: a file that is not a profile made a KeyError traceback deep in the calibration."""
    try:
        with open(path) as f:
            measured = json.load(f)
    except (OSError, ValueError) as e:
        file_error(ap, f"--profile {path}: not readable as JSON ({e}); a host profile is --measure-host's output")
    problem = profile_problem(measured)
    if problem:
        file_error(ap, f"--profile {path} {problem}; a host profile (--measure-host's output) has the keys "
                 f"{', '.join(PROFILE_KEYS)} ({', '.join(REQUIRED_PROFILE_KEYS)} required)")
    return measured


def main(argv=None) -> int:
    args = parse(argv)
    if args.measure_host:
        measured = measure_host()
        with open(args.save, "w") as f:
            json.dump(measured, f, indent=1)
        print(json.dumps(measured, indent=1))
        return 0
    if args.calibrate:
        measured = args.measured
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
    if args.calibrate_h200:
        from benchmarks.cost_model.gpu_calibration import fit_h200, table

        print(table())
        fit = fit_h200()
        print(f"\nrefitted on the fitting rows: memory_efficiency {fit['memory_efficiency']:.2f}, op_s "
              f"{fit['op_s'] * 1e6:.1f} us (sum of squared log errors {fit['squared_log_error']:.4f})")
        return 0
    print(paper_table(args.hw, args.presets, args.worlds, args.mode))
    return 0
