"""The time of one counted sharded optimizer step (docs/cost_model.md): the counted ranks' ops, collective issues
and waits (benchmarks/sharded_count.py) replayed in the order the optimizer runs them, so that what overlaps in the
code overlaps here and what waits, waits. Priced on W processes of this host (`scheduled`: ops at a whole core's
rates, the cores shared among the ranks computing where the processes outnumber them, collectives at gloo's latency
and bandwidth) or on GPUs (cost_model.sharded.sharded_optimizer, through
`replayed`: ops at the GPU profile's rates on the compute stream, collectives on a communication stream at NVLink
or InfiniBand).

The schedule (the semantics of model_owner_schedule's simulator, on counted programs):
- a rank runs its ops one after the other (each at its priced seconds: op_cost's rates plus, where the profile has
  it, the Python the sharded step spends per op of its phase, sharded_python.py);
- a collective starts once every rank has issued it and the previous collective has finished (one at a time, in
  issue order, as ShardComm issues them on one process group: on a GPU, NCCL's one communication stream), and
  lasts its duration (gloo: its latency + the busiest rank's bytes on the wire); while it runs, the ranks go on
  with the ops issued after it (async_op: owner mode's inbound all-to-alls in flight during NS5, gather mode's
  next bucket, RowNorm's column sums);
- a wait blocks its rank until that collective has finished (a blocking all_reduce_ waits right after its issue).
A step starts on every rank at once (bench_distributed's barrier) and lasts until its slowest rank is done, which is
what bench_distributed reports (its phases are each the slowest rank's too).

On this host a collective is not a free stream (`scheduled`'s `cpu`): gloo moves the bytes with its own
threads (a worker thread per process group, the TCP device loop), on the same cores as the ranks' compute, and
bench_distributed gives each rank cores // W torch threads, so no core is spare. An asynchronous collective's CPU
(per call + per byte on the wire, where the profile has measured it) is therefore charged to the rank's compute
between its issue and its wait, at most that compute (placed just before the wait): owner mode's IN_FLIGHT
all-to-alls run during the owner's NS5 and take their CPU from it. A collective waited at once overlaps nothing
(its CPU is in its duration). GPUs (cost_model.sharded.gpu_replayed) are not charged: NCCL runs on the device.

More processes than cores (`slots`: W processes of T threads on C cores, W x T > C, e.g. bench_distributed's 4
single-thread processes on this 2-core host): the ops are priced at a whole core's rates (T threads) and the cores
are shared in the replay, evenly among the ranks that have an op to run at that moment: while n of them compute
at once each runs at min(1, (C / T) / n) of its speed, so C / (W T) of a core when all compute at once, and a rank
blocked in a wait takes no CPU and leaves its share to the others. What overlaps with gloo's threads: an
asynchronous collective's CPU is charged to its rank's compute (above), so it takes its share of the cores with
the ranks' own compute; while every rank waits, the cores are free and the collective runs at its measured
latency between busy processes + wire. Not modelled: the scheduler's time slices (a rank runs whole slices,
so a core-mate's turn shows as wait), its run queues and wake-up latencies (a rank woken by a collective's end
waits for a core while the others compute).
"""

from __future__ import annotations

from types import SimpleNamespace

from benchmarks.op_cost import OpRates, seconds
from benchmarks.sharded_count import wire_bytes, wire_seconds

DIRECTION_PHASES = ("direction", "comm")  # the direction stage: its ops and the waits inside it


