"""The `spectral` RowNorm scale (docs/algorithms.md §4): RowNorm's direction scaled down toward a cap on its operator
norm, judged by an estimate that can only come out low: a target, not a bound.

RowNorm R = D^-1 O(U) (r x c, r <= c, unit rows) has ||R||_F^2 = r like a full-rank polar factor, but its operator
norm is not bounded like one: a rank-1 U gives a rank-1 R with ||R||_2 = sqrt(r) (16 at r = 256), against ~1 for
NS5. With rownorm_scale = spectral the direction is R * min(1, cap / sigma), where
- cap(r, c) = 1 + sqrt(r / c): the operator norm RowNorm gives a full-rank Gaussian input of that shape (unit rows
  of a Gaussian r x c matrix are ~ X / sqrt(c), whose largest singular value is ~ 1 + sqrt(r / c)), so full-rank
  steps keep today's size and low-rank ones are cut down to it;
- sigma: an estimate of ||R||_2 from ROUNDS rounds of power iteration on G = R R^T (r x r, never formed), from a
  fixed start vector x_0 (seeded by the shape, the same on every rank): x_j = G x_{j-1} for j < ROUNDS, then the
  Rayleigh quotient sigma^2 = ||R^T x||^2 / ||x||^2 at x = x_{ROUNDS - 1}. It is a lower bound on ||R||_2, exact
  for rank-1 R from the second round on; 0 for an all-zero R (factor 1). So ||Phi||_2 = ||R||_2 cap / sigma is
  above the cap whenever sigma is short of ||R||_2 (close top singular values): measured up to 1.38x on random
  low-rank U and 1.83x on a sequence of rank-1 gradients (docs/algorithms.md §4).

Shards (docs/algorithms.md §6): R's rows may be split over ranks (a wide matrix's dim-0 shards: each rank holds
some rows of R, `split="rows"`), or its columns (a tall matrix's dim-0 shards: `split="cols"`). Every round needs
one sum over the ranks, of c floats per matrix for row splits (R^T x) and of r floats for column splits (R y);
`cap_factors` runs the buckets in lock step so that every round is ONE collective for all buckets together (the
`reduce` hook: sum a flat fp32 tensor over the ranks; None for a single process, where every sum is local).

Cost: 2 ROUNDS - 1 = 5 matrix-vector products with U, as batched torch ops.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, Generator

import torch
from torch import Tensor

from dit_train.parallel.matmul_precision import ieee_fp32_matmuls

ROUNDS = 3  # R^T matvecs per matrix (and ROUNDS - 1 R matvecs); 3 = Rayleigh quotient at G^2 x_0


def spectral_cap(r: int, c: int) -> float:
    """The operator norm the spectral RowNorm scale aims ||Phi||_2 at, for an r x c (r <= c) oriented matrix; a target,
    not a bound: Phi exceeds it where the power-iteration estimate of ||R||_2 is low."""
    return 1.0 + math.sqrt(r / c)


def real_tensors_cached(fn):
    """lru_cache for a function that makes a read-only tensor, with one cache per FakeTensorMode beside it: a fake
    tensor cached by the planning tools' counted steps (benchmarks/sharded_count.py, on cpu) was handed to a real
    step in the same process, which then moved nothing (the spectral RowNorm update came out 0). A fake mode keeps
    its own (on the mode, so it goes with it): the memory estimate counts these tensors as a real run keeps them."""
    real = functools.lru_cache(maxsize=256)(fn)

    @functools.wraps(fn)
    def get(*args):
        mode = torch._guards.detect_fake_mode()
        if mode is None:
            return real(*args)
        cache = mode.__dict__.setdefault("_dit_train_cached", {}).setdefault(fn.__qualname__, {})
        if args not in cache:
            cache[args] = fn(*args)
        return cache[args]

    get.cache_clear = real.cache_clear
    return get


@real_tensors_cached
def start_vectors(batch: int, r: int, device, dtype) -> Tensor:
    """x_0 for a [batch] of matrices with r rows: fixed by (batch, r), so identical on every rank and every step
    (cached: read only)."""
    g = torch.Generator().manual_seed(1_000_003 * r + batch)
    return torch.randn(batch, r, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)


@real_tensors_cached
def cap_vector(caps: tuple[tuple[float, int], ...], device, dtype) -> Tensor:
    """The caps of a step's matrices, (cap, how many matrices) per bucket, as one tensor on `device`: filled there
    (no copy from host memory, which a tensor made from a Python list would be on CUDA) once per set of buckets
    (cached: read only)."""
    return torch.cat([torch.full((n,), cap, dtype=dtype, device=device) for cap, n in caps])


class _Products:
    """The products of a bucket's power iteration as batched torch ops, vectors kept [B, 1, k] (no reshapes per
    round). Both are vector-times-matrix bmm's: U v as v^T U^T (on CPU bmm(U, v) takes a path ~3x slower than one
    read of U, measured at 3072 x 512: 9.5 ms against 3.2 ms). Wide: R = s U; tall: R = (U s)^T."""

    def __init__(self, U: Tensor, s: Tensor, x0: Tensor):
        self.U, self.s, self.x0 = U, s.reshape(U.shape[0], 1, -1), x0.unsqueeze(1)

    def wide_first(self, x):  # R^T x = (s x)^T U
        return torch.bmm(x * self.s, self.U)

    def wide_pair(self, y):  # (R^T x', x' = R y)
        x = torch.bmm(y, self.U.mT) * self.s
        return torch.bmm(x * self.s, self.U), x

    def tall_pair(self, x):  # R (R^T x) = s U^T (U (s x))
        return torch.bmm(torch.bmm(x * self.s, self.U.mT), self.U) * self.s

    def tall_last(self, x):  # R^T x = U (s x)
        return torch.bmm(x * self.s, self.U.mT)


Rounds = Generator[Tensor, Tensor, Tensor]


def _products(U: Tensor, row_scale: Tensor, x0: Tensor) -> _Products:
    """The bucket's products, in x0's (fp32/fp64) precision."""
    Uw = U if U.dtype == x0.dtype else U.to(x0.dtype)
    return _Products(Uw, row_scale.reshape(U.shape[0], -1).to(x0.dtype), x0)


def _power_iteration(U: Tensor, row_scale: Tensor, tall: bool, x0: Tensor, split: str | None,
                     rounds: int = ROUNDS) -> Rounds:
    """Yields, each round, the partial sums this rank contributes and receives their sum over the ranks;
    returns sigma^2 per matrix ([B]). split: None (whole matrices), "rows" (this rank holds some rows of R; x0 is
    its slice) or "cols" (this rank holds some columns of R). Products that follow each other without a sum over
    the ranks between them go together: wide R^T x, then (R y, R^T of it) twice; tall (R^T x, R of it) twice,
    then R^T x."""
    p = _products(U, row_scale, x0)
    if tall:  # R^T x is local in both placements; R y sums over the column blocks ("cols")
        x = p.x0
        for _ in range(rounds - 1):
            x = yield p.tall_pair(x)
        num = yield p.tall_last(x).square().sum(-1, keepdim=True)
        return (num / x.square().sum(-1, keepdim=True)).reshape(-1)
    # wide: R^T x sums over the row blocks ("rows"); R y is local
    y = yield p.wide_first(p.x0)
    for r in range(rounds - 1):
        y, x = p.wide_pair(y)
        if r < rounds - 2:
            y = yield y
    # the Rayleigh quotient ||R^T x||^2 / ||x||^2, both squared norms summed over the ranks in one collective
    both = yield torch.cat([y, x.square().sum(-1, keepdim=True)], dim=-1)
    return (both[..., :-1].square().sum(-1) / both[..., -1]).reshape(-1)


@ieee_fp32_matmuls()
def cap_factors(problems: list[tuple[Tensor, Tensor, bool, Tensor, str | None, float]],
                reduce: Callable[[Tensor], Tensor] | None = None, rounds: int = ROUNDS) -> list[Tensor]:
    """min(1, cap / sigma) per matrix ([B, 1, 1], to multiply into the row factors) for each bucket's problem
    (U, row_scale, tall, x0, split, cap). All buckets advance together: each round one `reduce` of their partial
    sums in one flat fp32/fp64 tensor. rounds: ROUNDS, the optimizer's; others
    for measuring the estimate (benchmarks/spectral_estimate_accuracy.py)."""
    if rounds < 2:
        raise ValueError(f"rounds={rounds} is not valid: the power iteration takes >= 2 rounds")
    if not problems:
        return []
    runs = [_power_iteration(U, s, tall, x0, split, rounds) for U, s, tall, x0, split, _ in problems]
    parts = [next(run) for run in runs]
    sigma2: list[Tensor | None] = [None] * len(runs)
    while True:
        if reduce is not None and parts:
            flat = reduce(torch.cat([p.reshape(-1) for p in parts]))
            parts = [f.view_as(p) for f, p in zip(flat.split([p.numel() for p in parts]), parts)]
        nxt = []
        for i, (run, part) in enumerate(zip(runs, parts)):
            try:
                nxt.append(run.send(part))
            except StopIteration as done:
                sigma2[i] = done.value
        if any(v is not None for v in sigma2):  # every bucket runs the same number of rounds
            break
        parts = nxt
    # the factors of every bucket at once (a few ops instead of a few per bucket)
    sigma = torch.nan_to_num(torch.cat(sigma2), nan=0.0).clamp_min(0.0).sqrt()
    caps = cap_vector(tuple((cap, s2.numel()) for (*_, cap), s2 in zip(problems, sigma2)), sigma.device, sigma.dtype)
    factor = torch.where(sigma > caps, caps / sigma.clamp_min(1e-30), torch.ones_like(sigma))
    return [f.view(-1, 1, 1) for f in factor.split([s2.numel() for s2 in sigma2])]


def whole_matrix_problem(U: Tensor, row_scale: Tensor, tall: bool):
    """The cap_factors problem of a bucket of whole matrices U [B, m, n] with RowNorm factors row_scale."""
    m, n = U.shape[-2:]
    r, c = (n, m) if tall else (m, n)
    work = torch.promote_types(U.dtype, torch.float32)
    return U, row_scale, tall, start_vectors(U.shape[0], r, U.device, work), None, spectral_cap(r, c)


def capped_row_norm_scale(U: Tensor, row_scale: Tensor, tall: bool | None = None) -> Tensor:
    """row_scale * min(1, cap / ||R||_2 estimate) for whole matrices: the factors of the spectral RowNorm scale."""
    tall = U.shape[-2] > U.shape[-1] if tall is None else tall
    (f,) = cap_factors([whole_matrix_problem(U, row_scale, tall)])
    return row_scale * f.to(row_scale.dtype)
