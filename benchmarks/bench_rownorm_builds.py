"""Builds of the RowNorm C kernels side by side: which vector width and power-iteration grouping suit this host.

The C loops (dit_train/optim/native_rownorm.py) are built once per machine with -march=native and a preferred
vector width chosen by `native_rownorm.vector_width` (256 bits on AMD Zen 4, 512 elsewhere). This script builds
the same sources with every --widths x --pi-groups combination, loads them side by side and times, interleaved in
one process (each repetition runs every build in turn, so drifting load hits all alike), the non-refresh RowNorm
step of periodic_rowwise under compile_rownorm (spectral and frobenius scales) against our fused AdamW, on a DiT
preset with random weights and gradients. Prints medians and the ratios, and which build the shipped choice is.

    python -m benchmarks.bench_rownorm_builds --preset dit_m --hidden-size 512 --depth 8 --widths 256,512 --pi-groups 1,4
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from types import SimpleNamespace

import torch


from benchmarks.bench_optimizer import materialise
from dit_train.optim import native_rownorm
from dit_train.optim.registry import build_optimizer


def ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",")]


def build(folder: str, width: int, pi_group: int):
    """The kernels built with this vector width and PI_GROUP, loaded."""
    os.makedirs(folder)
    for part in native_rownorm.PARTS:
        shutil.copy(part, folder)
    flags = [f for f in native_rownorm.FLAGS if not f.startswith("-mprefer-vector-width")]
    so = os.path.join(folder, "kernels.so")
    subprocess.run([os.environ.get("CC") or "cc", *flags, f"-mprefer-vector-width={width}", f"-DPI_GROUP={pi_group}",
                    *native_rownorm.OPENMP, "-o", so, os.path.join(folder, os.path.basename(native_rownorm.SOURCE))],
                   check=True, capture_output=True, text=True)
    return ctypes.CDLL(so)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="dit_m")
    ap.add_argument("--hidden-size", type=int, default=512)
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--widths", type=ints, default=[256, 512], help="vector widths in bits, comma-separated")
    ap.add_argument("--pi-groups", type=ints, default=[4], help="PI_GROUP values, comma-separated (4: the shipped)")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if native_rownorm.load() is None:
        sys.exit("error: the C kernels do not build here (no C compiler?)")

    _, model = materialise(SimpleNamespace(preset=args.preset, hidden_size=args.hidden_size, depth=args.depth,
                                           num_heads=None))
    base = {"lr": 1e-3, "weight_decay": 0.01}
    steps = {"adamw": build_optimizer(model, {**base, "name": "adamw"})}
    for scale in ("spectral", "frobenius"):
        steps[scale] = build_optimizer(model, {**base, "name": "periodic_rowwise", "K": 10, "rownorm_scale": scale,
                                               "compile_rownorm": True})
    with tempfile.TemporaryDirectory() as tmp:
        builds = {(w, g): build(os.path.join(tmp, f"w{w}g{g}"), w, g) for w in args.widths for g in args.pi_groups}
        times = {(b, name): [] for b in builds for name in steps}
        for rep in range(args.repeats + 2):
            for b, lib in builds.items():
                native_rownorm._lib[:] = [lib]
                for name, opt in steps.items():
                    for group in opt.param_groups:
                        group["step"] = 1  # a RowNorm step of the K = 10 schedule
                    t0 = time.perf_counter()
                    opt.step()
                    if rep >= 2:  # warm-up
                        times[(b, name)].append(time.perf_counter() - t0)
        native_rownorm._lib[:] = []  # the next load() takes the shipped build again
    shipped = (native_rownorm.vector_width(), 4)
    print(f"# RowNorm C kernel builds, {args.preset} width {args.hidden_size} depth {args.depth}, "
          f"{torch.get_num_threads()} threads, medians of {args.repeats} interleaved repetitions")
    print("| vector width | PI_GROUP | our fused adamw ms | spectral step ms | / adamw | frobenius step ms | / adamw |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for b in builds:
        med = {name: statistics.median(times[(b, name)]) * 1e3 for name in steps}
        mark = " (shipped here)" if b == shipped else ""
        ratio = {name: med[name] / med["adamw"] for name in ("spectral", "frobenius")}
        print(f"| {b[0]}{mark} | {b[1]} | {med['adamw']:.1f} | {med['spectral']:.1f} | {ratio['spectral']:.2f} | "
              f"{med['frobenius']:.1f} | {ratio['frobenius']:.2f} |")


if __name__ == "__main__":
    main()
