"""Update directions Phi(U) of a matrix (docs/algorithms.md §3), as pure functions of a (possibly batched) matrix.

Every function takes X of shape [m, n] or [..., m, n] and computes on the oriented matrix O(X) with r = min(m, n)
rows (X itself when m <= n, X^T when m > n); the result has X's shape and the input is never modified. A tall X
is never transposed in memory: the same maths runs on X with the products taken from the other side
(X X^T of the oriented matrix is X^T X of the tall one; B @ O(X) is X @ B^T), so results come back in X's layout.

"Where the matrix lives" is kept out of the maths: every quantity that is a sum over the long side c (Frobenius
norms, row sums of squares, Gram matrices) goes through an optional `reduce` callable before it is used. For a
matrix held whole, `reduce` is None. A sharded implementation whose ranks each hold a slice of the c columns
(dim-0 shards of a tall weight) passes an all-reduce there, and `tall=` to orient a shard as its whole matrix, and
gets the whole-matrix result on every shard (docs/algorithms.md §6; tests/test_optim_directions.py checks it).

`workspace`: an optional dict the caller keeps between calls; the large intermediates are taken from it instead of
allocated (on CPU a fresh tens-of-MB buffer costs page faults on every call). With a workspace the returned tensor
is one of its buffers, valid until the next call with the same workspace.

- newton_schulz5: the spectral direction (Muon's quintic Newton-Schulz map, NS5), in bf16 by default.
- row_norm:       every row of the r x c side scaled to unit norm (row_inv_norms: just the factors).
- mud_whiten:     MUD's triangular whitening, in fp32 (fp64 for fp64 input).

Their fp32 matmuls are full fp32 on CUDA too, where the model's may use TF32 (matmul_precision.py).
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import Tensor

from dit_train.parallel.matmul_precision import ieee_fp32_matmuls

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
Reduce = Callable[[Tensor], Tensor] | None

# Gram-form NS5 (see _ns5_gram) runs where c >= GRAM_MIN_ASPECT * r: there it needs fewer flops than the plain
# iteration (4 c/r + 14 against 5 (2 c/r + 1) r^3 multiply-adds: 22 vs 25 at 2:1, 38 vs 65 at 6:1; measured on
# 8 x 512 x c bf16 batches, one thread: 0.87x the plain time at 2:1, 0.70x at 3:1). tests/test_optim_directions.py
# pins that it agrees with the plain iteration within bf16 rounding on Gaussian, low-rank, ill-conditioned and
# zero-row inputs, wide and tall.
GRAM_MIN_ASPECT = 2.0
# The Gram form restarts (materialises X and recomputes its Gram matrix) after this many iterations; without the
# restart, bf16 rounding of the accumulated polynomial ruins ill-conditioned inputs (measured: 0.55 relative error
# against the exact map where the plain iteration has 0.07).
GRAM_RESTART_AFTER = 3
_SUMSQ_CHUNK_ROWS = 256  # column sums of squares accumulate over row blocks of this size (few calls, small buffer)


def is_tall(X: Tensor) -> bool:
    return X.shape[-2] > X.shape[-1]


def oriented(X: Tensor, tall: bool | None = None) -> Tensor:
    """O(X): the r x c view with r = min(m, n) <= c (a transpose view for tall matrices, no copy).
    `tall` overrides the shape test: a shard of a tall matrix may itself be wide, but is oriented as its whole."""
    return X.mT if (is_tall(X) if tall is None else tall) else X


def ns5_flops(m: int, n: int, steps: int = 5) -> int:
    """Flops of the plain NS5 iteration on one m x n matrix: steps * (4 r^2 c + 2 r^3), the count used to report
    NS5 throughput whichever form actually runs."""
    r, c = min(m, n), max(m, n)
    return steps * (4 * r * r * c + 2 * r ** 3)


def gram_flop_ratio(m: int, n: int) -> float:
    """Multiply-adds of the Gram form over the plain iteration's for an m x n matrix (4 c/r + 14 against
    5 (2 c/r + 1) per r^3): the time the Gram form is predicted to take, as a share of the plain one's."""
    a = max(m, n) / min(m, n)
    return (4 * a + 14) / (5 * (2 * a + 1))


def ns5_executed_flops(m: int, n: int) -> float:
    """Flops the automatic NS5 form runs on one m x n matrix: ns5_flops, times gram_flop_ratio where the Gram
    form runs (the count the cost model charges at the GEMM rate; ns5_flops stays the reporting convention)."""
    return ns5_flops(m, n) * (gram_flop_ratio(m, n) if uses_gram(m, n) else 1.0)


def uses_gram(m: int, n: int) -> bool:
    """Whether the automatic choice runs the Gram form for an m x n matrix."""
    return max(m, n) >= GRAM_MIN_ASPECT * min(m, n)


