"""Update directions Phi(U) of a matrix (ALGORITHMS.md §3), as pure functions of a (possibly batched) matrix.

Every function takes X of shape [m, n] or [..., m, n], works on the oriented view with r = min(m, n) rows
(X itself when m <= n, else X^T), maps the result back and never modifies its input.

"Where the matrix lives" is kept out of the maths: every quantity that is a sum over the long side c (row sums
of squares, Gram matrices X X^T) goes through an optional `reduce` callable before it is used. For a matrix held
whole, `reduce` is None. A later sharded implementation whose ranks each hold a slice of the c columns passes an
all-reduce there and gets the same result as the whole matrix (ALGORITHMS §6: rownorm/mud/NS5 on column shards).

- newton_schulz5: the spectral direction (Muon's quintic Newton-Schulz map, NS5), in bf16 by default.
- row_norm:       every row of the r x c side scaled to unit norm.
- mud_whiten:     MUD's triangular whitening, in fp32 (fp64 for fp64 input).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
Reduce = Callable[[Tensor], Tensor] | None

# Gram-form NS5 (see _ns5_gram) is used when c >= GRAM_MIN_ASPECT * r: there it needs fewer flops than the plain
# iteration (4c/r + 14 against 5(2c/r + 1) r^3 multiply-adds); tests/test_optim_directions.py pins that it agrees
# with the plain iteration within bf16 rounding on Gaussian, low-rank and ill-conditioned inputs.
GRAM_MIN_ASPECT = 2.5
# The Gram form restarts (materialises X and recomputes X X^T) after this many iterations; without the restart
# bf16 rounding of the accumulated polynomial ruins ill-conditioned inputs (measured: 0.55 relative error
# against the exact map where the plain iteration has 0.07).
GRAM_RESTART_AFTER = 3


def is_tall(X: Tensor) -> bool:
    return X.shape[-2] > X.shape[-1]


def oriented(X: Tensor, tall: bool | None = None) -> Tensor:
    """O(X): the r x c view with r = min(m, n) <= c (a transpose view for tall matrices, no copy).
    `tall` overrides the shape test: a shard of a tall matrix may itself be wide, but must be oriented as the
    whole matrix is."""
    return X.mT if (is_tall(X) if tall is None else tall) else X


def ns5_flops(m: int, n: int, steps: int = 5) -> int:
    """Flops of the plain NS5 iteration on one m x n matrix: steps * (4 r^2 c + 2 r^3), the count used to report
    NS5 throughput whichever form actually runs."""
    r, c = min(m, n), max(m, n)
    return steps * (4 * r * r * c + 2 * r ** 3)


def uses_gram(m: int, n: int) -> bool:
    """Whether the automatic choice runs the Gram form for an m x n matrix."""
    return max(m, n) >= GRAM_MIN_ASPECT * min(m, n)


def _as_batch(X: Tensor) -> tuple[Tensor, tuple[int, ...]]:
    """[..., r, c] -> [B, r, c] (a view where possible) and the leading shape to restore."""
    lead = X.shape[:-2]
    return X.reshape(-1, *X.shape[-2:]), lead


def _reduced(t: Tensor, reduce: Reduce) -> Tensor:
    return t if reduce is None else reduce(t)


def newton_schulz5(
    X: Tensor,
    steps: int = 5,
    dtype: torch.dtype = torch.bfloat16,
    eps: float = 1e-7,
    *,
    coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    gram: bool | None = None,
    out_dtype: torch.dtype | None = None,
    reduce: Reduce = None,
    tall: bool | None = None,
) -> Tensor:
    """NS5 (ALGORITHMS §3): X0 = X / (||X||_F + eps), then `steps` times A = X X^T; B = b A + c A^2; X = a X + B X,
    on the oriented r x c matrix, computed in `dtype` (bf16 by default, like torch.optim.Muon).

    gram: None picks the Gram form for matrices with c >= GRAM_MIN_ASPECT * r (same map, fewer flops), False
    forces the plain iteration, True the Gram form. Returns `out_dtype` (default: X's dtype). The Frobenius norm is
    per matrix for batched input. An all-zero matrix gives zeros."""
    if X.ndim < 2:
        raise ValueError(f"newton_schulz5 needs a matrix or a batch of matrices, got shape {tuple(X.shape)}")
    if steps < 1:
        raise ValueError(f"newton_schulz5 steps={steps} must be >= 1")
    out_dtype = X.dtype if out_dtype is None else out_dtype
    tall = is_tall(X) if tall is None else tall
    Xb, lead = _as_batch(oriented(X, tall))
    r, c = Xb.shape[-2:]
    # Frobenius norm in fp32 or fp64 (of the input, before rounding to the compute dtype), one value per matrix.
    acc = torch.promote_types(Xb.dtype, torch.float32)
    sq = torch.linalg.vector_norm(Xb, dim=(-2, -1), dtype=acc).square_()
    inv = 1.0 / (_reduced(sq, reduce).sqrt_() + eps)
    # X0 = X / (||X|| + eps): one pass into a new contiguous r x c tensor of the compute dtype (computed in the
    # wider dtype and rounded once); the input is never modified.
    X0 = torch.mul(Xb, inv.view(-1, 1, 1), out=torch.empty(Xb.shape, dtype=dtype, device=Xb.device))
    use_gram = uses_gram(r, c) if gram is None else gram
    Y = _ns5_gram(X0, steps, coefficients, reduce) if use_gram else _ns5_plain(X0, steps, coefficients, reduce)
    Y = Y.reshape(*lead, r, c)
    if tall:
        Y = Y.mT
    return Y if Y.dtype == out_dtype else Y.to(out_dtype)


def _ns5_plain(X: Tensor, steps: int, coefficients, reduce: Reduce) -> Tensor:
    """The plain iteration on a normalised [B, r, c] batch. baddbmm accumulates a*X + B@X before rounding, which
    keeps bf16 error at the level of torch.optim.Muon's addmm form (a separate add doubles it)."""
    a, b, c = coefficients
    for _ in range(steps):
        A = _reduced(torch.bmm(X, X.mT), reduce)
        B = torch.baddbmm(A, A, A, beta=b, alpha=c)
        X = torch.baddbmm(X, B, X, beta=a)
    return X


def _ns5_gram(X: Tensor, steps: int, coefficients, reduce: Reduce) -> Tensor:
    """The same map in Gram form: every iterate is X_k = Q_k X_0 with Q_k a polynomial of R = X_0 X_0^T, so the
    iteration runs on r x r matrices (A_k = Q_k R Q_k; Q_{k+1} = a Q_k + (b A_k + c A_k^2) Q_k) and the r x c
    matrix is touched only to form R and to apply Q. A restart every GRAM_RESTART_AFTER iterations (X <- Q X,
    R <- X X^T) bounds how far bf16 rounding of Q can drift; Q's update accumulates a*Q + B@Q before rounding.
    Cost in r^3 multiply-adds for 5 steps with one restart: 4 c/r + 14, against 5 (2 c/r + 1) for the plain form."""
    a, b, c = coefficients
    done = 0
    while done < steps:
        seg = min(GRAM_RESTART_AFTER, steps - done)
        R = _reduced(torch.bmm(X, X.mT), reduce)
        Q = None
        for _ in range(seg):
            A = R if Q is None else torch.bmm(Q, torch.bmm(R, Q))
            B = torch.baddbmm(A, A, A, beta=b, alpha=c)  # b A + c A^2
            if Q is None:  # Q_1 = a I + B
                Q = B
                Q.diagonal(dim1=-2, dim2=-1).add_(a)
            else:
                Q = torch.baddbmm(Q, B, Q, beta=a)
        X = torch.bmm(Q, X)
        done += seg
    return X


def _row_sumsq(Xo: Tensor, reduce: Reduce) -> Tensor:
    """Sum of squares of every row of the oriented [..., r, c] matrix, in fp32 (or fp64), shape [..., r, 1]."""
    acc = torch.promote_types(Xo.dtype, torch.float32)
    sq = torch.linalg.vector_norm(Xo, dim=-1, keepdim=True, dtype=acc).square_()
    return _reduced(sq, reduce)


def row_inv_norms(X: Tensor, eps: float = 1e-7, reduce: Reduce = None, tall: bool | None = None) -> Tensor:
    """1 / max(||row||, eps) for every row of the oriented matrix, shaped to broadcast against X itself:
    [..., m, 1] for wide X, [..., 1, n] for tall X. row_norm(X) == X * row_inv_norms(X); the optimizer applies the
    factor inside its parameter update instead of materialising the normalised matrix."""
    tall = is_tall(X) if tall is None else tall
    inv = _row_sumsq(oriented(X, tall), reduce).sqrt_().clamp_min_(eps).reciprocal_()
    return inv.mT if tall else inv


def row_norm(X: Tensor, eps: float = 1e-7, *, out_dtype: torch.dtype | None = None, reduce: Reduce = None,
             tall: bool | None = None) -> Tensor:
    """RowNorm (ALGORITHMS §3): R(X)_i = X_i / max(||X_i||_2, eps) over the rows of the r x c side (the columns of a
    tall X). ||R||_F^2 = r for a matrix with no zero rows; zero rows stay zero. Norms accumulate in fp32."""
    if X.ndim < 2:
        raise ValueError(f"row_norm needs a matrix or a batch of matrices, got shape {tuple(X.shape)}")
    out = X * row_inv_norms(X, eps, reduce, tall)
    return out.to(X.dtype if out_dtype is None else out_dtype)


def mud_whiten(
    X: Tensor,
    passes: int = 1,
    eps: float = 1e-7,
    *,
    solve: str = "inverse",
    out_dtype: torch.dtype | None = None,
    reduce: Reduce = None,
    tall: bool | None = None,
) -> Tensor:
    """MUD triangular whitening (ALGORITHMS §3) of the oriented r x c matrix Q, in fp32 (fp64 for fp64 input):
    repeat `passes` times: Q <- D^-1 Q (unit rows); G = Q Q^T; T = tril(G) with diagonal >= eps; Q <- T^-1 Q;
    Q <- D^-1 Q. The leading normalisation is skipped from the second pass on (rows are already unit).
    Row-orthonormal matrices are fixed points. solve='inverse' forms T^-1 by a triangular solve against I and
    applies it with one GEMM (faster on CPU here, see docs/bench_optimizer.md); solve='triangular' does a
    triangular solve directly on Q."""
    if X.ndim < 2:
        raise ValueError(f"mud_whiten needs a matrix or a batch of matrices, got shape {tuple(X.shape)}")
    if passes < 1:
        raise ValueError(f"mud_whiten passes={passes} must be >= 1")
    if solve not in ("inverse", "triangular"):
        raise ValueError(f"mud_whiten solve={solve!r} must be 'inverse' or 'triangular'")
    out_dtype = X.dtype if out_dtype is None else out_dtype
    tall = is_tall(X) if tall is None else tall
    work = torch.promote_types(X.dtype, torch.float32)
    Qb, lead = _as_batch(oriented(X, tall))
    r, c = Qb.shape[-2:]
    Q = Qb.to(work)
    eye = None
    for p in range(passes):
        if p == 0:
            Q = Q * _row_sumsq(Q, reduce).sqrt_().clamp_min_(eps).reciprocal_()
        G = _reduced(torch.bmm(Q, Q.mT), reduce)
        T = G.tril_()
        T.diagonal(dim1=-2, dim2=-1).clamp_min_(eps)
        if solve == "triangular":
            Q = torch.linalg.solve_triangular(T, Q, upper=False)
        else:
            if eye is None:
                eye = torch.eye(r, dtype=work, device=Q.device).expand(Q.shape[0], r, r)
            Q = torch.bmm(torch.linalg.solve_triangular(T, eye, upper=False), Q)
        Q.mul_(_row_sumsq(Q, reduce).sqrt_().clamp_min_(eps).reciprocal_())
    Q = Q.reshape(*lead, r, c)
    if tall:
        Q = Q.mT
    return Q if Q.dtype == out_dtype else Q.to(out_dtype)


DIRECTIONS = ("spectral", "rownorm", "mud")
