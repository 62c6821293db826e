"""Directions that need whole matrices (NS5, and MUD on wide matrices) for momentum held as dim-0 shards
(docs/algorithms.md §6): gather mode here, owner mode in owner_exchange.py.

Input: `inputs`, {bucket key: U} with U the stacked local rows [B, rows_here, n] of B same-shape matrices (key[0]
is the whole matrix's (m, n)); `compute(key, X)` maps a [L, m, n] batch of whole matrices to its direction
(the single-device code, batched over same-shape matrices). Output: {key: D} with D [B, rows_here, n], this rank's
rows of every direction.

- gather (the paper's baseline, Moonlight's Distributed Muon): matrices are grouped into buckets of about
  `bucket_bytes`; per bucket one all-gather of every rank's (padded) shards into one flat buffer; every rank
  computes the direction of every matrix and keeps its rows. The gather of bucket b+1 is started before the wait
  on bucket b, so it is in flight while bucket b is computed. The buffers go when the bucket is done.
- owner (beyond the paper): each matrix computed once, by one owner rank; see owner_exchange.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import groupby
from typing import Callable

import torch
from torch import Tensor

from dit_train.optim.collectives import PhaseSwitch, ShardComm

Compute = Callable[[tuple, Tensor], Tensor]


@dataclass(frozen=True)
class Item:
    """One matrix: its bucket key and its position in that key's stacked batch."""

    key: tuple
    j: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.key[0]


def plan_buckets(counts: dict[tuple, int], elem_bytes: int, bucket_bytes: float) -> list[list[Item]]:
    """Consecutive matrices (key by key, so same shapes stay together and batch) in buckets of at most
    `bucket_bytes` of whole matrices (a larger matrix is a bucket of its own)."""
    buckets, cur, size = [], [], 0
    for key, count in counts.items():
        m, n = key[0]
        for j in range(count):
            nbytes = m * n * elem_bytes
            if cur and size + nbytes > bucket_bytes:
                buckets.append(cur)
                cur, size = [], 0
            cur.append(Item(key, j))
            size += nbytes
    if cur:
        buckets.append(cur)
    return buckets


def _runs(items: list[Item]) -> list[tuple[tuple, list[Item]]]:
    """Maximal runs of consecutive same-key items."""
    return [(key, list(group)) for key, group in groupby(items, key=lambda it: it.key)]


class _Outputs(dict):
    """{key: [B, rows_here, n]} direction buffers, allocated on first use with the direction's dtype."""

    def __init__(self, inputs: dict[tuple, Tensor]):
        super().__init__()
        self.inputs = inputs

    def of(self, key: tuple, dtype: torch.dtype) -> Tensor:
        buf = self.get(key)
        if buf is None:
            U = self.inputs[key]
            buf = self[key] = torch.empty(U.shape, dtype=dtype, device=U.device)
        return buf


# ---- gather ---------------------------------------------------------------------------------------------------
@dataclass
class _Gather:
    runs: list  # (key, first j, count, offset, chunk rows)
    total: int
    send: Tensor
    recv: Tensor
    work: object


def _launch_gather(bucket: list[Item], inputs: dict[tuple, Tensor], comm: ShardComm) -> _Gather:
    p = comm.world
    runs, total = [], 0
    for key, items in _runs(bucket):
        m, n = key[0]
        chunk = -(-m // p)
        runs.append((key, items[0].j, len(items), total, chunk))
        total += len(items) * chunk * n
    U0 = inputs[bucket[0].key]
    send = torch.empty(total, dtype=U0.dtype, device=U0.device)
    for key, j0, count, off, chunk in runs:
        U = inputs[key][j0:j0 + count]
        rows, n = U.shape[1], key[0][1]
        block = send[off:off + count * chunk * n].view(count, chunk, n)
        block[:, :rows].copy_(U)
        if rows < chunk:
            block[:, rows:].zero_()
    recv = torch.empty(p * total, dtype=send.dtype, device=send.device)
    return _Gather(runs, total, send, recv, comm.all_gather(recv, send))


def gather_directions(inputs: dict[tuple, Tensor], buckets: list[list[Item]], compute: Compute, comm: ShardComm,
                      phases: PhaseSwitch) -> tuple[dict[tuple, Tensor], int]:
    """Gather mode; returns ({key: local rows of D}, number of whole-matrix directions computed here)."""
    out, p, me, computed = _Outputs(inputs), comm.world, comm.rank, 0
    pending = _launch_gather(buckets[0], inputs, comm)
    for b in range(len(buckets)):
        upcoming = _launch_gather(buckets[b + 1], inputs, comm) if b + 1 < len(buckets) else None
        comm.wait(pending.work, phases)
        recv = pending.recv.view(p, pending.total)
        for key, j0, count, off, chunk in pending.runs:
            m, n = key[0]
            whole = recv[:, off:off + count * chunk * n].view(p, count, chunk, n).transpose(0, 1)
            whole = whole.reshape(count, p * chunk, n)[:, :m]
            D = compute(key, whole)
            start, rows = comm.rows(m)[me]
            out.of(key, D.dtype)[j0:j0 + count].copy_(D[:, start:start + rows])
            computed += count
        pending = upcoming  # the finished bucket's buffers are freed here
    return dict(out), computed
