"""The CPU benchmarks' logs read by row (bench_optimizer's and bench_distributed's tables and phases), each row
mapped to the contender and step kind the cost model predicts for it."""

from __future__ import annotations

import re

from benchmarks.cost_model.contender import Optim


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
