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
