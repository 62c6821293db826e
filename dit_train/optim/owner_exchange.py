"""Owner mode for the whole-matrix directions (docs/algorithms.md §6): every matrix is orthogonalised once, by one
owner rank, W matrices per all-to-all each way, several exchanges in flight.

Input and output as in whole_matrix_exchange.py: `inputs` {key: U}, U the stacked local rows [B, rows_here, n] of
the B same-shape matrices of a group (key[0] = (m, n)); `compute(key, X)` maps [L, m, n] whole matrices to their
direction; the result is {key: D} with D [B, rows_here, n], this rank's rows of every direction.

Schedule (after microsoft/dion's "megabatch": a shape group's matrices taken W at a time):
- exchanges (`plan_exchanges`): each group in slices of PER_RANK x W matrices, each rank owning PER_RANK of a
  full slice; a shorter last slice of c gives c // W to every rank and the c % W extra ones to the ranks least
  loaded so far by NS5 flops, so the busiest rank's work stays within one matrix of 1/W of the total even when
  no group size is a multiple of W. A rank owns a contiguous range of the slice, in rank order: this rank's rows
  of the slice (U[start:start + size]) are the outbound buffer as they lie, and the returned rows land in D.
- per exchange: one all-to-all brings every rank's rows of each owned matrix to its owner ([count, m, n]
  assembled), the owner computes its share as one batched direction, and one all-to-all returns every rank's
  rows.
- pipelining: the first IN_FLIGHT exchanges' inbound all-to-alls are issued at once; when exchange i is computed
  its return is issued, then the inbound all-to-all of exchange i + IN_FLIGHT. Collectives run in issue order on
  a GPU's communication stream, and each waits for the compute issued before it, so the inbound exchanges issued
  ahead are what is in flight while exchange i is computed. Returns are waited for at the end.
- started in backward (`launched`, backward_overlap.py): inbound all-to-alls already issued during backward are
  used as they are; the step issues only the others, at the same points of the same schedule.
The bucket policy follows from W and the shapes; PER_RANK and IN_FLIGHT were chosen with
benchmarks/model_owner_schedule.py (docs/bench_distributed.md): one matrix per rank keeps each exchange's buffers to
one matrix per rank (whole-group exchanges hold up to 7 matrices of up to 192 MiB each at W = 8, 15B, and are
modelled 0-8% slower), and 4 in flight is within 3% of 8 at every preset and W (3: up to 9% slower).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from dit_train.optim.collectives import PhaseSwitch, ShardComm
from dit_train.optim.directions import ns5_flops

Compute = Callable[[tuple, Tensor], Tensor]
IN_FLIGHT = 4  # inbound exchanges issued ahead of the one being computed
PER_RANK = 1  # matrices per rank in one exchange (0: a whole shape group per exchange)


@dataclass(frozen=True)
class Exchange:
    """One all-to-all each way: matrices [start, start + sum(counts)) of the group `key`, rank r owning
    counts[r] of them, a contiguous range in rank order (`owned`)."""

    key: tuple
    start: int
    counts: tuple[int, ...]

    @property
    def size(self) -> int:
        return sum(self.counts)

    def owned(self, rank: int) -> tuple[int, int]:
        """(first, count) of the matrices `rank` owns, as indices into the group's batch."""
        return self.start + sum(self.counts[:rank]), self.counts[rank]


def plan_exchanges(groups: dict[tuple, tuple[tuple[int, int], int]], world: int,
                   per_rank: int = PER_RANK) -> list[Exchange]:
    """The exchanges of groups {key: ((m, n), B)} in group order: each group in slices of per_rank x world
    matrices (0: the whole group in one), each rank owning per_rank of a full slice; a shorter slice of c gives
    c // world to every rank and the c % world extra ones to the ranks least loaded so far by NS5 flops (slices
    of the largest matrices placed first, ties to the lower rank)."""
    slices = []
    for key, ((m, n), count) in groups.items():
        step = per_rank * world if per_rank else max(count, 1)
        slices += [(key, (m, n), s, min(step, count - s)) for s in range(0, count, step)]
    load, counts = [0] * world, {}
    for key, shape, start, size in sorted(slices, key=lambda sl: -ns5_flops(*sl[1])):
        q, extra = divmod(size, world)
        plus = set(sorted(range(world), key=lambda r: (load[r], r))[:extra])
        counts[(key, start)] = tuple(q + (r in plus) for r in range(world))
        for r in range(world):
            load[r] += counts[(key, start)][r] * ns5_flops(*shape)
    return [Exchange(key, start, counts[(key, start)]) for key, _, start, _ in slices]


@dataclass
class _Inbound:
    ex: Exchange
    recv: Tensor
    work: object
    send: Tensor  # kept until the all-to-all is waited for


