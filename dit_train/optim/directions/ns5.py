"""NS5: the spectral direction (Muon's quintic Newton-Schulz map), in bf16 by default (docs/algorithms.md §3).
Its fp32 matmuls are full fp32 on CUDA too, where the model's may use TF32 (matmul_precision.py)."""

from __future__ import annotations


import torch
from torch import Tensor

from dit_train.parallel.matmul_precision import ieee_fp32_matmuls
from dit_train.optim.directions.base import Direction
from dit_train.optim.optimizer_config import NS5Config
from dit_train.optim.directions.linalg import DTYPES, Reduce, batched, buffer, check_matrix, gram, is_tall, left, left_plus, reduced

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)

# Gram-form NS5 (see _ns5_gram) runs where c >= GRAM_MIN_ASPECT * r: there it needs fewer flops than the plain
# iteration (4 c/r + 14 against 5 (2 c/r + 1) r^3 multiply-adds: 22 vs 25 at 2:1, 38 vs 65 at 6:1; measured on
# 8 x 512 x c bf16 batches, one thread: 0.87x the plain time at 2:1, 0.70x at 3:1). tests/unit/test_optim_directions.py
# pins that it agrees with the plain iteration within bf16 rounding on Gaussian, low-rank, ill-conditioned and
# zero-row inputs, wide and tall.
GRAM_MIN_ASPECT = 2.0
# The Gram form restarts (materialises X and recomputes its Gram matrix) after this many iterations; without the
# restart, bf16 rounding of the accumulated polynomial ruins ill-conditioned inputs (measured: 0.55 relative error
# against the exact map where the plain iteration has 0.07).
GRAM_RESTART_AFTER = 3


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


_LEGACY_NAMES = {"bfloat16": "bf16", "float32": "fp32", "float64": "fp64"}  # optimizer states saved before
_NAME_OF = {dt: name for name, dt in DTYPES.items()}


def dtype_name(dt: torch.dtype | str) -> str:
    """Groups keep dtypes as names, so state_dicts hold plain values (DCP, JSON, weights_only loads)."""
    name = _NAME_OF.get(dt) if isinstance(dt, torch.dtype) else _LEGACY_NAMES.get(dt, dt)
    if name not in DTYPES:
        raise ValueError(f"ns_dtype={dt!r} is not valid; choose one of {', '.join(DTYPES)}")
    return name


class NS5(Direction):
    """newton_schulz5 of U in group["ns_dtype"], `ns_steps` iterations, Gram form per `ns_gram`."""

    name = "spectral"
    Config = NS5Config

    def __init__(self, steps: int = 5, dtype: torch.dtype | str = "bf16", gram: bool | None = None):
        self.steps, self.dtype, self.gram = steps, dtype_name(dtype), gram

    @classmethod
    def from_config(cls, values: dict) -> "NS5":
        return cls(values["ns_steps"], values["ns_dtype"], values["ns_gram"])

    def group_keys(self) -> dict:
        return {"ns_steps": self.steps, "ns_dtype": self.dtype, "ns_gram": self.gram}

    def __call__(self, U, group, ws, **placement):
        dt = DTYPES[group["ns_dtype"]]
        D = newton_schulz5(U, group["ns_steps"], dt, group["direction_eps"], gram=group["ns_gram"], out_dtype=dt,
                           workspace=ws, **placement)
        return D, None

    def input_dtype(self, group, param_dtype):
        return DTYPES[group["ns_dtype"]]  # the cast is fused into the Nesterov add

    def output_dtype(self, group, gathered):
        return DTYPES[group["ns_dtype"]]


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
    check_matrix(X, "newton_schulz5")
    if steps < 1:
        raise ValueError(f"newton_schulz5 steps={steps} must be >= 1")
    out_dtype = X.dtype if out_dtype is None else out_dtype
    tall = is_tall(X) if tall is None else tall
    lead = X.shape[:-2]
    Xb = batched(X)
    m, n = Xb.shape[-2:]
    r, c = (n, m) if tall else (m, n)
    # Frobenius norm (accumulated in fp32 at least), then X0 = X / (||X|| + eps) in one pass into a private buffer
    # of the compute dtype; the input is never modified. Input already in the compute dtype (the optimizer stacks
    # U in bf16) is scaled in that dtype: mixing in an fp32 factor would make torch convert the whole batch.
    acc = torch.promote_types(Xb.dtype, torch.float32)
    sq = torch.linalg.vector_norm(Xb, dim=(-2, -1)).to(acc).square_()
    inv = (reduced(sq, reduce).sqrt_() + eps).reciprocal_().view(-1, 1, 1)
    X0 = buffer(workspace, "ns_x0", Xb.shape, dtype, Xb.device)
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
    A = buffer(ws, "ns_a", rr, X.dtype, X.device)
    P = buffer(ws, "ns_b", rr, X.dtype, X.device)
    bufs = [X, buffer(ws, "ns_y", X.shape, X.dtype, X.device)]
    for k in range(steps):
        A = reduced(gram(X, tall, out=A), reduce)
        torch.baddbmm(A, A, A, beta=b, alpha=c, out=P)
        X = left_plus(X, P, a, tall, out=bufs[(k + 1) % 2])
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
    R = buffer(ws, "ns_r", rr, X.dtype, X.device)
    T = buffer(ws, "ns_t", rr, X.dtype, X.device)
    Abuf = buffer(ws, "ns_a", rr, X.dtype, X.device)
    P = buffer(ws, "ns_b", rr, X.dtype, X.device)
    Qs = [buffer(ws, "ns_q0", rr, X.dtype, X.device), buffer(ws, "ns_q1", rr, X.dtype, X.device)]
    xs = [X, buffer(ws, "ns_y", X.shape, X.dtype, X.device)]
    done = 0
    while done < steps:
        seg = min(GRAM_RESTART_AFTER, steps - done)
        R = reduced(gram(X, tall, out=R), reduce)
        Q = None
        for k in range(seg):
            A = R if Q is None else torch.bmm(Q, torch.bmm(R, Q, out=T), out=Abuf)
            if Q is None:  # Q_1 = a I + b R + c R^2
                Q = torch.baddbmm(A, A, A, beta=b, alpha=c, out=Qs[0])
                Q.diagonal(dim1=-2, dim2=-1).add_(a)
            else:
                torch.baddbmm(A, A, A, beta=b, alpha=c, out=P)
                Q = torch.baddbmm(Q, P, Q, beta=a, out=Qs[k % 2])
        X = left(Q, X, tall, out=xs[1] if X is xs[0] else xs[0])
        done += seg
    return X
