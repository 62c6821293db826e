"""The rate of NS5's own matmuls on this host (docs/cost_model.md, "NS5 at the rate of its own matmuls"): which
bmm/baddbmm calls the optimizer's NS5 direction dispatches, measured one by one at a grid of matrix shapes, and the
rate of a counted matmul interpolated between them.

Why not one GEMM rate by side: on this CPU the same FLOPs run at rates up to ~2x apart by operand layout (the
tall Gram product O^T O reads a transposed view, 'tn', at about half the rate of X X^T, 'nt'), by op (baddbmm's
scaled accumulate is slower than bmm) and by batch and aspect; NS5 mixes all of them.

What is measured: NS5 (directions/ns5.py, its Gram or plain form as the automatic choice picks it) is counted on
fake [B, m, n] inputs of short side r in SIDES, aspect c / r in ASPECTS (wide and tall), B in BATCHES; every
distinct matmul it dispatches (op, operand layout, dtype, (m, k, n), batch) is timed alone on real tensors.

How a counted matmul is priced (`rate`): among the measured calls of its op, layout and dtype that are square or
long on the same side (m, k or n), multilinear interpolation of the rate in log r, log aspect and log batch
between the neighbouring measured points, clamped to the measured range; None (the caller falls back to the square
GEMM rates by side) for a matmul NS5 does not dispatch: another dtype, layout, a shape whose two short sides
differ, or long on a side this op and layout were measured only square.
"""

from __future__ import annotations

import bisect
import math
from functools import lru_cache

import torch

SIDES = (128, 256, 512)  # the calibration models' matrices have short sides 256 and 512
ASPECTS = (1, 1.5, 2, 4, 8)  # < 2: the plain iteration, >= 2: the Gram form (ns5.GRAM_MIN_ASPECT); dit_m's up to 6
BATCHES = (1, 8)  # stacked same-shape matrices (dit_m: 1-9 per shape)
DTYPES = ("bf16",)  # NS5's compute dtype by default (ns_dtype); other dtypes fall back to the square rates

Point = tuple  # (op, layout, dtype, m, k, n, batch)


def ns5_group(dtype: str = "bf16") -> dict:
    """The param-group keys the NS5 direction reads, at the optimizer's defaults but for `dtype`."""
    import inspect

    from dit_train.optim.directions import NS5
    from dit_train.optim.matrix_optimizer import MatrixOptimizer

    eps = inspect.signature(MatrixOptimizer).parameters["direction_eps"].default
    return {**NS5(dtype=dtype).group_keys(), "direction_eps": eps}


@lru_cache(maxsize=None)
def ns5_matmuls(sides=SIDES, aspects=ASPECTS, batches=BATCHES, dtypes=DTYPES) -> tuple[Point, ...]:
    """Every distinct matmul the NS5 direction dispatches on [B, m, n] inputs of the grid (counted on fake
    tensors of one matrix, wide and tall; NS5 runs the same calls on a batch, batched: each call is listed at
    every B in `batches`)."""
    from benchmarks.op_cost import OpCounter
    from dit_train.optim.directions import NS5
    from dit_train.optim.directions.linalg import DTYPES as TORCH_DTYPES

    seen: dict[Point, None] = {}
    counter = OpCounter(allow_non_fake_inputs=True)
    for dtype in dtypes:
        group = ns5_group(dtype)
        for r in sides:
            for a in aspects:
                c = round(a * r)
                for m, n in sorted({(r, c), (c, r)}):
                    with counter, torch.no_grad():
                        U = torch.empty(1, m, n, dtype=TORCH_DTYPES[dtype])  # stacked in NS5's dtype
                        counter.reset()
                        NS5(dtype=dtype)(U, group, {})
                    for rec in counter.records:
                        if rec.category == "gemm":
                            for B in batches:
                                seen.setdefault((rec.op, rec.layout, rec.dtype, *rec.dims, B))
    return tuple(seen)


