#!/usr/bin/env python
"""The GPU check's results: one JSON line per stage in <results>/results.jsonl (gpu_check.py writes it as the stage
finishes), the line of a stage that died or was killed without one, and the markdown table of them all. No torch.

    python -m benchmarks.gpu_check_table --results DIR --ensure STAGE --rc N --timeout S   # after each stage
    python -m benchmarks.gpu_check_table --results DIR --render --out docs/gpu_check.md [--title TEXT]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

RESULTS = "results.jsonl"
PREDICTIONS = "predictions.jsonl"  # the background job's cost-model predictions (gpu_check_stages.predict_in_background)
GIB = 1024**3


def json_lines(path: str) -> list[dict]:
    """The JSON objects of a file written by append_row, in order; a torn line (the writer killed mid-write) is
    skipped, not fatal; no file: none."""
    if not os.path.exists(path):
        return []
    out = []
    with open(path) as f:
        for line in f:
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict):
                out.append(row)
    return out


def read_results(results_dir: str) -> dict[str, dict]:
    """Stage -> its last line."""
    return {row["stage"]: row for row in json_lines(os.path.join(results_dir, RESULTS)) if "stage" in row}


def append_row(results_dir: str, row: dict, name: str = RESULTS) -> None:
    """One JSON line appended and flushed to disk at once (a later crash loses nothing written before it), on a
    line of its own even after a torn line (a stage killed while writing)."""
    path = os.path.join(results_dir, name)
    with open(path, "a+b") as f:
        f.seek(0, os.SEEK_END)
        torn = f.tell() > 0 and (f.seek(-1, os.SEEK_END), f.read(1))[1] != b"\n"
        f.write((b"\n" if torn else b"") + json.dumps(row).encode() + b"\n")
        f.flush()
        os.fsync(f.fileno())


def partial_name(stage: str) -> str:
    """The file of the checks a stage has finished so far (gpu_check.Context.record)."""
    return f"{stage}.checks.jsonl"


def append_partial(results_dir: str, stage: str, check: dict) -> None:
    append_row(results_dir, check, partial_name(stage))


def read_partial(results_dir: str, stage: str) -> list[dict]:
    """The checks a stage recorded before it ended (a torn last line skipped)."""
    return [c for c in json_lines(os.path.join(results_dir, partial_name(stage)))
            if {"what", "measured", "expected", "ok"} <= set(c)]


def passed(row: dict) -> bool:
    """A stage passes when it ran to the end (no error) and none of its checks failed."""
    return not row.get("error") and bool(row.get("checks")) and all(c["ok"] is not False for c in row["checks"])


# ---- the memory estimate of a stage (gpu_check.sh runs them in the background) ----------------------------------
# peak / estimate outside [1 / TOLERANCE, TOLERANCE] fails: the estimate decides what fits a GPU (docs/scaling_out.md)
ESTIMATE_TOLERANCE = 1.25


def estimate_of(results_dir: str, stage: str) -> tuple[float | None, str, bool]:
    """(peak GiB, why not, finished) of the estimate gpu_check.sh started for `stage`: estimate_<stage>.rc appears
    when its process ended, estimate_<stage>.json holds its one JSON line."""
    base = os.path.join(results_dir, f"estimate_{stage}")
    if not os.path.exists(base + ".rc"):
        return None, "still running", False
    with open(base + ".rc") as f:
        rc = f.read().strip()
    if rc != "0":
        return None, f"the estimate exited with status {rc}: {log_tail(base + '.log', 1) or 'no output'}", True
    try:
        with open(base + ".json") as f:
            peak = json.loads(f.read().strip().splitlines()[-1])["peak"]["total"]
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        return None, f"{base}.json is not the estimate's JSON line", True
    return peak / GIB, "", True


def memory_check(results_dir: str, stage: str, memory: dict) -> dict:
    """The stage's peak against the estimate of its configuration; `memory` holds allocated_gib, reserved_gib and
    device_gib, and upper_only for a compiled run (empty on CPU: only whether the estimate ran). Pending while the
    estimate runs: settle() redoes it."""
    what = "max_memory_allocated / estimate" if memory else "memory estimate of this configuration"
    # a compiled run's peak is held to the eager estimate from above only (inductor may need less than eager)
    lo, hi = (0.0 if memory.get("upper_only") else 1 / ESTIMATE_TOLERANCE), ESTIMATE_TOLERANCE
    expected = (f"<= {hi:.2f} (compiled)" if not lo else f"{lo:.2f} .. {hi:.2f}") if memory else \
        "it ran (no device peak on CPU)"
    reserved = (f"; reserved {memory['reserved_gib']:.1f} of {memory['device_gib']:.0f} GiB" if memory else "")
    est, why, done = estimate_of(results_dir, stage)
    if not done:
        measured = f"{memory['allocated_gib']:.1f} GiB / estimate still running" if memory else "still running"
        return {"what": what, "measured": measured + reserved, "expected": expected, "ok": None, "pending": True}
    if est is None:
        return {"what": what, "measured": why, "expected": expected, "ok": False}
    if not memory:
        return {"what": what, "measured": f"{est:.4f} GiB", "expected": expected, "ok": True}
    ratio = memory["allocated_gib"] / est
    return {"what": what, "measured": f"{memory['allocated_gib']:.1f} / {est:.1f} GiB = {ratio:.2f}{reserved}",
            "expected": expected, "ok": lo <= ratio <= hi}


def settle(results_dir: str, row: dict) -> dict:
    """The row with its pending memory checks redone now (their estimates may have finished since)."""
    if any(c.get("pending") for c in row.get("checks", [])):
        memory = (row.get("values") or {}).get("memory") or {}
        row["checks"] = [memory_check(results_dir, row["stage"], memory) if c.get("pending") else c
                         for c in row["checks"]]
        row["ok"] = passed(row)
    return row


def log_tail(path: str, n: int = 3) -> str:
    if not os.path.exists(path):
        return ""
    with open(path, errors="replace") as f:
        lines = [line.rstrip() for line in f if line.strip()]
    return " / ".join(lines[-n:])[-400:]


def short_path(path: str) -> str:
    """A frame's file as the table shows it: inside this checkout relative to it, an installed package's from its
    package folder (torch/_inductor/..., not /opt/.../site-packages/torch/...)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if path.startswith(root + os.sep):
        return os.path.relpath(path, root)
    marker = f"{os.sep}site-packages{os.sep}"
    return path.split(marker, 1)[1] if marker in path else path


