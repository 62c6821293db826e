"""Batched-matrix helpers the directions share (directions/ns5.py, rownorm.py, mud.py): orientation, workspace
buffers, the `reduce` hook and Gram/left products on a [B, m, n] batch.

Every direction takes X of shape [m, n] or [..., m, n] and computes on the oriented matrix O(X) with r = min(m, n)
rows (X itself when m <= n, X^T when m > n); the result has X's shape and the input is never modified. A tall X
is never transposed in memory: the same maths runs on X with the products taken from the other side
(X X^T of the oriented matrix is X^T X of the tall one; B @ O(X) is X @ B^T), so results come back in X's layout.

"Where the matrix lives" is kept out of the maths: every quantity that is a sum over the long side c (Frobenius
norms, row sums of squares, Gram matrices) goes through an optional `reduce` callable before it is used. For a
matrix held whole, `reduce` is None. A sharded implementation whose ranks each hold a slice of the c columns
(dim-0 shards of a tall weight) passes an all-reduce there, and `tall=` to orient a shard as its whole matrix, and
gets the whole-matrix result on every shard (docs/algorithms.md §6; tests/unit/test_optim_directions.py checks it).

`workspace`: an optional dict the caller keeps between calls; the large intermediates are taken from it instead of
allocated (on CPU a fresh tens-of-MB buffer costs page faults on every call). With a workspace the returned tensor
is one of its buffers, valid until the next call with the same workspace.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import Tensor

from dit_train.dtypes import torch_dtypes
from dit_train.optim.optimizer_config import DIRECTION_DTYPES

Reduce = Callable[[Tensor], Tensor] | None
DTYPES = torch_dtypes(*DIRECTION_DTYPES)  # what the directions compute in, by their config names
_SUMSQ_CHUNK_ROWS = 256  # column sums of squares accumulate over row blocks of this size (few calls, small buffer)


def is_tall(X: Tensor) -> bool:
    return X.shape[-2] > X.shape[-1]


def oriented(X: Tensor, tall: bool | None = None) -> Tensor:
    """O(X): the r x c view with r = min(m, n) <= c (a transpose view for tall matrices, no copy).
    `tall` overrides the shape test: a shard of a tall matrix may itself be wide, but is oriented as its whole."""
    return X.mT if (is_tall(X) if tall is None else tall) else X


def buffer(ws: dict | None, name: str, shape, dtype: torch.dtype, device) -> Tensor:
    if ws is None:
        return torch.empty(shape, dtype=dtype, device=device)
    key = (name, tuple(shape), dtype, device)
    buf = ws.get(key)
    if buf is None:
        buf = ws[key] = torch.empty(shape, dtype=dtype, device=device)
    return buf


def reduced(t: Tensor, reduce: Reduce) -> Tensor:
    return t if reduce is None else reduce(t)


def batched(X: Tensor) -> Tensor:
    """[..., m, n] as [B, m, n] (a view where possible); also for an empty shard (m = 0), where reshape(-1, ...)
    would be ambiguous."""
    return X.reshape(math.prod(X.shape[:-2]), *X.shape[-2:])


def check_matrix(X: Tensor, fn: str) -> None:
    if X.ndim < 2:
        raise ValueError(f"{fn} needs a matrix or a batch of matrices, got shape {tuple(X.shape)}")


def gram(Z: Tensor, tall: bool, out: Tensor | None = None) -> Tensor:
    """O(Z) O(Z)^T for a [B, m, n] batch: Z Z^T if wide, Z^T Z if tall (r x r)."""
    return torch.bmm(Z.mT, Z, out=out) if tall else torch.bmm(Z, Z.mT, out=out)


def left(P: Tensor, Z: Tensor, tall: bool, out: Tensor | None = None) -> Tensor:
    """P @ O(Z), returned in Z's layout: P Z if wide, Z P^T if tall."""
    return torch.bmm(Z, P.mT, out=out) if tall else torch.bmm(P, Z, out=out)


def left_plus(Z: Tensor, P: Tensor, beta: float, tall: bool, out: Tensor) -> Tensor:
    """beta * O(Z) + P @ O(Z), in Z's layout, accumulated before rounding (one baddbmm)."""
    if tall:
        return torch.baddbmm(Z, Z, P.mT, beta=beta, out=out)
    return torch.baddbmm(Z, P, Z, beta=beta, out=out)


def row_sumsq_of(X: Tensor, tall: bool, reduce: Reduce, workspace: dict | None = None) -> Tensor:
    """Sum of squares of every row of O(X) for a [..., m, n] X, in fp32 (fp64 for fp64 input), shaped to broadcast
    against X: [..., m, 1] if wide, [..., 1, n] if tall (column sums: accumulated blockwise, since a strided
    reduction over dim -2 is ~15x slower on CPU; the block accumulator comes from `workspace` when given: zeroing a
    fresh one cost ~3.5 ms of page faults per RowNorm step at the benchmark's size)."""
    acc = torch.promote_types(X.dtype, torch.float32)
    if not tall:
        return reduced(torch.linalg.vector_norm(X, dim=-1, keepdim=True, dtype=acc).square_(), reduce)
    k = min(_SUMSQ_CHUNK_ROWS, X.shape[-2])
    part = buffer(workspace, "sumsq_part", (*X.shape[:-2], k, X.shape[-1]), acc, X.device).zero_()
    for chunk in X.split(k, dim=-2):  # elementwise accumulation over row blocks, then one short reduction
        chunk = chunk.to(acc)
        (part if chunk.shape[-2] == k else part[..., : chunk.shape[-2], :]).addcmul_(chunk, chunk)
    return reduced(part.sum(dim=-2, keepdim=True), reduce)
