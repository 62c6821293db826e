"""Calibration on this host (`--calibrate`): the cost model's prediction at the measured host profile against the
CPU benchmarks' logs, line by line and phase by phase (docs/cost_model.md, "Calibration on this host")."""

from __future__ import annotations

from dataclasses import replace

from benchmarks.cost_model.bench_logs import (BENCH_DISTRIBUTED_ROWS, BENCH_OPTIMIZER_PHASES, BENCH_OPTIMIZER_ROWS,
                                              parse_bench_distributed, parse_bench_optimizer,
                                              parse_distributed_phases, parse_phases)
from benchmarks.cost_model.contender import Optim
from benchmarks.cost_model.measure_host import core_slots, host_profile
from benchmarks.cost_model.predict import counted_records, predict
from benchmarks.cost_model.shapes import Shapes, model_shapes


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


def python_rates(measured: dict, procs: int) -> dict | None:
    """{step kind: {class: seconds of Python per op}} of a process of `procs` (measured on one thread: a whole
    core's; the replay shares the cores, sharded_step), or None where the profile has none."""
    return measured.get("python", {}).get(str(procs))


def collective_cpu_rates(measured: dict, procs: int) -> tuple[float, float] | None:
    """(seconds per collective, seconds per byte on the wire) of CPU that gloo's threads take on a process
    (measure_gloo's: a whole core's; the replay shares the cores, sharded_step), or None where the profile has not
    measured them."""
    gloo = measured["gloo"][str(procs)]
    if "cpu_s_per_call" not in gloo:
        return None
    return gloo["cpu_s_per_call"], gloo["cpu_s_per_byte"]


def sharded_step(shapes: Shapes, label: str, measured: dict, procs: int) -> dict:
    """bench_distributed's contender `label` on `procs` processes of this host: every rank's counted step replayed
    with the overlap the code has (sharded_schedule), ops at a whole core's rates per thread plus the Python per
    op where the profile has it, the cores shared among the ranks computing at each moment where the processes'
    threads outnumber them (core_slots), collectives at the gloo latency between busy processes where the profile
    has it (else between idle ones) and its bandwidth, and their CPU (gloo's threads) taken from the compute they
    overlap where the profile has it (collective_cpu_rates); the slowest rank's step, averaged over the cycle."""
    from benchmarks.sharded_schedule import mean_scheduled

    cycle = sharded_cycle(shapes, label, procs)
    gloo = measured["gloo"][str(procs)]
    latency = gloo.get("busy_latency_s", gloo["latency_s"])
    python = python_rates(measured, procs)
    per_step = [python[k] for k in step_kinds(BENCH_DISTRIBUTED_ROWS[label], len(cycle))] if python else None
    return mean_scheduled(cycle, host_profile(measured, procs, share=1.0).op_rates(), procs, gloo["link_bytes_s"],
                          latency, per_step, collective_cpu_rates(measured, procs), core_slots(measured, procs))


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
