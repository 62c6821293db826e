"""Per-phase wall time of a training step and counted communication bytes, measured without stalling the GPU.

A clock marks points of the work: on CUDA a recorded CUDA event (recording does not wait; the GPU timestamps it
when it gets there), on CPU perf_counter (CPU work is done when the call returns, so a synchronisation would mean
nothing). Marks are turned into seconds only after `clock.wait()`, which the training loop calls once per log
window (dit_train/trainer/deferred_steps.py), not once per step. The same code runs on both devices.

Phases may nest (optimizer > momentum/comm/direction/update); each name accumulates its own total. Disabled timers
cost one attribute check."""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager

import torch


class HostClock:
    """perf_counter marks; nothing to wait for."""

    @staticmethod
    def mark() -> float:
        return time.perf_counter()

    @staticmethod
    def seconds(start: float, end: float) -> float:
        return end - start

    @staticmethod
    def wait() -> None:
        pass


class CudaClock:
    """CUDA events recorded on the current stream; their times are readable after wait()."""

    @staticmethod
    def mark():
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    @staticmethod
    def seconds(start, end) -> float:
        return start.elapsed_time(end) / 1000.0

    @staticmethod
    def wait() -> None:
        torch.cuda.synchronize()


def clock_for(device: torch.device | str | None) -> HostClock | CudaClock:
    return CudaClock() if device is not None and torch.device(device).type == "cuda" else HostClock()


class StepTimes:
    """One step's phase marks and byte counts, unread: `read()` after the clock's wait()."""

    def __init__(self, clock, spans: list, nbytes: dict[str, int]):
        self.clock, self.spans, self.bytes = clock, spans, nbytes

    def read(self) -> dict[str, float]:
        """Seconds per phase (time/<name>) and bytes per collective (comm_bytes/<name>, comm_bytes/total)."""
        out: dict[str, float] = {}
        for name, start, end in self.spans:
            key = f"time/{name}"
            out[key] = out.get(key, 0.0) + self.clock.seconds(start, end)
        if self.bytes:
            out.update({f"comm_bytes/{k}": float(v) for k, v in self.bytes.items()})
            out["comm_bytes/total"] = float(sum(self.bytes.values()))
        return out


class PhaseTimer:
    def __init__(self, enabled: bool = True, device: torch.device | str | None = None):
        self.enabled = enabled
        self.clock = clock_for(device)
        self._spans: list = []  # (name, start mark, end mark), in the order the phases ended
        self.bytes: dict[str, int] = defaultdict(int)

    @contextmanager
    def phase(self, name: str):
        if not self.enabled:
            yield
            return
        start = self.clock.mark()
        try:
            yield
        finally:
            self._spans.append((name, start, self.clock.mark()))

    def add_bytes(self, collective: str, nbytes: int) -> None:
        """Logical bytes this rank sent in an optimizer collective (counted from the tensors passed to it)."""
        if self.enabled:
            self.bytes[collective] += int(nbytes)

    def take(self) -> StepTimes:
        """Everything timed since the last take(), unread (no synchronisation); the counters start again."""
        times = StepTimes(self.clock, self._spans, dict(self.bytes))
        self._spans = []
        self.bytes.clear()
        return times

    def collect(self) -> dict[str, float]:
        """take(), waited for and read now: for benchmarks and tests that read one step at a time."""
        times = self.take()
        if times.spans:
            self.clock.wait()
        return times.read()
