"""The H200 profile's forward + backward (compute.py) calibrated on three GPU check runs of 2026-12-04
(`--calibrate-h200`; docs/cost_model.md, "Calibrated on three GPU check runs"): every timed step of the dit_15b
and dit_1b3 stages against the profile's prediction (counted forward + backward + the model's optimizer step of
that kind), the two fitted parameters (memory_efficiency, op_s) fitted on the RowNorm steps without activation
checkpointing, every other row a hold-out.

The points: the first run's jsonl (dit1b3_compile_ac, run A), the second run's jsonl (dit15b_w32_ac run A,
dit15b_w8_ac, dit1b3_eager, dit1b3_compile_ac run B) and the third run's table (dit15b_w32, dit15b_w32_ac run B,
dit15b_w8: its jsonl was not returned by the device, so those numbers are constants here, tested equal to the
table's text). The dit_15b stages run rank 0 of W with the W - 1 peers a fake process group: collectives are free,
so the prediction takes no network (describe_prediction's network=False)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

from benchmarks.cost_model.compute import ComputeRates, compute_seconds
from benchmarks.cost_model.contender import Optim
from benchmarks.cost_model.hardware import PROFILES, Hardware, no_network
from benchmarks.cost_model.predict import predict
from benchmarks.cost_model.shapes import model_shapes

ROOT = Path(__file__).resolve().parents[2]
RUN_1 = "docs/gpu_check_runs/2026-12-04_1210.jsonl"
RUN_2 = "docs/gpu_check_runs/2026-12-04_1747.jsonl"
RUN_3 = "docs/gpu_check_runs/2026-12-04_1755_six_stages.md"
OPTIMIZER = Optim("periodic_rowwise", 3, "spectral", "owner")  # the stages' optimizer (its cycle mean is the one
# each stage printed: 25 / 92 / 58 ms for dit_15b on 32 / 8 ranks and dit_1b3)
TRAINER_KINDS = ("rownorm", "refresh", "rownorm")  # the timed steps 3..5 of every stage (K = 3 from step 1)
# the third run's table (RUN_3), its JSON lines lost: the compute-only step times, steps 3..5 (seconds)
RUN_3_STEPS = {"dit15b_w32": (0.981, 0.996, 0.993), "dit15b_w32_ac": (1.444, 1.462, 1.381),
               "dit15b_w8": (0.588, 0.739, 0.601)}
FIT_GRID = dict(memory_efficiency=[i / 100 for i in range(30, 101)], op_s=[i * 0.5e-6 for i in range(1, 41)])


@dataclass(frozen=True)
class Point:
    name: str  # the stage (and run)
    source: str  # the file it is read from
    preset: str
    world: int  # the W of "rank 0 of W" (1: the trainer on one GPU)
    images: int  # per rank
    ac: bool  # activation checkpointing
    compiled: bool  # parallel.compile (priced as its eager ops)
    kinds: tuple  # the optimizer step kind of each timed step
    step_s: tuple  # the timed steps

    def fit(self) -> bool:
        """In the fitting subset: eager and without activation checkpointing (the recompute and the compiled run
        are held out: they test what the fit did not see)."""
        return not (self.ac or self.compiled)


def _stages(path: str) -> dict:
    rows = [json.loads(line) for line in (ROOT / path).read_text().splitlines() if line.strip()]
    return {r["stage"]: r["values"] for r in rows}


def measured_points() -> list[Point]:
    """Every timed trainer step of the three runs (module docstring), as Points."""
    one, two = _stages(RUN_1), _stages(RUN_2)
    points = []
    for name, (world, images, ac) in {"dit15b_w32": (32, 32, False), "dit15b_w32_ac": (32, 32, True),
                                      "dit15b_w8": (8, 16, False)}.items():
        points.append(Point(f"{name}" + (" (run B)" if ac else ""), RUN_3, "dit_15b", world, images, ac, False,
                            TRAINER_KINDS, RUN_3_STEPS[name]))
    for name, label in (("dit15b_w32_ac", " (run A)"), ("dit15b_w8_ac", "")):
        v = two[name]
        steps = tuple(v["step_s"])
        points.append(Point(name + label, RUN_2, "dit_15b", v["world"], v["micro_batch"],
                            v["activation_checkpointing"], False, TRAINER_KINDS[:len(steps)], steps))
    points.append(Point("dit1b3_eager", RUN_2, "dit_1b3", 1, 32, False, False, TRAINER_KINDS,
                        tuple(two["dit1b3_eager"]["step_s"][2:])))
    points.append(Point("dit1b3_compile_ac (run A)", RUN_1, "dit_1b3", 1, 32, True, True, TRAINER_KINDS[:2],
                        tuple(one["dit1b3_compile_ac"]["step_s"][2:4])))
    points.append(Point("dit1b3_compile_ac (run B)", RUN_2, "dit_1b3", 1, 32, True, True, TRAINER_KINDS,
                        tuple(two["dit1b3_compile_ac"]["step_s"][2:])))
    return points


_OPTIMIZER_STEPS: dict = {}


def optimizer_steps(point: Point, hw: Hardware) -> dict[str, float]:
    """{step kind: seconds} of the model's optimizer step on rank 0 of the point's W, no network (cached: the
    optimizer's rates are not what is calibrated here)."""
    key = (point.preset, point.world, hw.name)
    if key not in _OPTIMIZER_STEPS:
        _OPTIMIZER_STEPS[key] = predict(model_shapes(point.preset), OPTIMIZER, no_network(hw), point.world)["steps"]
    return _OPTIMIZER_STEPS[key]


def rows(hw: Hardware | None = None) -> list[dict]:
    """One row per (point, step kind): the measured mean of its steps of that kind, the prediction (counted
    forward + backward at hw.compute + the optimizer step of that kind) and its parts, and the single-MFU
    prediction the check printed before (MFU 0.243, recompute not priced)."""
    hw = hw or PROFILES["h200"]
    out = []
    for p in measured_points():
        shapes = model_shapes(p.preset)
        fb = compute_seconds(shapes, hw.compute, hw.memory_bytes_s, p.images, p.ac)
        opt = optimizer_steps(p, hw)
        old = shapes.flops_per_image * p.images / (hw.matmul_flops * 0.243)
        for kind in dict.fromkeys(p.kinds):
            measured = [s for k, s in zip(p.kinds, p.step_s) if k == kind]
            out.append({"point": p.name, "source": p.source, "kind": kind, "fit": p.fit() and kind == "rownorm",
                        "measured": sum(measured) / len(measured), "steps": measured, "compute": fb["compute"],
                        "recompute": fb["recompute"], "optimizer": opt[kind],
                        "predicted": fb["compute"] + opt[kind], "mfu_0243": old + opt[kind], "point_obj": p})
    return out


def fit_h200(hw: Hardware | None = None, grid: dict | None = None) -> dict[str, float]:
    """(memory_efficiency, op_s) on FIT_GRID minimising the sum of squared log(predicted / measured) over the
    fitting rows (Point.fit, RowNorm steps), the GEMM curve and SDPA rate held at the profile's."""
    hw, grid = hw or PROFILES["h200"], grid or FIT_GRID
    fitting = [r for r in rows(hw) if r["fit"]]
    best = None
    for me in grid["memory_efficiency"]:
        for op_s in grid["op_s"]:
            rates = replace(hw.compute, memory_efficiency=me, op_s=op_s)
            err = 0.0
            for r in fitting:
                p = r["point_obj"]
                fb = compute_seconds(model_shapes(p.preset), rates, hw.memory_bytes_s, p.images, p.ac)["compute"]
                err += math.log((fb + r["optimizer"]) / r["measured"]) ** 2
            if best is None or err < best[0]:
                best = (err, me, op_s)
    return {"memory_efficiency": best[1], "op_s": best[2], "squared_log_error": best[0]}


def table(hw: Hardware | None = None) -> str:
    """The predicted-vs-measured table (markdown) with the fitted parameters and the hold-out's error."""
    hw = hw or PROFILES["h200"]
    c: ComputeRates = hw.compute
    lines = [f"{hw.name}: GEMMs {c.gemm_max / 1e12:.0f} TFLOP/s x s / (s + {c.gemm_half_side:.0f}) by shortest side "
             f"s, SDPA {c.sdpa / 1e12:.0f} TFLOP/s, memory-bound ops at {c.memory_efficiency:.2f} x "
             f"{hw.memory_bytes_s / 1e12:.1f} TB/s, {c.op_s * 1e6:.1f} us per op",
             "",
             "| point | run | step | measured ms | predicted ms (fwd+bwd + optimizer) | of it recompute | "
             "predicted / measured | single MFU 0.243: ms (ratio) | used for |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    held = []
    for r in rows(hw):
        ratio = r["predicted"] / r["measured"]
        if not r["fit"]:
            held.append(ratio)
        steps = " / ".join(f"{s * 1e3:.0f}" for s in r["steps"])
        lines.append(f"| {r['point']} | {Path(r['source']).stem} | {r['kind']} | {steps} | "
                     f"{r['predicted'] * 1e3:.0f} = {r['compute'] * 1e3:.0f} + {r['optimizer'] * 1e3:.0f} | "
                     f"{r['recompute'] * 1e3:.0f} | {ratio:.2f} | {r['mfu_0243'] * 1e3:.0f} "
                     f"({r['mfu_0243'] / r['measured']:.2f}) | {'fit' if r['fit'] else 'hold-out'} |")
    inside = sum(0.75 <= x <= 1.25 for x in held)
    lines.append(f"\nhold-out: {inside} of {len(held)} rows within +-25%, predicted / measured "
                 f"{min(held):.2f}-{max(held):.2f}, mean |log ratio| "
                 f"{sum(abs(math.log(x)) for x in held) / len(held):.3f}")
    return "\n".join(lines)
