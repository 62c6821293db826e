"""benchmarks/host_overhead.py's attribution of calls to the trainer's phases."""

import torch

from benchmarks.dispatch_counter import DispatchCounter
from benchmarks.host_overhead import outermost


def test_phases_opened_inside_a_trainer_phase_count_towards_it():
    """The optimizer opens its own phases (momentum, direction, update) on the trainer's timer inside the trainer's
    "optimizer" phase: their calls, and the calls after them, belong to "optimizer", not to phases of their own
    or to "other"."""
    counter = DispatchCounter()
    mark = outermost(counter.phase)
    a = torch.ones(4)
    with counter:
        with mark("optimizer"):
            a.add(1)
            with mark("momentum"):
                a.add(1)
                with mark("comm"):
                    a.add(1)
            a.add(1)
        a.add(1)
    assert counter.ops["optimizer"]["add.Tensor"] == 4
    assert counter.ops["other"]["add.Tensor"] == 1
    assert set(counter.calls) == {"optimizer", "other"}
    assert counter.total_s["optimizer"] >= counter.inside_s["optimizer"] > 0



def test_python_calls_are_counted_per_trainer_phase():
    """count_python_calls: a Python call goes to the trainer phase open at the time (calls inside the optimizer's
    own phases to the enclosing one), the rest to "other"; one row per step. Two steps that differ only in how
    often one function is called in each place differ by exactly that in each phase."""
    from types import SimpleNamespace

    from benchmarks.host_overhead import PHASES, count_python_calls

    def leaf():
        return 1

    def counted(forward: int, momentum: int, outside: int) -> dict:
        class Trainer:
            timer = SimpleNamespace()

            def train_step(self, x, cond):
                with self.timer.phase("forward"):
                    for _ in range(forward):
                        leaf()
                with self.timer.phase("optimizer"):
                    with self.timer.phase("momentum"):
                        for _ in range(momentum):
                            leaf()
                for _ in range(outside):
                    leaf()

        rows = [{name: {} for name in PHASES} for _ in range(2)]
        count_python_calls(SimpleNamespace(trainer=Trainer(), x=None, y=None), rows)
        assert rows[0] == rows[1] and set(rows[0]) == set(PHASES)
        return {name: rows[0][name]["python_calls"] for name in PHASES}

    base, more = counted(1, 1, 1), counted(4, 6, 9)
    assert {name: more[name] - base[name] for name in PHASES} == {"forward": 3, "backward": 0, "optimizer": 5,
                                                                "other": 8}