def _buffer(ws: dict | None, name: str, shape, dtype: torch.dtype, device) -> Tensor:
    if ws is None:
        return torch.empty(shape, dtype=dtype, device=device)
    key = (name, tuple(shape), dtype, device)
    buf = ws.get(key)
    if buf is None:
        buf = ws[key] = torch.empty(shape, dtype=dtype, device=device)
    return buf


def _reduced(t: Tensor, reduce: Reduce) -> Tensor:
    return t if reduce is None else reduce(t)


def _batched(X: Tensor) -> Tensor:
    """[..., m, n] as [B, m, n] (a view where possible); also for an empty shard (m = 0), where reshape(-1, ...)
    would be ambiguous."""
    return X.reshape(math.prod(X.shape[:-2]), *X.shape[-2:])


def _check(X: Tensor, fn: str) -> None:
    if X.ndim < 2:
        raise ValueError(f"{fn} needs a matrix or a batch of matrices, got shape {tuple(X.shape)}")


def _gram(Z: Tensor, tall: bool, out: Tensor | None = None) -> Tensor:
    """O(Z) O(Z)^T for a [B, m, n] batch: Z Z^T if wide, Z^T Z if tall (r x r)."""
    return torch.bmm(Z.mT, Z, out=out) if tall else torch.bmm(Z, Z.mT, out=out)


def _left(P: Tensor, Z: Tensor, tall: bool, out: Tensor | None = None) -> Tensor:
    """P @ O(Z), returned in Z's layout: P Z if wide, Z P^T if tall."""
    return torch.bmm(Z, P.mT, out=out) if tall else torch.bmm(P, Z, out=out)


def _left_plus(Z: Tensor, P: Tensor, beta: float, tall: bool, out: Tensor) -> Tensor:
    """beta * O(Z) + P @ O(Z), in Z's layout, accumulated before rounding (one baddbmm)."""
    if tall:
        return torch.baddbmm(Z, Z, P.mT, beta=beta, out=out)
    return torch.baddbmm(Z, P, Z, beta=beta, out=out)


# ---- NS5 ------------------------------------------------------------------------------------------------------
@ieee_fp32_matmuls()
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
    workspace: dict | None = None,
) -> Tensor:
    """NS5 (docs/algorithms.md §3): X0 = O(X) / (||X||_F + eps), then `steps` times A = X X^T; B = b A + c A^2;
    X = a X + B X, computed in `dtype` (bf16 by default, like torch.optim.Muon), mapped back by O^-1.

    gram: None runs the Gram form for matrices with c >= GRAM_MIN_ASPECT * r (the same map with fewer flops),
    False forces the plain iteration, True the Gram form. Returns `out_dtype` (default: X's dtype). The Frobenius
    norm is per matrix for batched input. An all-zero matrix gives zeros."""
    _check(X, "newton_schulz5")
    if steps < 1:
        raise ValueError(f"newton_schulz5 steps={steps} must be >= 1")
    out_dtype = X.dtype if out_dtype is None else out_dtype
    tall = is_tall(X) if tall is None else tall
    lead = X.shape[:-2]
    Xb = _batched(X)
    m, n = Xb.shape[-2:]
    r, c = (n, m) if tall else (m, n)
    # Frobenius norm (accumulated in fp32 at least), then X0 = X / (||X|| + eps) in one pass into a private buffer
    # of the compute dtype; the input is never modified. Input already in the compute dtype (the optimizer stacks
    # U in bf16) is scaled in that dtype: mixing in an fp32 factor would make torch convert the whole batch.
    acc = torch.promote_types(Xb.dtype, torch.float32)
    sq = torch.linalg.vector_norm(Xb, dim=(-2, -1)).to(acc).square_()
    inv = (_reduced(sq, reduce).sqrt_() + eps).reciprocal_().view(-1, 1, 1)
    X0 = _buffer(workspace, "ns_x0", Xb.shape, dtype, Xb.device)
    torch.mul(Xb, inv.to(Xb.dtype) if Xb.dtype == dtype else inv, out=X0)
    use_gram = uses_gram(r, c) if gram is None else gram
    run = _ns5_gram if use_gram else _ns5_plain
    Y = run(X0, steps, coefficients, reduce, tall, workspace).reshape(*lead, m, n)
    return Y if Y.dtype == out_dtype else Y.to(out_dtype)


