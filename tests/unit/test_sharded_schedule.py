"""benchmarks/sharded_schedule.py: hand-built schedules whose times are worked out by hand (overlap of an async
collective with the ops issued after it, a collective waiting for the last peer to issue it, one collective at a
time, the slowest rank's step, the Python per op, an async collective's CPU taken from the compute it overlaps), and
the counted owner-mode step's order of issues and waits."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from benchmarks import sharded_count as sc
from benchmarks import sharded_schedule as ss
from benchmarks.op_cost import OpRates, OpRecord
from benchmarks.sharded_count import Collective, with_blocking_waits


def test_an_async_collective_overlaps_the_ops_issued_after_it():
    # issue a 3 s collective, 2 s of ops, wait: done at 3 (summed it would be 5), 1 s of it exposed
    done = ss.simulate([[("issue", 0), ("op", 2.0, "direction"), ("wait", 0)]], [3.0])
    assert done == [{"end": 3.0, "waited": 1.0, "phases": {"direction": 2.0}}]
    # waited at once (a blocking collective), nothing overlaps: 5 s, 3 of them waiting
    done = ss.simulate([[("issue", 0), ("wait", 0), ("op", 2.0, "direction")]], [3.0])
    assert done[0]["end"] == 5.0 and done[0]["waited"] == 3.0


def test_a_collective_starts_when_the_last_peer_issues_it_and_runs_after_the_previous_one():
    # rank 1 computes 4 s before issuing: rank 0 waits from 0 to 4 + 1
    done = ss.simulate([[("issue", 0), ("wait", 0)], [("op", 4.0, "other"), ("issue", 0), ("wait", 0)]], [1.0])
    assert [d["end"] for d in done] == [5.0, 5.0] and [d["waited"] for d in done] == [5.0, 1.0]
    # two collectives issued together run one after the other: the second ends at 1 + 2
    done = ss.simulate([[("issue", 0), ("issue", 1), ("wait", 1)]], [1.0, 2.0])
    assert done[0]["end"] == 3.0
    # a collective of no duration (free links) ends when the last rank issues it: its waits pass at once
    done = ss.simulate([[("issue", 0), ("wait", 0), ("op", 1.0, "other")], [("issue", 0), ("wait", 0)]], [0.0])
    assert [d["end"] for d in done] == [1.0, 0.0] and [d["waited"] for d in done] == [0.0, 0.0]


def test_ranks_outnumbering_the_cores_share_them_among_those_computing():
    # 4 ranks, 2 cores' worth of threads (slots 2): 1 s of ops each at a whole core. All compute at once, so each
    # gets half a core: done at 2 s (against 1 s on a core each, slots None)
    each = [[("op", 1.0, "other")] for _ in range(4)]
    assert [d["end"] for d in ss.simulate(each, [], slots=2)] == [2.0] * 4
    assert [d["end"] for d in ss.simulate(each, [])] == [1.0] * 4
    # ranks 0-1 have 1 s, ranks 2-3 have 3 s: half speed until 2 s (ranks 0-1 done, 1 s of the others' done), then
    # 2 ranks on 2 cores finish their last 2 s at full speed: 4 s (a fixed half core would say 6); each phase is
    # the time its op took
    done = ss.simulate([[("op", 1.0, "other")]] * 2 + [[("op", 3.0, "other")]] * 2, [], slots=2)
    assert [d["end"] for d in done] == pytest.approx([2.0, 2.0, 4.0, 4.0])
    assert done[3]["phases"] == {"other": pytest.approx(4.0)}
    # a rank blocked in a wait takes no CPU. One core (slots 1): rank 0 waits from the start for a 1 s collective
    # that ranks 1-2 issue after 1 s of ops each. Ranks 1-2 share the core: both issue at 2 s, the collective ends
    # at 3 s; then all three compute at a third of the core: ranks 1-2's 0.5 s end at 4.5 s, and rank 0, 0.5 s
    # done by then, runs its last 0.5 s alone: 5 s
    waiter = [("issue", 0), ("wait", 0), ("op", 1.0, "other")]
    worker = [("op", 1.0, "other"), ("issue", 0), ("wait", 0), ("op", 0.5, "other")]
    done = ss.simulate([waiter, worker, worker], [1.0], slots=1)
    assert [d["end"] for d in done] == pytest.approx([5.0, 4.5, 4.5])
    assert [d["waited"] for d in done] == pytest.approx([3.0, 1.0, 1.0])


def test_programs_that_issue_different_collectives_are_refused():
    with pytest.raises(RuntimeError, match="deadlock"):
        ss.simulate([[("issue", 0), ("wait", 0)], [("op", 1.0, "other")]], [1.0])


def test_a_blocking_collective_is_waited_for_at_its_issue():
    events = [("issue", 0), ("op", "x"), ("issue", 1), ("op", "y"), ("wait", 1)]
    assert with_blocking_waits(events, {1}) == [("issue", 0), ("wait", 0), ("op", "x"), ("issue", 1), ("op", "y"),
                                                ("wait", 1)]


RATES = OpRates(stream=1e4, convert=1, reduce=1, matvec=1, op_s=0.01, adamw=1, fused=1)


def _step(ops: int, phase: str = "direction", sent: int = 50) -> SimpleNamespace:
    """ops 1000 B stream ops (0.1 s + 0.01 s fixed each) after the issue of a `sent` B all-to-all, then its wait."""
    records = [OpRecord(phase, "add_", "stream", 500, 500) for _ in range(ops)]
    coll = Collective("direction", "all_to_all", sent, sent)
    return SimpleNamespace(records=records, collectives=[coll],
                           events=[("issue", 0)] + [("op", r) for r in records] + [("wait", 0)])


def test_the_step_is_the_slowest_rank_and_the_collective_the_busiest_ranks_bytes():
    # rank 0: one op (0.11 s), rank 1: three (0.33 s); the all-to-all: 0.1 s latency + 100 B at 1000 B/s (rank 1's)
    p = ss.scheduled([_step(1), _step(3, sent=100)], RATES, 2, 1000.0, 0.1)
    assert p["total_s"] == pytest.approx(0.33)  # rank 1's ops, the collective (0.2 s) hidden behind them
    assert p["exposed_s"] == pytest.approx(0.2 - 0.11)  # rank 0 waits for the rest of the collective
    assert p["direction_s"] == pytest.approx(0.33) and p["wire_s"] == pytest.approx(0.1)
    assert p["latency_s"] == pytest.approx(0.1) and p["collectives"] == 1 and p["sent"] == 50


def test_python_per_op_is_priced_on_every_op_of_its_class():
    python = {"direction": 0.5, "other": 0.25}
    p = ss.scheduled([_step(2), _step(2)], RATES, 2, 1e12, 0.0, python)
    assert p["total_s"] == pytest.approx(2 * (0.11 + 0.5)) and p["python_s"] == pytest.approx(1.0)
    other = ss.scheduled([_step(2, "update")], RATES, 1, 1e12, 0.0, python)
    assert other["total_s"] == pytest.approx(2 * (0.11 + 0.25)) and other["other_s"] == pytest.approx(other["total_s"])


def test_mean_scheduled_averages_the_cycle_with_each_steps_python():
    cycle = [[_step(1)], [_step(1)]]
    p = ss.mean_scheduled(cycle, RATES, 1, 1e12, 0.0, [{"direction": 1.0, "other": 0.0}, None])
    assert p["total_s"] == pytest.approx(0.11 + 1.0 / 2)


def test_an_async_collectives_cpu_is_taken_from_the_compute_it_overlaps():
    # issue, 2 s of ops, wait; the collective lasts 0.5 s and its gloo threads take 0.3 s of the rank's core:
    # the ops end at 2.3 (nothing left to wait for), and the 0.3 s are direction time (the phase it overlaps)
    collectives = [Collective("direction", "all_to_all", 0, 0)]
    step = SimpleNamespace(records=[], collectives=collectives,
                           events=[("issue", 0), ("op", OpRecord("direction", "add_", "stream", 5000, 5000)),
                                   ("op", OpRecord("direction", "add_", "stream", 5000, 5000)), ("wait", 0)])
    rates = OpRates(stream=1e4, convert=1, reduce=1, matvec=1, op_s=0.0, adamw=1, fused=1)
    done = ss.replayed([step], rates, [0.5], collective_cpu=[[0.3]])
    assert done["total_s"] == pytest.approx(2.3) and done["direction_s"] == pytest.approx(2.3)
    assert done["collective_cpu_s"] == pytest.approx(0.3) and done["exposed_s"] == 0.0
    # at most the compute it overlaps: 5 s of CPU against 2 s of ops charges 2 s
    assert ss.replayed([step], rates, [0.5], collective_cpu=[[5.0]])["total_s"] == pytest.approx(4.0)
    # waited at once (a blocking collective), it overlaps nothing: its CPU is inside its 0.5 s
    blocking = SimpleNamespace(records=[], collectives=collectives,
                               events=[("issue", 0), ("wait", 0)] + step.events[1:3])
    done = ss.replayed([blocking], rates, [0.5], collective_cpu=[[0.3]])
    assert done["total_s"] == pytest.approx(2.5) and done["collective_cpu_s"] == 0.0


def test_scheduled_charges_each_ranks_collective_cpu_per_call_and_per_byte():
    # _step: 3 ops (0.33 s) inside the all-to-all's window; rank 0 sends 50 B, rank 1 100 B; 0.1 s per call and
    # 1 ms per byte on the wire: rank 0 is charged 0.15 s, rank 1 0.2 s, and rank 1 ends the step at 0.53 s
    p = ss.scheduled([_step(3), _step(3, sent=100)], RATES, 2, 1e12, 0.0, cpu=(0.1, 1e-3))
    assert p["collective_cpu_s"] == pytest.approx(0.2) and p["total_s"] == pytest.approx(0.33 + 0.2)
    # a ring all-reduce puts 2 (W - 1) / W of its tensor on the wire: 4 ranks, 80 B -> 120 B
    reduce = Collective("direction", "all_reduce", 80, 80)
    assert sc.wire_bytes(reduce, 4) == pytest.approx(120.0)
