"""The `spectral` RowNorm scale (docs/algorithms.md §4): RowNorm's direction with its operator norm capped.

RowNorm R = D^-1 O(U) (r x c, r <= c, unit rows) has ||R||_F^2 = r like a full-rank polar factor, but its operator
norm is not bounded like one: a rank-1 U gives a rank-1 R with ||R||_2 = sqrt(r) (16 at r = 256), against ~1 for
NS5. With rownorm_scale = spectral the direction is R * min(1, cap / sigma), where
- cap(r, c) = 1 + sqrt(r / c): the operator norm RowNorm gives a full-rank Gaussian input of that shape (unit rows
  of a Gaussian r x c matrix are ~ X / sqrt(c), whose largest singular value is ~ 1 + sqrt(r / c)), so full-rank
  steps keep today's size and low-rank ones are cut down to it;
- sigma: an estimate of ||R||_2 from ROUNDS rounds of power iteration on G = R R^T (r x r, never formed), from a
  fixed start vector x_0 (seeded by the shape, the same on every rank): x_j = G x_{j-1} for j < ROUNDS, then the
  Rayleigh quotient sigma^2 = ||R^T x||^2 / ||x||^2 at x = x_{ROUNDS - 1}. It is a lower bound on ||R||_2, exact
  for rank-1 R from the second round on; 0 for an all-zero R (factor 1).

Shards (docs/algorithms.md §6): R's rows may be split over ranks (a wide matrix's dim-0 shards: each rank holds
some rows of R, `split="rows"`), or its columns (a tall matrix's dim-0 shards: `split="cols"`). Every round needs
one sum over the ranks, of c floats per matrix for row splits (R^T x) and of r floats for column splits (R y);
`cap_factors` runs the buckets in lock step so that every round is ONE collective for all buckets together (the
`reduce` hook: sum a flat fp32 tensor over the ranks; None for a single process, where every sum is local).
"""

from __future__ import annotations

import math
from typing import Callable, Generator

import torch
from torch import Tensor

ROUNDS = 3  # R^T matvecs per matrix (and ROUNDS - 1 R matvecs); 3 = Rayleigh quotient at G^2 x_0


def spectral_cap(r: int, c: int) -> float:
    """The largest ||Phi||_2 the spectral RowNorm scale lets through, for an r x c (r <= c) oriented matrix."""
    return 1.0 + math.sqrt(r / c)


def start_vectors(batch: int, r: int, device, dtype) -> Tensor:
    """x_0 for a [batch] of matrices with r rows: fixed by (batch, r), so identical on every rank and every step."""
    g = torch.Generator().manual_seed(1_000_003 * r + batch)
    return torch.randn(batch, r, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)


def _matvecs(U: Tensor, s: Tensor, tall: bool):
    """(R^T x, R y) for R = O(U * s) with U [B, m, n] and the row factors s as [B, r_local]: matrix-vector products
    that never form R. Both are vector-times-matrix bmm's: U v as v^T U^T (on CPU bmm(U, v) takes a path ~3x
    slower than one read of U, measured at 3072 x 512: 9.5 ms against 3.2 ms).
    Wide: R = s * U; tall: R = (U * s)^T."""
    def times_u(v):  # U v = (v^T U^T)^T
        return torch.bmm(v.unsqueeze(1), U.mT).squeeze(1)

    def u_times(v):  # v^T U, i.e. U^T v
        return torch.bmm(v.unsqueeze(1), U).squeeze(1)

    if tall:
        return (lambda x: times_u(s * x)), (lambda y: s * u_times(y))
    return (lambda x: u_times(s * x)), (lambda y: s * times_u(y))


Rounds = Generator[Tensor, Tensor, Tensor]


def _power_iteration(U: Tensor, row_scale: Tensor, tall: bool, x0: Tensor, split: str | None) -> Rounds:
    """Yields, each round, the [B, k] partial sums this rank contributes and receives their sum over the ranks;
    returns sigma^2 per matrix ([B]). split: None (whole matrices), "rows" (this rank holds some rows of R; x0 is
    its slice) or "cols" (this rank holds some columns of R)."""
    work = x0.dtype
    Uw = U if U.dtype == work else U.to(work)
    s = row_scale.reshape(U.shape[0], -1).to(work)
    rt, r_ = _matvecs(Uw, s, tall)
    x = x0
    for _ in range(ROUNDS - 1):
        if split == "cols":  # R y = sum over the column blocks
            x = yield r_(rt(x))
        else:  # whole, or rows: R^T x sums over the row blocks; R y is then local
            x = r_((yield rt(x)))
    # Rayleigh quotient ||R^T x||^2 / ||x||^2; the squared norms of split vectors are summed over the ranks
    y = rt(x)
    if split == "cols":
        num = yield y.square().sum(-1, keepdim=True)
        return num.squeeze(-1) / x.square().sum(-1)
    if split == "rows":
        y_and_norm = yield torch.cat([y, x.square().sum(-1, keepdim=True)], dim=-1)
        y, xx = y_and_norm[:, :-1], y_and_norm[:, -1]
        return y.square().sum(-1) / xx
    y = yield y
    return y.square().sum(-1) / x.square().sum(-1)


def cap_factors(problems: list[tuple[Tensor, Tensor, bool, Tensor, str | None, float]],
                reduce: Callable[[Tensor], Tensor] | None = None) -> list[Tensor]:
    """min(1, cap / sigma) per matrix ([B, 1, 1], to multiply into the row factors) for each bucket's problem
    (U, row_scale, tall, x0, split, cap). All buckets advance together: each round one `reduce` of their partial
    sums in one flat fp32/fp64 tensor."""
    if not problems:
        return []
    runs = [_power_iteration(U, s, tall, x0, split) for U, s, tall, x0, split, _ in problems]
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
    out = []
    for (U, *_, cap), s2 in zip(problems, sigma2):
        sigma = torch.nan_to_num(s2, nan=0.0).clamp_min(0.0).sqrt()
        factor = torch.where(sigma > cap, cap / sigma.clamp_min(1e-30), torch.ones_like(sigma))
        out.append(factor.view(-1, 1, 1))
    return out


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