def _ns5_plain(X: Tensor, steps: int, coefficients, reduce: Reduce, tall: bool, ws: dict | None) -> Tensor:
    """The plain iteration on a normalised [B, m, n] batch (X is a private buffer and is overwritten).
    baddbmm accumulates a*X + B@X before rounding, which keeps bf16 error at the level of torch.optim.Muon's
    addmm form (a separate add doubles it)."""
    a, b, c = coefficients
    Bn, m, n = X.shape
    r = n if tall else m
    rr = (Bn, r, r)
    A = _buffer(ws, "ns_a", rr, X.dtype, X.device)
    P = _buffer(ws, "ns_b", rr, X.dtype, X.device)
    bufs = [X, _buffer(ws, "ns_y", X.shape, X.dtype, X.device)]
    for k in range(steps):
        A = _reduced(_gram(X, tall, out=A), reduce)
        torch.baddbmm(A, A, A, beta=b, alpha=c, out=P)
        X = _left_plus(X, P, a, tall, out=bufs[(k + 1) % 2])
    return X


def _ns5_gram(X: Tensor, steps: int, coefficients, reduce: Reduce, tall: bool, ws: dict | None) -> Tensor:
    """The same map in Gram form: every iterate is X_k = Q_k X_0 with Q_k a polynomial of R = X_0 X_0^T, so the
    iteration runs on r x r matrices (A_k = Q_k R Q_k; Q_{k+1} = a Q_k + (b A_k + c A_k^2) Q_k) and the r x c
    matrix is touched only to form R and to apply Q. A restart every GRAM_RESTART_AFTER iterations (X <- Q X,
    R <- X X^T) bounds how far bf16 rounding of Q can drift; Q's update accumulates a*Q + B@Q before rounding.
    Cost in r^3 multiply-adds for 5 steps with one restart: 4 c/r + 14, against 5 (2 c/r + 1) for the plain form."""
    a, b, c = coefficients
    Bn, m, n = X.shape
    r = n if tall else m
    rr = (Bn, r, r)
    R = _buffer(ws, "ns_r", rr, X.dtype, X.device)
    T = _buffer(ws, "ns_t", rr, X.dtype, X.device)
    Abuf = _buffer(ws, "ns_a", rr, X.dtype, X.device)
    P = _buffer(ws, "ns_b", rr, X.dtype, X.device)
    Qs = [_buffer(ws, "ns_q0", rr, X.dtype, X.device), _buffer(ws, "ns_q1", rr, X.dtype, X.device)]
    xs = [X, _buffer(ws, "ns_y", X.shape, X.dtype, X.device)]
    done = 0
    while done < steps:
        seg = min(GRAM_RESTART_AFTER, steps - done)
        R = _reduced(_gram(X, tall, out=R), reduce)
        Q = None
        for k in range(seg):
            A = R if Q is None else torch.bmm(Q, torch.bmm(R, Q, out=T), out=Abuf)
            if Q is None:  # Q_1 = a I + b R + c R^2
                Q = torch.baddbmm(A, A, A, beta=b, alpha=c, out=Qs[0])
                Q.diagonal(dim1=-2, dim2=-1).add_(a)
            else:
                torch.baddbmm(A, A, A, beta=b, alpha=c, out=P)
                Q = torch.baddbmm(Q, P, Q, beta=a, out=Qs[k % 2])
        X = _left(Q, X, tall, out=xs[1] if X is xs[0] else xs[0])
        done += seg
    return X


# ---- RowNorm --------------------------------------------------------------------------------------------------
def _row_sumsq(X: Tensor, tall: bool, reduce: Reduce, workspace: dict | None = None) -> Tensor:
    """Sum of squares of every row of O(X) for a [..., m, n] X, in fp32 (fp64 for fp64 input), shaped to broadcast
    against X: [..., m, 1] if wide, [..., 1, n] if tall (column sums: accumulated blockwise, since a strided
    reduction over dim -2 is ~15x slower on CPU; the block accumulator comes from `workspace` when given: zeroing a
    fresh one cost ~3.5 ms of page faults per RowNorm step at the benchmark's size)."""
    acc = torch.promote_types(X.dtype, torch.float32)
    if not tall:
        return _reduced(torch.linalg.vector_norm(X, dim=-1, keepdim=True, dtype=acc).square_(), reduce)
    k = min(_SUMSQ_CHUNK_ROWS, X.shape[-2])
    part = _buffer(workspace, "sumsq_part", (*X.shape[:-2], k, X.shape[-1]), acc, X.device).zero_()
    for chunk in X.split(k, dim=-2):  # elementwise accumulation over row blocks, then one short reduction
        chunk = chunk.to(acc)
        (part if chunk.shape[-2] == k else part[..., : chunk.shape[-2], :]).addcmul_(chunk, chunk)
    return _reduced(part.sum(dim=-2, keepdim=True), reduce)


def row_inv_norms(X: Tensor, eps: float = 1e-7, reduce: Reduce = None, tall: bool | None = None,
                  workspace: dict | None = None) -> Tensor:
    """1 / max(||row||, eps) for every row of O(X), shaped to broadcast against X itself: [..., m, 1] for wide X,
    [..., 1, n] for tall X. row_norm(X) == X * row_inv_norms(X); the optimizer applies the factor inside its
    parameter update instead of materialising the normalised matrix."""
    tall = is_tall(X) if tall is None else tall
    return inv_norms_from_sumsq(_row_sumsq(X, tall, reduce, workspace), eps)