def simulate(programs: list[list[tuple]], durations: list[float], slots: float | None = None) -> list[dict]:
    """programs[r]: rank r's events in order, ("op", seconds, phase), ("issue", c) or ("wait", c), every rank
    issuing the same collectives in the same order; durations[c]: seconds of collective c. slots: how many ranks'
    ops run at full speed at once when they share cores (this host's cores over each process's threads), None when
    every rank has its own (a GPU each, or no more threads than cores): while n ranks have an op to run and n >
    slots, each runs at slots / n of its speed (the cores shared evenly by the threads that have work; a rank
    blocked in a wait takes none, so the others speed up). An op's seconds are at full speed. Returns per rank
    {"end": when it is done, "waited": seconds blocked in waits, "phases": {phase: seconds its ops took}}."""
    w, n = len(programs), len(durations)
    issued = [[None] * n for _ in range(w)]
    end: list[float | None] = [None] * n
    pos, left, began = [0] * w, [None] * w, [0.0] * w  # next event; full-speed seconds left of its op, its start
    blocked: list[float | None] = [None] * w
    done_at: list[float | None] = [None] * w
    waited = [0.0] * w
    phases: list[dict] = [{} for _ in range(w)]
    now, comm_free, next_coll = 0.0, 0.0, 0
    while True:
        for r, prog in enumerate(programs):  # each rank to its next op, or to a wait not yet over
            while left[r] is None and pos[r] < len(prog):
                ev = prog[pos[r]]
                if ev[0] == "op":
                    left[r], began[r] = ev[1], now
                    break
                if ev[0] == "issue":
                    issued[r][ev[1]] = now
                elif end[ev[1]] is None or end[ev[1]] > now:  # blocked until the collective ends
                    if blocked[r] is None:
                        blocked[r] = now
                    break
                elif blocked[r] is not None:
                    waited[r] += now - blocked[r]
                    blocked[r] = None
                pos[r] += 1
            if done_at[r] is None and pos[r] == len(prog):
                done_at[r] = now
        timed = next_coll
        while next_coll < n and all(issued[r][next_coll] is not None for r in range(w)):
            start = max([comm_free] + [issued[r][next_coll] for r in range(w)])
            end[next_coll] = comm_free = start + durations[next_coll]
            next_coll += 1
        running = [r for r in range(w) if left[r] is not None]
        speed = 1.0 if slots is None or len(running) <= slots else slots / len(running)
        finish = {r: now + left[r] / speed for r in running}
        ends = [end[programs[r][pos[r]][1]] for r in range(w) if blocked[r] is not None]  # what blocked ranks await
        ahead = list(finish.values()) + [t for t in ends if t is not None and t > now]
        if not ahead:
            if next_coll > timed:  # a collective just timed may end now (no duration): its waits pass
                continue
            break
        t = min(ahead)
        for r in running:
            if finish[r] <= t:
                phase = programs[r][pos[r]][2]
                phases[r][phase] = phases[r].get(phase, 0.0) + t - began[r]
                left[r] = None
                pos[r] += 1
            else:
                left[r] -= (t - now) * speed
        now = t
    if any(p < len(prog) for p, prog in zip(pos, programs)):
        raise RuntimeError("the ranks' programs deadlock: they do not issue the same collectives in one order")
    return [{"end": done_at[r], "waited": waited[r], "phases": phases[r]} for r in range(w)]


def program(step: SimpleNamespace, rates: OpRates, python: dict | None,
            collective_cpu: list[float] | None = None) -> list[tuple]:
    """A counted step's events with each op priced: op_cost's seconds + the Python per op of its phase class
    (python {"direction": s, "other": s}, or None where the profile has not measured it); with collective_cpu
    (seconds of CPU of each collective on this rank), each collective's CPU charged before its wait
    (charged_collective_cpu)."""
    out = []
    for ev in step.events:
        if ev[0] != "op":
            out.append(ev)
            continue
        rec = ev[1]
        cls = "direction" if rec.phase in DIRECTION_PHASES else "other"
        out.append(("op", seconds(rec, rates) + (python[cls] if python else 0.0), cls))
    return out if collective_cpu is None else charged_collective_cpu(out, step.collectives, collective_cpu)


def charged_collective_cpu(prog: list[tuple], collectives: list, cpu: list[float]) -> list[tuple]:
    """A priced program with the CPU of each asynchronous collective c (cpu[c] seconds) taken from the compute it
    overlaps: an op of min(cpu[c], the op seconds between its issue and its wait) just before its wait, in the
    class of the collective's phase (module docstring). The charged ops are marked ("op", s, cls, "collective")."""
    running, window = {}, {}  # collective -> op seconds since its issue; -> op seconds from issue to wait
    for ev in prog:
        if ev[0] == "issue":
            running[ev[1]] = 0.0
        elif ev[0] == "wait":
            window[ev[1]] = running.pop(ev[1])
        else:
            for c in running:
                running[c] += ev[1]
    out = []
    for ev in prog:
        if ev[0] == "wait":
            charge = min(cpu[ev[1]], window[ev[1]])
            if charge > 0:
                cls = "direction" if collectives[ev[1]].phase in DIRECTION_PHASES else "other"
                out.append(("op", charge, cls, "collective"))
        out.append(ev)
    return out


def collectives_of(ranks: list[SimpleNamespace]) -> int:
    """How many collectives each rank's counted step issues (the same number on every rank, or the ranks' programs
    cannot be replayed together)."""
    counts = {len(r.collectives) for r in ranks}
    if len(counts) != 1:
        raise RuntimeError(f"the ranks issue different numbers of collectives: {sorted(counts)}")
    return counts.pop()