def _operand(B: int, rows: int, cols: int, layout: str, dtype: torch.dtype) -> torch.Tensor:
    """A [B, rows, cols] operand, row-major ('n') or a transposed view of a row-major [B, cols, rows] ('t')."""
    t = torch.randn(B, rows, cols) if layout == "n" else torch.randn(B, cols, rows).mT
    return t.to(dtype)


def time_matmul(point: Point) -> float:
    """Median seconds of one call of `point` on real tensors, into a preallocated output (as NS5's workspace)."""
    from benchmarks.op_cost import median_seconds

    op, layout, dtype, m, k, n, B = point
    dt = getattr(torch, dtype)
    a, b = _operand(B, m, k, layout[0], dt), _operand(B, k, n, layout[1], dt)
    out, acc = torch.empty(B, m, n, dtype=dt), torch.randn(B, m, n).to(dt)
    if op == "bmm":
        return median_seconds(lambda: torch.bmm(a, b, out=out))
    if op == "baddbmm":
        return median_seconds(lambda: torch.baddbmm(acc, a, b, beta=-4.775, alpha=2.0315, out=out))
    raise ValueError(f"{op} is not a matmul NS5 dispatches")


def measure_ns5_gemms(threads: int, points: list[Point] | None = None) -> list[list]:
    """[[op, layout, dtype, m, k, n, batch, flop/s], ...] of every matmul NS5 dispatches on the grid, `threads`
    threads (about 10 s of CPU time at 1 thread)."""
    torch.set_num_threads(threads)
    rows = []
    for p in ns5_matmuls() if points is None else points:
        *_, m, k, n, B = p
        rows.append([*p, 2 * B * m * k * n / time_matmul(p)])
    return rows


def _coords(m: int, k: int, n: int) -> tuple[int, float, str] | None:
    """(short side r, aspect c / r, the long side: 'm', 'k', 'n' or '' if square) of an NS5-shaped matmul (two
    sides equal, the third at least as long); None otherwise."""
    dims = (m, k, n)
    r, c = min(dims), max(dims)
    if sorted(dims)[1] != r:
        return None
    return r, c / r, "" if c == r else "mkn"[dims.index(c)]


@lru_cache(maxsize=64)
def _grid(rows: tuple, op: str, layout: str, dtype: str, long: str) -> dict | None:
    """{(log r, log aspect, log batch): flop/s} of the measured calls of this op, layout and dtype that are square
    or long on `long`."""
    grid, on_long = {}, False
    for row in rows:
        o, lay, dt, m, k, n, B, rate = row
        where = _coords(m, k, n)
        if (o, lay, dt) == (op, layout, dtype) and where and where[2] in ("", long):
            grid[(math.log(where[0]), math.log(where[1]), math.log(B))] = rate
            on_long |= where[2] == long
    return grid if on_long else None  # a long-sided call is not priced from squares alone


def bracket(axis: list[float], q: float) -> list[tuple[float, float]]:
    """[(coordinate, weight)] of the measured values either side of q on one axis (clamped to its range)."""
    if q <= axis[0]:
        return [(axis[0], 1.0)]
    if q >= axis[-1]:
        return [(axis[-1], 1.0)]
    i = bisect.bisect_right(axis, q)
    lo, hi = axis[i - 1], axis[i]
    w = (q - lo) / (hi - lo)
    return [(lo, 1.0 - w), (hi, w)]


def rate(rows: tuple, op: str, layout: str, dtype: str, dims: tuple, batch: int) -> float | None:
    """flop/s of a counted matmul from the measured rows (see the module docstring), None where they do not
    cover its kind."""
    where = _coords(*dims)
    if where is None:
        return None
    r, a, long = where
    grid = _grid(rows, op, layout, dtype, long)
    if grid is None:
        return None
    axes = [sorted({key[i] for key in grid}) for i in range(3)]
    total = 0.0
    for x, wx in bracket(axes[0], math.log(r)):
        for y, wy in bracket(axes[1], math.log(a)):
            for z, wz in bracket(axes[2], math.log(batch)):
                if (x, y, z) not in grid:  # not a full grid around the query (not measured as NS5 runs it)
                    return None
                total += wx * wy * wz * grid[(x, y, z)]
    return total
