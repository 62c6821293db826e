"""The elementwise passes of a RowNorm step as two compiled kernels per matrix (optional: `compile_rownorm`).

Eager, a RowNorm step passes over the matrices' memory 12 times per element: the momentum lerp (read G, M; write
M), the Nesterov input stacked into U (read G, M; write U), U's row sums of squares (read U), weight decay (read
and write W) and the scaled update (read W, U; write W). Every row's norm needs the whole row before any of the
update can be written, so two passes are the fewest the maths allows; compiled by torch.compile (inductor: C++ on
CPU, Triton on CUDA) they are 7 reads and writes per element, as many as a fused AdamW step:
- momentum_pass: M <- lerp(M, G, 1 - mu); U = G + c M (c = mu / (1 - mu); or c M without Nesterov) written into
  the caller's stacked workspace; and U's sums of squares over the rows of O(U) (rows if wide, columns if tall),
  unreduced, so that a sharded caller sums a tall shard's columns over the ranks as before;
- update_pass: W <- decay W + alpha U s (s: the row factors, shaped to broadcast against W).
Each runs per matrix with dynamic shapes, so a model compiles a handful of graphs (wide/tall) whatever its shapes.
The results agree with the eager path to float rounding, not bit for bit: the compiled kernels contract
multiply-adds and sum the squares in another order (tests/test_fused_rownorm.py).
"""

from __future__ import annotations

import torch
from torch import Tensor


def _momentum(g: Tensor, buf: Tensor, u: Tensor, keep: float, c: float, nesterov: bool, tall: bool) -> Tensor:
    buf.lerp_(g, keep)
    x = (g + c * buf if nesterov else buf * c).to(u.dtype)
    u.copy_(x)
    x = x.to(torch.promote_types(x.dtype, torch.float32))
    return (x * x).sum(dim=-2 if tall else -1, keepdim=True)


def _update(p: Tensor, u: Tensor, s: Tensor, decay: float, alpha: float) -> None:
    p.mul_(decay).addcmul_(u, s, value=alpha)


_compiled: dict = {}


def _kernel(fn):
    if fn not in _compiled:
        _compiled[fn] = torch.compile(fn, dynamic=True)
    return _compiled[fn]


def momentum_pass(grads: list[Tensor], bufs: list[Tensor], U: Tensor, mu: float, nesterov: bool,
                  tall: bool) -> Tensor:
    """The momentum update of every matrix of a bucket, U[j] = its direction input, and U's row sums of squares,
    stacked ([B, m, 1] wide, [B, 1, n] tall; fp32, fp64 for fp64 input). `bufs` hold (1 - mu) M, as in
    MatrixOptimizer. Empty shards run the same function uncompiled (a zero size would specialise a graph)."""
    c = mu / (1.0 - mu) if nesterov else 1.0 / (1.0 - mu)
    sums = [(_momentum if g.numel() == 0 else _kernel(_momentum))(g, b, u, 1.0 - mu, c, nesterov, tall)
            for g, b, u in zip(grads, bufs, U.unbind(0))]
    return torch.stack(sums)


def update_pass(params: list[Tensor], U: Tensor, row_scale: Tensor, decay: float, alpha: float) -> None:
    """W_j <- decay W_j + alpha U_j row_scale_j for the bucket's matrices, one pass each."""
    for p, u, s in zip(params, U.unbind(0), row_scale.unbind(0)):
        (_update if p.numel() == 0 else _kernel(_update))(p, u, s, decay, alpha)
