"""The elementwise passes of a RowNorm step fused into two passes per shape bucket (`compile_rownorm`; `auto`,
the default, fuses where they run as C loops).

Eager, a RowNorm step is six torch ops per matrix (momentum lerp, Nesterov input stacked into U, U's row sums of
squares, weight decay, scaled update), ~2x the time of torch's fused AdamW kernel on the same matrices
(docs/bench_optimizer.md). Every row's norm needs the whole row before any of the update can be written, so two
passes are the fewest the maths allows:
- momentum_pass: M <- lerp(M, G, 1 - mu); U = G + c M (c = mu / (1 - mu); or c M without Nesterov); U's sums of
  squares over the rows of O(U) (rows if wide, columns if tall), unreduced, so that a sharded caller sums a tall
  shard's columns over the ranks as before. U is written into the caller's stacked workspace only when the
  direction reads it (the spectral RowNorm scale's power iteration); otherwise nothing but M is stored;
- update_pass: W <- decay W + alpha U s (s: the row factors, shaped to broadcast against W), with U read from the
  workspace or, when it was not stored, recomputed from G and M (two reads instead of one write and one read).
Read and written once each, that is 3 + 4 transfers per element, as many as fused AdamW's 7. With the frobenius
scale, a bucket whose row factors are local (`one_pass`: C loops only) runs both passes in one call, reordered so
that the update reads G and M back from the cache: a wide matrix's chunk of rows right after its momentum (G, M
and W read once from memory: 5 transfers), a tall matrix's columns right after the whole matrix's momentum (from
L3); the same bits as the two passes.
On CPU the passes are C loops (native_rownorm.py) for the fp32/fp64 contiguous tensors they take: inductor's
kernels for them read G and M twice (the reduction and the stores are two loop nests) and, at 1 thread on the
benchmark model, were no faster than eager. Elsewhere (CUDA: Triton) the same two passes are torch.compile'd
functions, one call per bucket with dynamic shapes; a tall matrix's column sums reduce blocks of
COLUMN_SUM_BLOCK rows first, as inductor's plain reduction over dim -2 walks the columns with a stride on CPU.
The results agree with the eager path to float rounding, not bit for bit: both backends contract multiply-adds
and sum the squares in another order (tests/test_fused_rownorm.py).
"""

from __future__ import annotations

import types

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

from dit_train.optim import native_rownorm

COLUMN_SUM_BLOCK = 16


def resolve_compile_rownorm(setting, matrices: list) -> bool:
    """compile_rownorm as the optimizer runs it. "auto" (the default): on where the passes run as the C loops (every
    matrix parameter on CPU in fp32/fp64, and the library builds), eager elsewhere: on CUDA a RowNorm step is a few
    milliseconds of memory traffic, and the torch.compile'd kernels it would take have not run on a GPU yet
    (true opts in). DTensor parameters report their mesh's device type and their dtype, as their shards have. Fake
    tensors (the memory estimate runs the real step on them) have no memory for C loops to read: eager."""
    if setting == "auto":
        return bool(matrices) and all(p.device.type == "cpu" and p.dtype in (torch.float32, torch.float64)
                                      and not is_fake(p) for p in matrices) and native_rownorm.load() is not None
    if not isinstance(setting, bool):
        raise ValueError(f"compile_rownorm={setting!r} is not valid; choose auto, true or false")
    return setting


def _sumsq(x: Tensor, tall: bool) -> Tensor:
    x = x.to(torch.promote_types(x.dtype, torch.float32))
    x = x * x
    if not tall:
        return x.sum(dim=-1, keepdim=True)
    m, n = x.shape
    if m % COLUMN_SUM_BLOCK == 0:
        return x.view(m // COLUMN_SUM_BLOCK, COLUMN_SUM_BLOCK, n).sum(dim=1).sum(dim=0, keepdim=True)
    return x.sum(dim=0, keepdim=True)


def _direction_input(g: Tensor, buf: Tensor, c: float, nesterov: bool, dtype: torch.dtype) -> Tensor:
    return (g + c * buf if nesterov else buf * c).to(dtype)


def _momentum(grads: list[Tensor], bufs: list[Tensor], us: list[Tensor] | None, keep: float, c: float,
              nesterov: bool, tall: bool, dtype: torch.dtype) -> Tensor:
    sums = []
    for j, (g, buf) in enumerate(zip(grads, bufs)):
        buf.lerp_(g, keep)
        x = _direction_input(g, buf, c, nesterov, dtype)
        if us is not None:
            us[j].copy_(x)
        sums.append(_sumsq(x, tall))
    return torch.stack(sums)


def _update(params: list[Tensor], grads: list[Tensor], bufs: list[Tensor], us: list[Tensor] | None,
            scales: list[Tensor], decay: float, alpha: float, c: float, nesterov: bool, dtype: torch.dtype) -> None:
    for j, (p, s) in enumerate(zip(params, scales)):
        u = us[j] if us is not None else _direction_input(grads[j], bufs[j], c, nesterov, dtype)
        p.mul_(decay).addcmul_(u, s, value=alpha)


_compiled: dict = {}


def _kernel(fn, *variant):
    """fn compiled once per variant (bucket size, orientation, whether U is stored, ...): each variant gets its own
    copy of fn's code, so that dynamo's per-code recompile limit (8) counts one variant's recompiles, not all."""
    key = (fn, *variant)
    if key not in _compiled:
        copy = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__)
        _compiled[key] = torch.compile(copy, dynamic=True)
    return _compiled[key]