def stage_stack(lines: list[str]) -> list[tuple[str, str, str]]:
    """The last Python stack faulthandler wrote into a stage's log (gpu_check.run_stage's watchdog, just before the
    timeout): the frames (file, line, function), innermost first, of the thread that ran the stage (the one whose
    frames pass through gpu_check.py); [] where the log holds none."""
    starts = [i for i, line in enumerate(lines) if line.startswith("Timeout (")]
    if not starts:
        return []
    threads, frames = [], None
    for line in lines[starts[-1] + 1:]:
        if line.startswith(("Thread 0x", "Current thread 0x")):
            frames = []
            threads.append(frames)
        elif frames is not None and line.startswith('  File "'):
            path, _, rest = line[len('  File "'):].partition('", line ')
            number, _, function = rest.partition(" in ")
            frames.append((path, number.strip(), function.strip()))
        elif frames is not None and line.strip():
            frames = None  # the dump ended
    ours = [t for t in threads if any(os.path.basename(f[0]) == "gpu_check.py" for f in t)]
    return ours[0] if ours else (threads[0] if threads else [])


def where_killed(path: str) -> str:
    """Where a stage killed by its timeout was: its last phase line (gpu_check.Context.phase) and, from the stack
    dumped just before the kill, the innermost frame of this repository's code outside the check and the innermost
    frame of all (torch's compiler, a collective, a copy)."""
    from benchmarks.gpu_check import PHASE_MARK

    if not os.path.exists(path):
        return ""
    with open(path, errors="replace") as f:
        lines = [line.rstrip("\n") for line in f]
    phases = [line for line in lines if line.startswith(PHASE_MARK)]
    parts = []
    if phases:
        parts.append(f"in its phase {phases[-1][len('[gpu_check '):]}")
    frames = stage_stack(lines)
    shown = lambda f: f"{short_path(f[0])}:{f[1]} ({f[2]})"  # noqa: E731
    ours = [f for f in frames if short_path(f[0]).startswith(("dit_train" + os.sep, "benchmarks" + os.sep))
            and not short_path(f[0]).startswith(os.path.join("benchmarks", "gpu_check"))]
    if ours:
        parts.append(f"at {shown(ours[0])}")
    if frames and (not ours or frames[0] != ours[0]):
        parts.append(f"innermost {shown(frames[0])}")
    return "; ".join(parts)


def ensure(results_dir: str, stage: str, rc: int, timeout_s: float, log: str | None) -> dict:
    """The stage's line; written here when the stage wrote none (killed by `timeout`: status 124 or 137; or died),
    with the checks it had finished (Context.record)."""
    row = read_results(results_dir).get(stage)
    if row is None:
        if rc in (124, 137):
            why = f"killed by its {timeout_s:g} s timeout (a hang, or fixed costs over the budget)"
        else:
            why = f"exited with status {rc} without writing its result"
        where = where_killed(log) if log and rc in (124, 137) else ""
        tail = "" if where else (log_tail(log) if log else "")
        row = {"stage": stage, "ok": False, "checks": read_partial(results_dir, stage), "values": {},
               "seconds": timeout_s if rc in (124, 137)
               else None, "error": why + (f"; {where}" if where else f"; its log ends: {tail}" if tail else "")}
        append_row(results_dir, row)
    return row