def row_sumsq(X: Tensor, tall: bool | None = None, workspace: dict | None = None) -> Tensor:
    """The sums of squares row_inv_norms passes to `reduce`, unreduced. A sharded caller that reduces the shards of
    many matrices in one collective takes these, reduces them together, then finishes with inv_norms_from_sumsq:
    the same result as row_inv_norms(X, eps, reduce, tall)."""
    return _row_sumsq(X, is_tall(X) if tall is None else tall, None, workspace)


def inv_norms_from_sumsq(sumsq: Tensor, eps: float = 1e-7) -> Tensor:
    """1 / max(sqrt(sumsq), eps), in place."""
    return sumsq.sqrt_().clamp_min_(eps).reciprocal_()


def row_norm(X: Tensor, eps: float = 1e-7, *, out_dtype: torch.dtype | None = None, reduce: Reduce = None,
             tall: bool | None = None) -> Tensor:
    """RowNorm (docs/algorithms.md §3): R(X)_i = X_i / max(||X_i||_2, eps) over the rows of the r x c side (the columns of a
    tall X). ||R||_F^2 = r for a matrix with no zero rows; zero rows stay zero. Norms accumulate in fp32."""
    _check(X, "row_norm")
    out = X * row_inv_norms(X, eps, reduce, tall)
    return out.to(X.dtype if out_dtype is None else out_dtype)


# ---- MUD ------------------------------------------------------------------------------------------------------
@ieee_fp32_matmuls()
def mud_whiten(
    X: Tensor,
    passes: int = 1,
    eps: float = 1e-7,
    *,
    solve: str = "triangular",
    out_dtype: torch.dtype | None = None,
    reduce: Reduce = None,
    tall: bool | None = None,
    workspace: dict | None = None,
) -> Tensor:
    """MUD triangular whitening (docs/algorithms.md §3) of the oriented r x c matrix Q, in fp32 (fp64 for fp64 input):
    repeat `passes` times: Q <- D^-1 Q (unit rows); G = Q Q^T; T = tril(G) with diagonal >= eps; Q <- T^-1 Q;
    Q <- D^-1 Q. The leading normalisation is skipped from the second pass on (rows are already unit).
    Row-orthonormal matrices are fixed points. solve='triangular' (default, faster here: docs/bench_optimizer.md)
    solves T Y = Q directly; solve='inverse' forms T^-1 by a triangular solve against I and applies it by one GEMM."""
    _check(X, "mud_whiten")
    if passes < 1:
        raise ValueError(f"mud_whiten passes={passes} must be >= 1")
    if solve not in ("inverse", "triangular"):
        raise ValueError(f"mud_whiten solve={solve!r} must be 'inverse' or 'triangular'")
    out_dtype = X.dtype if out_dtype is None else out_dtype
    tall = is_tall(X) if tall is None else tall
    work = torch.promote_types(X.dtype, torch.float32)
    lead = X.shape[:-2]
    Xb = _batched(X)
    Bn, m, n = Xb.shape
    r = n if tall else m
    bufs = [_buffer(workspace, "mud_q0", Xb.shape, work, Xb.device), _buffer(workspace, "mud_q1", Xb.shape, work, Xb.device)]
    Q = torch.mul(Xb, _row_sumsq(Xb, tall, reduce).sqrt_().clamp_min_(eps).reciprocal_(), out=bufs[0])
    G = _buffer(workspace, "mud_g", (Bn, r, r), work, Xb.device)
    eye = None
    for p in range(passes):
        _gram(Q, tall, out=G)
        T = _reduced(G, reduce).tril_()
        T.diagonal(dim1=-2, dim2=-1).clamp_min_(eps)
        nxt = bufs[(p + 1) % 2]
        if solve == "triangular":
            # T^-1 O(Q); for a tall Q (= O(Q)^T) that is Q T^-T, a solve from the right with the upper T^T
            if tall:
                torch.linalg.solve_triangular(T.mT, Q, upper=True, left=False, out=nxt)
            else:
                torch.linalg.solve_triangular(T, Q, upper=False, out=nxt)
        else:
            if eye is None:
                eye = torch.eye(r, dtype=work, device=Xb.device).expand(Bn, r, r)
            _left(torch.linalg.solve_triangular(T, eye, upper=False), Q, tall, out=nxt)
        Q = nxt
        Q.mul_(_row_sumsq(Q, tall, reduce).sqrt_().clamp_min_(eps).reciprocal_())
    Q = Q.reshape(*lead, m, n)
    return Q if Q.dtype == out_dtype else Q.to(out_dtype)