def _coefficient(mu: float, nesterov: bool) -> float:
    """`bufs` hold (1 - mu) M, as in MatrixOptimizer: G + mu M = G + c buf, M = c buf."""
    return mu / (1.0 - mu) if nesterov else 1.0 / (1.0 - mu)


def momentum_pass(grads: list[Tensor], bufs: list[Tensor], U: Tensor, mu: float, nesterov: bool, tall: bool,
                  store_u: bool, x0: Tensor | None = None, eps: float = 0.0) -> tuple[Tensor, Tensor | None]:
    """The momentum update of every matrix of a bucket and U's row sums of squares, stacked ([B, m, 1] wide,
    [B, 1, n] tall; fp32, fp64 for fp64 input); U[j] = the direction input of matrix j if store_u (U's dtype
    either way). Returns (sums, R^T x0 or None): given x0 ([B, m], the spectral scale's start vectors), the C loops
    also return the power iteration's first product for a wide bucket (spectral_cap.py), R = U / max(|row|, eps);
    elsewhere None, and the power iteration computes it. On CPU the C loops run (native_rownorm.py) where they
    take the tensors; empty shards run the same function uncompiled (a zero size would specialise a graph)."""
    us = list(U.unbind(0)) if store_u else None
    keep, c = 1.0 - mu, _coefficient(mu, nesterov)
    if U.numel() > 0 and U.dtype == grads[0].dtype and native_rownorm.supports(*grads, *bufs, *(us or [])):
        sums = torch.empty((U.shape[0], 1, U.shape[2]) if tall else (*U.shape[:2], 1), dtype=U.dtype)
        fold = x0 if store_u and x0 is not None and x0.dtype == U.dtype and x0.is_contiguous() else None
        y0 = native_rownorm.momentum(grads, bufs, U if store_u else None, sums, keep, c, nesterov, tall, fold, eps)
        return sums, y0
    args = (grads, bufs, us, keep, c, nesterov, tall, U.dtype)
    if U.numel() == 0:
        return _momentum(*args), None
    return _kernel(_momentum, len(grads), tall, store_u)(*args), None


def update_pass(params: list[Tensor], grads: list[Tensor], bufs: list[Tensor], U: Tensor, stored_u: bool,
                row_scale: Tensor, decay: float, alpha: float, mu: float, nesterov: bool, tall: bool) -> None:
    """W_j <- decay W_j + alpha U_j row_scale_j for the bucket's matrices, one pass; U_j recomputed from G_j and
    the (updated) momentum unless momentum_pass stored it."""
    c = _coefficient(mu, nesterov)
    if (U.numel() > 0 and U.dtype == params[0].dtype
            and native_rownorm.supports(*params, *grads, *bufs, *([U] if stored_u else []), row_scale)):
        native_rownorm.update(params, grads, bufs, U if stored_u else None, row_scale, decay, alpha, c, nesterov,
                              tall)
        return
    us = list(U.unbind(0)) if stored_u else None
    args = (params, grads, bufs, us, list(row_scale.unbind(0)), decay, alpha, c, nesterov, U.dtype)
    if U.numel() == 0:
        return _update(*args)
    _kernel(_update, len(params), tall, stored_u)(*args)


def one_pass_takes(params: list[Tensor], grads: list[Tensor], bufs: list[Tensor]) -> bool:
    """Whether `one_pass` runs on this bucket: the C loops take its tensors (fp32/fp64, contiguous, on CPU)."""
    return bool(params) and native_rownorm.supports(*params, *grads, *bufs)


def one_pass(params: list[Tensor], grads: list[Tensor], bufs: list[Tensor], mu: float, nesterov: bool, tall: bool,
             eps: float, decay: float, alpha: float) -> None:
    """momentum_pass, the frobenius row factors (directions.inv_norms_from_sumsq) and update_pass in one C call,
    bit for bit: for a bucket whose row factors are local (whole rows of a wide matrix, whole columns of a tall
    one), each row's (wide) or column strip's (tall) G and M are read back from the cache instead of memory."""
    native_rownorm.step(params, grads, bufs, 1.0 - mu, _coefficient(mu, nesterov), nesterov, tall, eps, decay,
                        alpha)
