"""Owner mode for the whole-matrix directions (docs/algorithms.md §6): every matrix is orthogonalised once, by one
owner rank, with one all-to-all per shape group each way and several groups in flight.

Input and output as in whole_matrix_exchange.py: `inputs` {key: U}, U the stacked local rows [B, rows_here, n] of
the B same-shape matrices of a group (key[0] = (m, n)); `compute(key, X)` maps [L, m, n] whole matrices to their
direction; the result is {key: D} with D [B, rows_here, n], this rank's rows of every direction.

Schedule (after microsoft/dion's "megabatch"; here the unit is the shape group, the bucket the optimizer already
stacks):
- share: a group of B = q W + s matrices gives q matrices to every rank and one more to s ranks, the s least
  loaded so far by NS5 flops (groups taken largest matrix first, ties to the lower rank), so the busiest rank's
  work stays near 1/W of the total even when B is not a multiple of W. Rank r owns a contiguous range of the
  batch, in rank order: rank r's shards of the group, U, are already the all-to-all's input as they lie.
- per group: one all-to-all brings every rank's rows of each owned matrix to its owner ([count, m, n] assembled),
  the owner computes its share as one batched direction, and one all-to-all returns every rank's rows: received
  in batch order, they are D as they arrive.
- pipelining: the first IN_FLIGHT groups' inbound all-to-alls are issued at once; when group g is done its
  return is issued, then the inbound exchange of group g + IN_FLIGHT. Collectives run in issue order on a GPU's
  communication stream, so a return (which waits for every owner's compute) only queues behind inbound exchanges
  that were issued earlier: those are in flight while group g is computed. Returns are waited for at the end.
  (scripts/model_owner_schedule.py simulates this schedule at 1.3B-15B and W = 8-32.)
The bucket policy follows from W and the shapes: one exchange per shape group, whatever its size in MB.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from .collectives import PhaseSwitch, ShardComm
from .directions import ns5_flops

Compute = Callable[[tuple, Tensor], Tensor]
IN_FLIGHT = 3  # inbound exchanges issued ahead of the group being computed


@dataclass(frozen=True)
class GroupShare:
    """How a group of `counts` summing to B matrices is split: rank r owns batch entries [starts[r], starts[r] +
    counts[r])."""

    counts: tuple[int, ...]

    @property
    def starts(self) -> tuple[int, ...]:
        out, s = [], 0
        for c in self.counts:
            out.append(s)
            s += c
        return tuple(out)


def plan_shares(groups: dict[tuple, tuple[tuple[int, int], int]], world: int) -> dict[tuple, GroupShare]:
    """{key: share} for groups {key: ((m, n), B)}: q = B // world matrices to every rank, the B % world extra ones
    to the least-loaded ranks (NS5 flops; largest matrices assigned first, ties to the lower rank)."""
    load, out = [0] * world, {}
    for key, ((m, n), count) in sorted(groups.items(), key=lambda kv: -ns5_flops(*kv[1][0])):
        q, extra = divmod(count, world)
        plus = set(sorted(range(world), key=lambda r: (load[r], r))[:extra])
        counts = tuple(q + (r in plus) for r in range(world))
        for r in range(world):
            load[r] += counts[r] * ns5_flops(m, n)
        out[key] = GroupShare(counts)
    return out


@dataclass
class _Inbound:
    key: tuple
    recv: Tensor
    work: object


def _send_to_owners(key: tuple, U: Tensor, share: GroupShare, comm: ShardComm) -> _Inbound:
    """Start the group's inbound all-to-all: to rank r this rank's rows of r's matrices (U's rows, as they lie)."""
    me, n = comm.rank, U.shape[-1]
    rows_me = U.shape[1]
    in_splits = [c * rows_me * n for c in share.counts]
    out_splits = [share.counts[me] * rows * n for _, rows in comm.rows(key[0][0])]
    recv = torch.empty(sum(out_splits), dtype=U.dtype, device=U.device)
    return _Inbound(key, recv, comm.all_to_all(recv, U.contiguous().view(-1), out_splits, in_splits))


def _assemble(inb: _Inbound, count: int, comm: ShardComm) -> Tensor:
    """The owned whole matrices [count, m, n] from the received rows: from rank 0 its rows of each, then rank 1..."""
    m, n = inb.key[0]
    whole = torch.empty((count, m, n), dtype=inb.recv.dtype, device=inb.recv.device)
    off = 0
    for start, rows in comm.rows(m):
        whole[:, start:start + rows] = inb.recv[off:off + count * rows * n].view(count, rows, n)
        off += count * rows * n
    return whole


def _return_rows(key: tuple, D: Tensor, share: GroupShare, out: Tensor, comm: ShardComm):
    """Start the group's return all-to-all: to rank r its rows of every owned direction; from the owners, in rank
    order, this rank's rows of the whole batch, straight into `out` [B, rows_here, n]."""
    m, n = key[0]
    rows_of = comm.rows(m)
    parts = [D[:, start:start + rows].reshape(-1) for start, rows in rows_of]
    send = torch.cat(parts) if D.shape[0] else D.new_empty(0)
    in_splits = [p.numel() for p in parts]
    out_splits = [c * rows_of[comm.rank][1] * n for c in share.counts]
    return send, comm.all_to_all(out.view(-1), send, out_splits, in_splits)


def owner_directions(inputs: dict[tuple, Tensor], shares: dict[tuple, GroupShare], compute: Compute,
                     out_dtype: torch.dtype, comm: ShardComm,
                     phases: PhaseSwitch) -> tuple[dict[tuple, Tensor], int]:
    """Owner mode; returns ({key: local rows of D}, number of whole-matrix directions computed here)."""
    keys, me = list(inputs), comm.rank
    out = {key: torch.empty(U.shape, dtype=out_dtype, device=U.device) for key, U in inputs.items()}
    launch = lambda g: _send_to_owners(keys[g], inputs[keys[g]], shares[keys[g]], comm)  # noqa: E731
    inbound = [launch(g) for g in range(min(IN_FLIGHT, len(keys)))]
    returns, computed = [], 0
    for g, key in enumerate(keys):
        count = shares[key].counts[me]
        comm.wait(inbound[g].work, phases)
        whole = _assemble(inbound[g], count, comm)
        inbound[g] = None  # the received rows go once assembled
        if count:
            D = compute(key, whole).to(out_dtype)
        else:
            D = whole.to(out_dtype)
        returns.append(_return_rows(key, D, shares[key], out[key], comm))
        computed += count
        if g + IN_FLIGHT < len(keys):
            inbound.append(launch(g + IN_FLIGHT))
    for _, work in returns:
        comm.wait(work, phases)
    return out, computed
