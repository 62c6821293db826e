"""The GPU check's rows and its markdown table, and the stage runner: each stage under its own time limit, every
failure (an exception, out of memory, a stage over its budget) turned into a FAIL row, so one stage cannot lose the
table of the others."""

from __future__ import annotations

import contextlib
import signal
import sys
import time
import traceback
from dataclasses import dataclass

GIB = 1024**3


@dataclass
class Row:
    stage: str
    ok: bool = False
    step_ms: float | None = None
    tflops: float | None = None  # achieved: model FLOPs per second for training stages, else the kernel's rate
    mfu: float | None = None
    peak_gib: float | None = None  # torch.cuda.max_memory_allocated (None on CPU)
    estimate_gib: float | None = None  # dit_train.memory_estimate's peak for the same configuration
    seconds: float | None = None  # wall time of the whole stage (build, steps, checks)
    detail: str = ""


class StageTimeout(Exception):
    pass


@contextlib.contextmanager
def time_limit(seconds: float):
    """Raise StageTimeout in the main thread after `seconds` (at the next Python bytecode: a long kernel or
    compile finishes first)."""
    def expire(signum, frame):
        raise StageTimeout()

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.001))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:300] if text else ''}".rstrip(": ")


def run_stage(name: str, fn, budget_s: float, deadline: float, cleanup) -> Row:
    """fn() -> Row, limited to min(budget_s, what is left before `deadline` (time.monotonic())); cleanup() runs
    after it whatever happened (frees the device for the next stage)."""
    left = deadline - time.monotonic()
    if left < 1.0:
        return Row(name, detail="not run: the check's total time budget was spent by the stages before it")
    limit = min(budget_s, left)
    t0 = time.monotonic()
    print(f"== {name} (budget {limit:.3g} s)", flush=True)
    try:
        with time_limit(limit):
            row = fn()
    except StageTimeout:
        row = Row(name, detail=f"stopped: over its {limit:.3g} s budget")
    except Exception as e:  # noqa: BLE001 - any failure becomes the stage's FAIL row; the traceback goes to stderr
        traceback.print_exc(file=sys.stderr)
        row = Row(name, detail=first_line(e))
    finally:
        cleanup()
    row.stage, row.seconds = name, time.monotonic() - t0
    print(f"   {'PASS' if row.ok else 'FAIL'} in {row.seconds:.1f} s: {row.detail}", flush=True)
    return row


def markdown(rows: list[Row], header: list[str]) -> str:
    f = lambda v, spec: "" if v is None else format(v, spec)
    lines = [*header, "",
             "| stage | result | step ms | TFLOP/s | MFU | peak GiB | estimate GiB | peak / estimate | s | detail |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        ratio = r.peak_gib / r.estimate_gib if r.peak_gib is not None and r.estimate_gib else None
        lines.append(f"| {r.stage} | {'PASS' if r.ok else '**FAIL**'} | {f(r.step_ms, '.1f')} | {f(r.tflops, '.3g')} | "
                     f"{f(r.mfu, '.1%')} | {f(r.peak_gib, '.3g')} | {f(r.estimate_gib, '.3g')} | {f(ratio, '.2f')} | "
                     f"{f(r.seconds, '.0f')} | {r.detail.replace('|', '/')} |")
    passed = sum(r.ok for r in rows)
    lines += ["", f"{passed} of {len(rows)} stages passed."]
    return "\n".join(lines) + "\n"
