"""Directions that need whole matrices (NS5, and MUD on wide matrices) for momentum held as dim-0 shards
(docs/algorithms.md §6): the two ways to bring the rows together, both bucketed and pipelined.

Input: `inputs`, {bucket key: U} with U the stacked local rows [B, rows_here, n] of B same-shape matrices (key[0]
is the whole matrix's (m, n)); `compute(key, X)` maps a [L, m, n] batch of whole matrices to its direction
(the single-device code, batched over same-shape matrices). Output: {key: D} with D [B, rows_here, n], this rank's
rows of every direction.

- gather (the paper's baseline, Moonlight's Distributed Muon): matrices are grouped into buckets of about
  `bucket_bytes`; per bucket one all-gather of every rank's (padded) shards into one flat buffer; every rank
  computes the direction of every matrix and keeps its rows. The gather of bucket b+1 is started before the wait
  on bucket b, so it is in flight while bucket b is computed. The buffers go when the bucket is done.
- owner (beyond the paper): every matrix has one owner rank (`assign_owners`: greedy, largest NS5 flop count
  first, to the least-loaded rank, in bucket order so that each bucket is spread too); per bucket one all-to-all
  brings each matrix's shards to its owner, the owner computes (batched over its same-shape matrices) and a second
  all-to-all returns every rank's rows. Each direction is computed once; per-rank traffic is ~2/p of the matrices
  instead of (p - 1)/p. Bucket b+1's first all-to-all is in flight while bucket b is computed, and the returns are
  waited for at the end.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import groupby
from typing import Callable

import torch
from torch import Tensor

from .collectives import PhaseSwitch, ShardComm
from .directions import ns5_flops

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


def assign_owners(buckets: list[list[Item]], world: int) -> dict[Item, int]:
    """Owner rank of every matrix, balanced by NS5 flops (greedy LPT, bucket by bucket, ties to the lower rank)."""
    load, owner = [0] * world, {}
    for bucket in buckets:
        for it in sorted(bucket, key=lambda it: -ns5_flops(*it.shape)):
            r = min(range(world), key=lambda q: (load[q], q))
            owner[it] = r
            load[r] += ns5_flops(*it.shape)
    return owner


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


# ---- owner ----------------------------------------------------------------------------------------------------
@dataclass
class _Exchange:
    bucket: list[Item]
    send: Tensor
    recv: Tensor
    work: object
    owned: list[Item] = field(default_factory=list)


def _launch_to_owners(bucket: list[Item], owners: dict[Item, int], inputs: dict[tuple, Tensor],
                      comm: ShardComm) -> _Exchange:
    p, me = comm.world, comm.rank
    parts: list[list[Tensor]] = [[] for _ in range(p)]
    in_splits, out_splits = [0] * p, [0] * p
    for it in bucket:
        o = owners[it]
        shard = inputs[it.key][it.j]
        parts[o].append(shard.reshape(-1))
        in_splits[o] += shard.numel()
        if o == me:
            m, n = it.shape
            for r, (_, rows) in enumerate(comm.rows(m)):
                out_splits[r] += rows * n
    U0 = inputs[bucket[0].key]
    flat = [t for ts in parts for t in ts]
    send = torch.cat(flat) if flat else torch.empty(0, dtype=U0.dtype, device=U0.device)
    recv = torch.empty(sum(out_splits), dtype=U0.dtype, device=U0.device)
    owned = [it for it in bucket if owners[it] == me]
    return _Exchange(bucket, send, recv, comm.all_to_all(recv, send, out_splits, in_splits), owned)


def _compute_owned(ex: _Exchange, owners: dict[Item, int], compute: Compute, out_dtype: torch.dtype,
                   comm: ShardComm) -> tuple[_Exchange, int]:
    """Assemble the owned matrices from the received shards, compute their directions, start returning the rows."""
    p, me = comm.world, comm.rank
    owned = ex.owned
    by_key: dict[tuple, list[Item]] = {}
    for it in owned:
        by_key.setdefault(it.key, []).append(it)
    wholes = {key: torch.empty((len(items), *key[0]), dtype=ex.recv.dtype, device=ex.recv.device)
              for key, items in by_key.items()}
    slot = {it: (it.key, k) for key, items in by_key.items() for k, it in enumerate(items)}
    off = 0
    for r in range(p):  # the received buffer: from rank 0 its rows of every owned matrix, then rank 1, ...
        for it in owned:
            m, n = it.shape
            start, rows = comm.rows(m)[r]
            key, k = slot[it]
            wholes[key][k, start:start + rows] = ex.recv[off:off + rows * n].view(rows, n)
            off += rows * n
    directions = {key: compute(key, X) for key, X in wholes.items()}
    parts, in_splits, out_splits = [], [0] * p, [0] * p
    for r in range(p):
        for it in owned:
            key, k = slot[it]
            start, rows = comm.rows(it.shape[0])[r]
            parts.append(directions[key][k, start:start + rows].reshape(-1))
            in_splits[r] += parts[-1].numel()
    for it in ex.bucket:
        out_splits[owners[it]] += comm.rows(it.shape[0])[me][1] * it.shape[1]
    device = ex.recv.device
    send = torch.cat(parts).to(out_dtype) if parts else torch.empty(0, dtype=out_dtype, device=device)
    recv = torch.empty(sum(out_splits), dtype=out_dtype, device=device)
    back = _Exchange(ex.bucket, send, recv, comm.all_to_all(recv, send, out_splits, in_splits))
    return back, len(owned)


def owner_directions(inputs: dict[tuple, Tensor], buckets: list[list[Item]], owners: dict[Item, int],
                     compute: Compute, out_dtype: torch.dtype, comm: ShardComm,
                     phases: PhaseSwitch) -> tuple[dict[tuple, Tensor], int]:
    """Owner mode; returns ({key: local rows of D}, number of whole-matrix directions computed here)."""
    out, p, me, computed = _Outputs(inputs), comm.world, comm.rank, 0
    pending = _launch_to_owners(buckets[0], owners, inputs, comm)
    backs = []
    for b in range(len(buckets)):
        upcoming = _launch_to_owners(buckets[b + 1], owners, inputs, comm) if b + 1 < len(buckets) else None
        comm.wait(pending.work, phases)
        back, n_owned = _compute_owned(pending, owners, compute, out_dtype, comm)
        backs.append(back)
        computed += n_owned
        pending = upcoming
    for back in backs:
        comm.wait(back.work, phases)
        off = 0
        for o in range(p):  # from owner 0 this rank's rows of its matrices, then owner 1, ...
            for it in back.bucket:
                if owners[it] != o:
                    continue
                m, n = it.shape
                rows = comm.rows(m)[me][1]
                out.of(it.key, out_dtype)[it.j] = back.recv[off:off + rows * n].view(rows, n)
                off += rows * n
    return dict(out), computed