def one_line(row: dict) -> str:
    """The console line of a finished stage."""
    s = f"{row['seconds']:.0f} s" if row.get("seconds") is not None else "? s"
    head = f"{row['stage']}: {'PASS' if row.get('ok') else 'FAIL'} ({s})"
    parts = [f"{c['what']}: {c['measured']} [{c['expected']}]{'' if c['ok'] is not False else ' FAIL'}"
             for c in row.get("checks", [])]
    if row.get("error"):
        parts.append(row["error"])
    return head + "".join(f"\n    {p}" for p in parts + [f"note: {n}" for n in row.get("notes", [])])


def cell(text) -> str:
    return str(text).replace("|", "/").replace("\n", " ")


def markdown(rows: list[dict], title: list[str], planned: list[str]) -> str:
    by_stage = {r["stage"]: r for r in rows}
    lines = [*title, "", "| stage | result | s | what failed / notes |", "| --- | --- | ---: | --- |"]
    for name in planned:
        r = by_stage.get(name)
        if r is None:
            lines.append(f"| {name} | not run | | |")
            continue
        failed = [c["what"] for c in r.get("checks", []) if c["ok"] is False]
        why = "; ".join([*failed, *([r["error"]] if r.get("error") else []), *r.get("notes", [])])
        s = "" if r.get("seconds") is None else f"{r['seconds']:.0f}"
        lines.append(f"| {name} | {'PASS' if r.get('ok') else '**FAIL**'} | {s} | {cell(why)} |")
    lines += ["", "| stage | check | measured | threshold / prediction | |", "| --- | --- | --- | --- | --- |"]
    for name in planned:
        for c in (by_stage.get(name) or {}).get("checks", []):
            verdict = {True: "ok", False: "**FAIL**", None: ""}[c["ok"]]
            lines.append(f"| {name} | {cell(c['what'])} | {cell(c['measured'])} | {cell(c['expected'])} | {verdict} |")
    passed = sum(bool((by_stage.get(n) or {}).get("ok")) for n in planned)
    lines += ["", f"{passed} of {len(planned)} stages passed."]
    return "\n".join(lines) + "\n"


BEGIN, END = "<!-- gpu_check results: written by benchmarks/gpu_check.sh -->", "<!-- end of gpu_check results -->"


def write_table(path: str, table: str) -> None:
    """The table into `path`: between the BEGIN and END markers when the file has them (docs/gpu_check.md: the
    text around the table stays), else as the whole file. Written to a temporary file, then renamed."""
    text = f"{BEGIN}\n{table}{END}\n"
    if os.path.exists(path):
        with open(path) as f:
            old = f.read()
        if BEGIN in old and END in old.split(BEGIN, 1)[1]:
            head, rest = old.split(BEGIN, 1)
            text = head + text + rest.split(END, 1)[1].lstrip("\n")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def title_lines(rows: dict, command: str) -> list[str]:
    env = (rows.get("env") or {}).get("values") or {}
    device = env.get("device", "device unknown (the env stage wrote nothing)")
    versions = ", ".join(f"{k} {env[k]}" for k in ("torch", "cuda", "cudnn", "python") if env.get(k))
    memory = f" ({env['memory_gib']} GiB)" if env.get("memory_gib") else ""
    return [f"### `{command}`", "", f"{device}{memory}; {versions or 'versions unknown'}."]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", required=True)
    ap.add_argument("--ensure", default=None, help="a stage that has just ended")
    ap.add_argument("--rc", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=0)
    ap.add_argument("--log", default=None)
    ap.add_argument("--render", action="store_true")
    ap.add_argument("--planned", default="", help="comma-separated stages, in order")
    ap.add_argument("--command", default="bash benchmarks/gpu_check.sh")
    ap.add_argument("--date", default="")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.ensure:
        row = settle(args.results, ensure(args.results, args.ensure, args.rc, args.timeout, args.log))
        print(one_line(row), flush=True)
        return 0
    rows = {k: settle(args.results, r) for k, r in read_results(args.results).items()}
    planned = [n for n in args.planned.split(",") if n] or list(rows)
    title = title_lines(rows, args.command)
    if args.date:
        title[-1] = f"{args.date}; {title[-1]}"
    text = markdown(list(rows.values()), title, planned)
    if args.out:
        write_table(args.out, text)
    print(text, flush=True)
    return 0 if all((rows.get(n) or {}).get("ok") for n in planned) else 1


if __name__ == "__main__":
    sys.exit(main())