def replayed(ranks: list[SimpleNamespace], rates: OpRates, durations: list[float],
             python: dict | None = None, collective_cpu: list[list[float]] | None = None,
             slots: float | None = None) -> dict:
    """One step counted on some ranks (ranks[i]: a SimpleNamespace of sharded_count) replayed together (simulate),
    each op at `rates` (+ the Python per op of its class), collective c lasting durations[c] (and, with
    collective_cpu[i][c], its CPU on rank i charged to the compute it overlaps; with slots, the ranks sharing that
    many cores' worth of threads: simulate): the slowest rank's end
    (`total_s`, the step), the most any rank blocked in waits (`exposed_s`), the most direction and other op time,
    the most collective CPU charged to a rank (`collective_cpu_s`), and per rank its end and its time blocked
    (`ends`, `waited`, in the order of `ranks`). The pricing is the caller's: this host's gloo (scheduled) or a
    GPU's links (cost_model.sharded.sharded_optimizer)."""
    if collectives_of(ranks) != len(durations):
        raise ValueError(f"{len(durations)} durations for {collectives_of(ranks)} collectives")
    cpu = collective_cpu or [None] * len(ranks)
    programs = [program(r, rates, python, c) for r, c in zip(ranks, cpu, strict=True)]
    done = simulate(programs, durations, slots)
    return {"total_s": max(d["end"] for d in done), "exposed_s": max(d["waited"] for d in done),
            "direction_s": max(d["phases"].get("direction", 0.0) for d in done),
            "other_s": max(d["phases"].get("other", 0.0) for d in done),
            "ops_s": max(sum(d["phases"].values()) for d in done),
            "collective_cpu_s": max(sum(ev[1] for ev in prog if len(ev) == 4) for prog in programs),
            "ends": [d["end"] for d in done], "waited": [d["waited"] for d in done]}


def scheduled(ranks: list[SimpleNamespace], rates: OpRates, world: int, link_bytes_s: float, latency_s: float,
              python: dict | None = None, cpu: tuple[float, float] | None = None, slots: float | None = None) -> dict:
    """One step counted on every rank (ranks[r]: rank r's SimpleNamespace of sharded_count) on W processes of this
    host (replayed): each collective its gloo latency + the busiest rank's bytes on the wire; with cpu =
    (seconds per call, seconds per byte on the wire) of gloo's threads on a process's share of the cores, each
    collective's CPU on each rank charged to the compute it overlaps (module docstring); slots: simulate's (the
    processes outnumber the cores' threads: the rates and the CPU are a whole core's); with the collectives'
    latency and wire seconds (each once, as they run one at a time), the Python priced, and the counts of rank 0."""
    n = collectives_of(ranks)
    wire = [max(wire_seconds(r.collectives[c], world, link_bytes_s, 0.0) for r in ranks) for c in range(n)]
    charged = None if cpu is None else [[cpu[0] + cpu[1] * wire_bytes(c, world) for c in r.collectives]
                                        for r in ranks]
    out = replayed(ranks, rates, [latency_s + x for x in wire], python, charged, slots)
    del out["ends"], out["waited"]
    return {"ops": len(ranks[0].records), "collectives": n, **out, "python_s": python_seconds(ranks, python),
            "latency_s": n * latency_s, "wire_s": sum(wire), "sent": sum(c.sent for c in ranks[0].collectives)}


def python_seconds(ranks: list[SimpleNamespace], python: dict | None) -> float:
    """The most Python any rank's step is priced with."""
    if not python:
        return 0.0
    return max(sum(python["direction" if rec.phase in DIRECTION_PHASES else "other"] for rec in r.records)
               for r in ranks)


def mean_scheduled(cycle: list[list[SimpleNamespace]], rates: OpRates, world: int, link_bytes_s: float,
                   latency_s: float, python: list[dict | None] | None = None,
                   cpu: tuple[float, float] | None = None, slots: float | None = None) -> dict:
    """scheduled() averaged over the counted steps of a cycle (cycle[k][r]: step k on rank r; python[k]: the
    Python rates of step k's kind; cpu: the collectives' CPU rates; slots: simulate's), bench_distributed's
    per-step average of the slowest rank."""
    python = python or [None] * len(cycle)
    each = [scheduled(ranks, rates, world, link_bytes_s, latency_s, py, cpu, slots)
            for ranks, py in zip(cycle, python, strict=True)]
    return {k: sum(e[k] for e in each) / len(each) for k in each[0]}
