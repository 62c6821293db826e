"""The optimizer's collectives on FSDP2 shards (docs/algorithms.md §6–7): who holds which rows, the collectives it issues,
what they cost (bytes counted from the tensors passed, exposed wait timed) and nothing else.

Rows: FSDP2 (and DTensor's Shard(0)) split dim 0 as torch.chunk does: chunks of ceil(m / p) rows, the last ones
shorter or empty when p does not divide m. `shard_rows` gives every rank's (start, rows).

Counting (`timer.add_bytes`, logged as comm_bytes/<collective> per step and rank; the paper's "logical bytes"):
- all_reduce: the bytes of the tensor reduced (what each rank contributes);
- all_gather: (p - 1) x this rank's input, i.e. what it receives from the others (and what a ring makes each rank
  send): (p - 1) / p of the gathered matrices when p divides their rows; padded rows are counted, as they are sent;
- all_to_all: the bytes this rank sends to other ranks (its own segment is a local copy, not counted).
A group of one issues no collective and counts nothing.

Timing: `PhaseSwitch` keeps exactly one of the timer's phases open, so time spent waiting on a collective goes to
`comm` and not to the phase around it (`direction`): comm is the exposed wait only, and comm + direction is the
wall time of the direction stage.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch.distributed as dist
from torch import Tensor


def shard_rows(m: int, world: int) -> list[tuple[int, int]]:
    """(start, rows) of every rank's dim-0 shard of an m-row tensor over `world` ranks (torch.chunk sizes)."""
    chunk = -(-m // world) if m else 0
    out = []
    for r in range(world):
        start = min(r * chunk, m)
        out.append((start, min(chunk, m - start)))
    return out


class PhaseSwitch:
    """One open phase of a PhaseTimer at a time: `to(name)` closes the current phase and opens `name`;
    `waiting()` brackets a wait on a collective as `comm` and returns to the phase that was open."""

    def __init__(self, timer, name: str = "direction"):
        self.timer, self.current, self._cm = timer, None, None
        self.to(name)

    def to(self, name: str | None) -> None:
        if name == self.current:
            return
        if self._cm is not None:
            self._cm.__exit__(None, None, None)
            self._cm = None
        self.current = name
        if name is not None:
            self._cm = self.timer.phase(name)
            self._cm.__enter__()

    def close(self) -> None:
        self.to(None)

    @contextmanager
    def waiting(self):
        previous = self.current
        self.to("comm")
        try:
            yield
        finally:
            self.to(previous)


class _Done:
    """The handle of a collective that needed no communication (a group of one)."""

    def wait(self) -> bool:
        return True


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


class ShardComm:
    """The process group of a 1-D device mesh, with the optimizer's collectives: each counts its bytes on the timer
    and each wait is timed through a PhaseSwitch."""

    def __init__(self, group, timer):
        self.group, self.timer = group, timer
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)

    def rows(self, m: int) -> list[tuple[int, int]]:
        return shard_rows(m, self.world)

    def wait(self, work, phases: PhaseSwitch) -> None:
        with phases.waiting():
            work.wait()

    def all_reduce_(self, t: Tensor, phases: PhaseSwitch) -> Tensor:
        """Sum `t` over the ranks in place (blocking; the whole call is exposed wait) and return it."""
        if self.world == 1:
            return t
        self.timer.add_bytes("all_reduce", _nbytes(t))
        with phases.waiting():
            dist.all_reduce(t, group=self.group)
        return t

    def all_reduce(self, t: Tensor):
        """Start summing `t` over the ranks in place; returns the handle."""
        if self.world == 1:
            return _Done()
        self.timer.add_bytes("all_reduce", _nbytes(t))
        return dist.all_reduce(t, group=self.group, async_op=True)

    def all_gather(self, out: Tensor, inp: Tensor):
        """Start gathering every rank's `inp` (equal sizes) into `out` (rank-major); returns the handle."""
        if self.world == 1:
            out.copy_(inp)
            return _Done()
        self.timer.add_bytes("all_gather", (self.world - 1) * _nbytes(inp))
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return gather(out, inp, group=self.group, async_op=True)

    def all_to_all(self, out: Tensor, inp: Tensor, out_splits: list[int], in_splits: list[int]):
        """Start an all-to-all of 1-D tensors: in_splits[r] elements of `inp` go to rank r, out_splits[r] arrive
        from rank r; returns the handle."""
        if self.world == 1:
            out.copy_(inp)
            return _Done()
        sent = sum(in_splits) - in_splits[self.rank]
        self.timer.add_bytes("all_to_all", sent * inp.element_size())
        return dist.all_to_all_single(out, inp, out_splits, in_splits, group=self.group, async_op=True)