def send_to_owners(ex: Exchange, U: Tensor, comm: ShardComm) -> _Inbound:
    """Start the inbound all-to-all: to rank r this rank's rows of r's matrices. U [ex.size, rows_here, n]: this
    rank's rows of the exchange's matrices, in batch order (sent as they lie)."""
    rows_me, n = U.shape[1], U.shape[2]
    mine = ex.counts[comm.rank]
    in_splits = [c * rows_me * n for c in ex.counts]
    out_splits = [mine * rows * n for _, rows in comm.rows(ex.key[0][0])]
    recv = torch.empty(sum(out_splits), dtype=U.dtype, device=U.device)
    send = U.contiguous().view(-1)
    return _Inbound(ex, recv, comm.all_to_all(recv, send, out_splits, in_splits), send)


def _rank_major(flat: Tensor, whole: Tensor, rows_of: list[tuple[int, int]]) -> list[tuple[Tensor, Tensor]]:
    """Pairs of views (part of `flat`, the same rows of `whole`) of a buffer laid out rank by rank (rank 0's rows
    of each of the `whole` [count, m, n] matrices, [count, rows, n], then rank 1's...): the ranks holding a full
    torch.chunk share of rows as one strided pair, the shorter share after them (if any) as another, so the
    exchange's rows are rearranged by one or two copies, not one per rank (W small copies: host time at W = 32)."""
    count, m, n = whole.shape
    chunk = rows_of[0][1]
    if not count or not chunk:
        return []
    full = sum(rows == chunk for _, rows in rows_of)  # torch.chunk: the full shares come first
    head = full * chunk
    whole_head = whole if head == m else whole[:, :head]
    pairs = [(flat[:count * head * n].view(full, count, chunk, n),
              whole_head.view(count, full, chunk, n).transpose(0, 1))]
    if head < m:
        pairs.append((flat[count * head * n:count * m * n].view(count, m - head, n), whole[:, head:]))
    return pairs


def _assemble(inb: _Inbound, count: int, comm: ShardComm) -> Tensor:
    """The owned whole matrices [count, m, n] from the received rows: from rank 0 its rows of each, then rank 1..."""
    m, n = inb.ex.key[0]
    whole = torch.empty((count, m, n), dtype=inb.recv.dtype, device=inb.recv.device)
    for received, rows in _rank_major(inb.recv, whole, comm.rows(m)):
        rows.copy_(received)
    return whole


def _return_rows(ex: Exchange, D: Tensor, out: Tensor, comm: ShardComm):
    """Start the return all-to-all: to rank r its rows of every owned direction; from the owners, in rank order,
    this rank's rows of the exchange's matrices, straight into their place in `out` [B, rows_here, n]. The rows
    are sent from a copy: D may be a workspace that the next exchange's direction overwrites."""
    m, n = ex.key[0]
    rows_of = comm.rows(m)
    send = D.new_empty(D.numel())
    for part, rows in _rank_major(send, D, rows_of):
        part.copy_(rows)
    in_splits = [D.shape[0] * rows * n for _, rows in rows_of]
    out_splits = [c * rows_of[comm.rank][1] * n for c in ex.counts]
    recv = out[ex.start:ex.start + ex.size].view(-1)
    return send, comm.all_to_all(recv, send, out_splits, in_splits)


def owner_directions(inputs: dict[tuple, Tensor], exchanges: list[Exchange], compute: Compute,
                     out_dtype: torch.dtype, comm: ShardComm, phases: PhaseSwitch,
                     launched: dict[int, _Inbound] | None = None) -> tuple[dict[tuple, Tensor], int]:
    """Owner mode; returns ({key: local rows of D}, number of whole-matrix directions computed here). `launched`:
    {exchange index: its inbound all-to-all, already started from the same U rows}, emptied as they are used (so
    each one's buffers go once assembled); the others start here. Every rank must pass the same indices
    (collectives are matched in issue order)."""
    me = comm.rank
    out = {key: torch.empty(U.shape, dtype=out_dtype, device=U.device) for key, U in inputs.items()}
    launched = {} if launched is None else launched

    def launch(i: int) -> _Inbound:
        ex = exchanges[i]
        early = launched.pop(i, None)
        return early if early is not None else send_to_owners(ex, inputs[ex.key][ex.start:ex.start + ex.size], comm)

    inbound = [launch(i) for i in range(min(IN_FLIGHT, len(exchanges)))]
    returns, computed = [], 0
    for i, ex in enumerate(exchanges):
        count = ex.counts[me]
        comm.wait(inbound[i].work, phases)
        whole = _assemble(inbound[i], count, comm)
        inbound[i] = None  # the received rows go once assembled
        D = compute(ex.key, whole).to(out_dtype) if count else whole.to(out_dtype)
        returns.append(_return_rows(ex, D, out[ex.key], comm))
        computed += count
        if i + IN_FLIGHT < len(exchanges):
            inbound.append(launch(i + IN_FLIGHT))
    for _, work in returns:
        comm.wait(work, phases)
    return out, computed
