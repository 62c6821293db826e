"""Who says `preempted: ...` when a stop signal ends a run of several ranks: rank 0, once (before: every rank, in
two wordings, 32 lines on 32 ranks), and another rank only when it knows something rank 0 does not: the signal's
name, when rank 0 received none."""

import signal

import pytest
import torch

from dit_train.trainer.preemption import Preemption


def stopped(received: dict[int, str], world: int = 32):
    """Each rank's Preempted after the agreement (the summed votes, in float32 as the loss all-reduce sums them)."""
    ranks = [Preemption(rank) for rank in range(world)]
    for rank, name in received.items():
        ranks[rank]._on_signal(signal.Signals[name].value, None)
    votes = torch.tensor([p.vote() for p in ranks], dtype=torch.float32).sum().item()
    for p in ranks:
        p.agree(votes)
        assert p.requested
    return [p.stop(8, "/runs/r") for p in ranks]


@pytest.mark.parametrize("who", ["all", "rank 0 only"])
def test_rank_0_alone_says_it_when_it_received_the_signal(who):
    received = {r: "SIGTERM" for r in range(32)} if who == "all" else {0: "SIGTERM"}
    said = [str(e) for e in stopped(received) if e.announce]
    assert said == ["received SIGTERM at step 8; checkpoint written, rerun with train.resume=auto run_dir=/runs/r "
                    "to continue"]


def test_ranks_that_received_a_signal_rank_0_did_not_add_its_name_and_rank_0_counts_them():
    out = stopped({3: "SIGUSR1", 17: "SIGUSR1"})
    said = {i: str(e) for i, e in enumerate(out) if e.announce}
    assert said[0].startswith("received a stop signal (on 2 other ranks) at step 8; checkpoint written")
    assert said[3] == "rank 3 received SIGUSR1 at step 8 (rank 0 did not; its line says what to do)"
    assert said[17].startswith("rank 17 received SIGUSR1") and len(said) == 3
    assert str(stopped({5: "SIGTERM"})[0]).startswith("received a stop signal (on another rank) at step 8")
    assert all(e.exit_code == 75 for e in out)  # every rank exits requeue-able, printed or not


def test_a_single_process_says_it_as_before():
    p = Preemption()
    p._on_signal(signal.SIGINT.value, None)
    p.agree(p.vote())
    e = p.stop(3, "/runs/r")
    assert e.announce and str(e).startswith("received SIGINT at step 3") and e.exit_code == 130
