#!/usr/bin/env python
"""Rounds of the cost model's calibration on this host (docs/cost_model.md, "Calibration on this host"): each round
measures the host profile (python -m benchmarks.cost_model --measure-host, with the Python per op of the sharded
step and the gloo latency between busy processes), then the two benchmarks the calibration reads, one after the
other, and saves all three under OUT/round_<i>/; at the end, ONE table: every calibration line's predicted /
measured per round, its range over the rounds, and per round the count within +-25%. Run it on an idle machine: the
profile and the benchmarks must be measured together, and repeated, for a range (one pair of measurements is not a
calibration).

    python -m benchmarks.calibration_round --rounds 3 --out docs/cost_model/rounds

About 5 minutes a round on the idle 2-core host (measure-host ~2, bench_distributed ~1, bench_optimizer ~2), plus
~2 minutes once for counting the sharded steps; it prints each stage as it starts and ends. --tiny (for tests):
the profile copied from --profile-from instead of measured, the benchmarks on a tiny model with one repetition.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

from dit_train.config.override_text import shell_command

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH_DISTRIBUTED = ["--nproc", "2", "4", "--preset", "dit_m", "--hidden-size", "256", "--depth", "4", "--repeats",
                     "5", "--only", "adamw", "muon-gather", "muon-owner", "periodic_rowwise K=3 gather",
                     "periodic_rowwise K=3 owner", "rownorm"]
BENCH_OPTIMIZER = ["--preset", "dit_m", "--hidden-size", "512", "--depth", "8", "--quick", "--repeats", "5",
                   "--warmup", "2"]
TINY_DISTRIBUTED = ["--nproc", "2", "--preset", "dit_xs", "--hidden-size", "64", "--depth", "1", "--repeats", "1",
                    "--warmup", "0", "--only", "adamw", "rownorm"]
TINY_OPTIMIZER = ["--preset", "dit_xs", "--hidden-size", "64", "--depth", "1", "--quick", "--no-compile",
                  "--repeats", "1", "--warmup", "0"]
EXPECTED_MIN = {"measure-host": 2, "bench_distributed": 1, "bench_optimizer": 2}  # idle 2-core host, per round
FILES = {"measure-host": "host_profile.json", "bench_distributed": "bench_distributed.txt",
         "bench_optimizer": "bench_optimizer.txt"}
BAND = (0.75, 1.25)


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="rounds, one after the other (2-3)")
    ap.add_argument("--out", required=True, help="folder for round_<i>/ and table.md (must not exist)")
    ap.add_argument("--tiny", action="store_true", help="for tests: tiny benchmarks, the profile from --profile-from")
    ap.add_argument("--profile-from", help="--tiny: a saved host profile (JSON) copied as each round's profile")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds {args.rounds}: at least 1")
    if os.path.exists(args.out):
        ap.error(f"--out {args.out} exists: rounds are not mixed with earlier ones")
    if args.tiny != bool(args.profile_from):
        ap.error("--tiny and --profile-from go together")
    if args.profile_from and not os.path.isfile(args.profile_from):
        ap.error(f"--profile-from {args.profile_from} does not exist")
    return args


def stages(args, folder: str) -> list[tuple[str, list[str]]]:
    """(stage, command) of one round, each writing its file in `folder`."""
    py = [sys.executable, "-m"]
    return [("measure-host", py + ["benchmarks.cost_model", "--measure-host", "--save",
                                   os.path.join(folder, FILES["measure-host"])]),
            ("bench_distributed", py + ["benchmarks.bench_distributed"]
             + (TINY_DISTRIBUTED if args.tiny else BENCH_DISTRIBUTED)),
            ("bench_optimizer", py + ["benchmarks.bench_optimizer"]
             + (TINY_OPTIMIZER if args.tiny else BENCH_OPTIMIZER))]


def say(what: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {what}", file=sys.stderr, flush=True)


def run_round(args, i: int) -> str:
    """Round i's three measurements into OUT/round_<i>/; returns the folder."""
    folder = os.path.join(args.out, f"round_{i}")
    os.makedirs(folder)
    for stage, cmd in stages(args, folder):
        if stage == "measure-host" and args.tiny:
            shutil.copy(args.profile_from, os.path.join(folder, FILES[stage]))
            say(f"round {i}: {stage}: copied {args.profile_from} (--tiny)")
            continue
        say(f"round {i}: {stage} (~{EXPECTED_MIN[stage]} min idle): {shell_command(cmd[1:])}")
        start = time.time()
        log = os.path.join(folder, FILES[stage] if stage != "measure-host" else "measure_host.log")
        with open(log, "w") as f:  # its own progress (stderr) shows as it runs
            proc = subprocess.run(cmd, stdout=f, cwd=ROOT)
        if proc.returncode != 0:
            sys.exit(f"error: round {i}: {stage} exited with {proc.returncode} (its messages above; output in {log})")
        say(f"round {i}: {stage} done in {time.time() - start:.0f} s")
    return folder


def round_rows(folder: str) -> dict[tuple, float]:
    """{(benchmark, processes, line): predicted / measured} of one round's files (time lines)."""
    from benchmarks.cost_model.calibration import calibration_rows

    with open(os.path.join(folder, FILES["measure-host"])) as f:
        measured = json.load(f)
    logs = [open(os.path.join(folder, FILES[s])).read() for s in ("bench_optimizer", "bench_distributed")]
    return {(bench, procs, label): pred / meas
            for bench, procs, label, pred, _, meas, unit in calibration_rows(measured, *logs) if unit == "s"}


def table(per_round: list[dict[tuple, float]]) -> str:
    """One line per calibration line: predicted / measured in each round and the range; then the count within
    +-25% per round."""
    n = len(per_round)
    keys = list(dict.fromkeys(k for rows in per_round for k in rows))
    lines = ["| benchmark | processes | line | " + " | ".join(f"round {i + 1}" for i in range(n)) + " | range |",
             "| --- | ---: | --- | " + " | ".join("---:" for _ in range(n)) + " | ---: |"]
    for key in keys:
        ratios = [rows.get(key) for rows in per_round]
        seen = [r for r in ratios if r is not None]
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | " + " | ".join("-" if r is None else f"{r:.2f}"
                                                                         for r in ratios)
                     + f" | {min(seen):.2f}-{max(seen):.2f} |")
    within = [f"round {i + 1}: {sum(BAND[0] <= r <= BAND[1] for r in rows.values())} of {len(rows)}"
              for i, rows in enumerate(per_round)]
    lines.append("\nwithin +-25%: " + "; ".join(within))
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse(argv)
    per = 0 if args.tiny else sum(EXPECTED_MIN.values())
    say(f"{args.rounds} round(s) into {args.out}: expected ~{per} min a round on the idle 2-core host, "
        f"~{per * args.rounds + 2} min in all (the last 2: counting the sharded steps for the table)")
    os.makedirs(args.out)
    start = time.time()
    folders = []
    for i in range(1, args.rounds + 1):
        folders.append(run_round(args, i))
        left = args.rounds - i
        if left:
            say(f"round {i} took {(time.time() - start) / i / 60:.1f} min a round so far; "
                f"~{(time.time() - start) / i * left / 60:.0f} min of rounds left")
    say("counting the sharded steps and pricing every round's lines")
    result = table([round_rows(f) for f in folders])
    with open(os.path.join(args.out, "table.md"), "w") as f:
        f.write(result + "\n")
    print(result)
    say(f"done in {(time.time() - start) / 60:.1f} min; the table is also in {os.path.join(args.out, 'table.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
