"""Per-phase wall time of a training step and counted communication bytes.

On CUDA, phases are bracketed by CUDA events and resolved once per step (one synchronisation at the end);
on CPU, by perf_counter (work is synchronous there). Phases may nest (optimizer > momentum/comm/direction/update);
each name accumulates its own total. Disabled timers cost one attribute check."""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager

import torch


class PhaseTimer:
    def __init__(self, enabled: bool = True, device: torch.device | None = None):
        self.enabled = enabled
        self.cuda = enabled and device is not None and torch.device(device).type == "cuda"
        self._cpu: dict[str, float] = defaultdict(float)
        self._events: list[tuple[str, object, object]] = []
        self.bytes: dict[str, int] = defaultdict(int)

    @contextmanager
    def phase(self, name: str):
        if not self.enabled:
            yield
            return
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                yield
            finally:
                end.record()
                self._events.append((name, start, end))
        else:
            t0 = time.perf_counter()
            try:
                yield
            finally:
                self._cpu[name] += time.perf_counter() - t0

    def add_bytes(self, collective: str, nbytes: int) -> None:
        """Logical bytes this rank sent in an optimizer collective (counted from the tensors passed to it)."""
        if self.enabled:
            self.bytes[collective] += int(nbytes)

    def collect(self) -> dict[str, float]:
        """Seconds per phase and bytes per collective since the last collect(); resets the counters."""
        if not self.enabled:
            return {}
        out = {f"time/{k}": v for k, v in self._cpu.items()}
        if self._events:
            torch.cuda.synchronize()
            for name, start, end in self._events:
                out[f"time/{name}"] = out.get(f"time/{name}", 0.0) + start.elapsed_time(end) / 1000.0
        if self.bytes:
            out.update({f"comm_bytes/{k}": float(v) for k, v in self.bytes.items()})
            out["comm_bytes/total"] = float(sum(self.bytes.values()))
        self._cpu.clear()
        self._events.clear()
        self.bytes.clear()
        return out


_active: PhaseTimer | None = None


def set_active_timer(timer: PhaseTimer | None) -> None:
    """The optimizer times its inner phases through the active timer, so it needs no reference to the loop."""
    global _active
    _active = timer


def active_timer() -> PhaseTimer:
    return _active if _active is not None else _DISABLED


_DISABLED = PhaseTimer(enabled=False)
