"""benchmarks/model_owner_schedule.py, the discrete-event model of the whole-matrix direction stage: the simulator on
schedules whose time is known by hand, and the two schedules' defining behaviours (docs/bench_distributed.md)."""

import pytest

from benchmarks import model_owner_schedule as model

NO_NET = model.Net(inter_bytes_s=float("inf"), nvlink_bytes_s=float("inf"), gpus_per_node=8, latency_s=0.0)


def test_a_collective_waits_for_the_compute_issued_before_it_on_every_rank():
    """Two ranks: c0 (1 s), then rank 0 computes 2 s and rank 1 computes 5 s before issuing c1 (1 s), which both
    then read: c1 starts at 1 + 5, so the end is 6 + 1 + the last compute (1 s)."""
    c0, c1 = model.Coll(1.0), model.Coll(1.0)
    progs = [[c0, model.Compute(0, 2.0), c1, model.Compute(1, 1.0)],
             [c0, model.Compute(0, 5.0), c1, model.Compute(1, 1.0)]]
    end, busy, network = model.simulate(progs)
    assert (end, busy, network) == (8.0, [3.0, 6.0], 2.0)


def test_collectives_run_one_at_a_time_in_issue_order():
    c0, c1, c2 = model.Coll(1.0), model.Coll(2.0), model.Coll(3.0)
    progs = [[c0, c1, c2, model.Compute(0, 0.5)]] * 2
    end, _, network = model.simulate(progs)
    assert network == 6.0 and end == 6.0  # c0's compute (0.5 s from t = 1) is hidden behind c1 and c2


def test_an_all_to_all_lasts_as_long_as_the_busiest_link():
    net = model.Net(inter_bytes_s=10.0, nvlink_bytes_s=100.0, gpus_per_node=2, latency_s=0.5)
    sent = [[0, 100, 10, 0], [0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]]  # rank 0: 100 B to its node, 10 B off it
    assert net.all_to_all(sent) == pytest.approx(0.5 + max(100 / 100, 10 / 10))


@pytest.mark.parametrize("world", [4, 8, 32])
def test_without_network_cost_the_owner_schedule_takes_the_busiest_ranks_ns5_time(world):
    groups = {(512, 512): 9, (1536, 512): 8, (512, 2048): 8, (512, 256): 1}
    ns5 = lambda s, c: c * model.ns5_flops(*s) * 1e-12  # noqa: E731
    end, busy, _ = model.simulate(model.owner_schedule(groups, world, NO_NET, ns5))
    assert end == pytest.approx(max(busy))
    total = sum(ns5(s, c) for s, c in groups.items())
    assert max(busy) <= total / world + ns5((512, 2048), 1)  # within one matrix of the ideal share


def test_the_per_bucket_owner_schedule_keeps_at_most_two_ns5_in_flight():
    """One matrix per bucket (the 16 MB buckets of a 15B model): bucket b + 2's exchange queues behind bucket b's
    return, which waits for b's NS5, so however many ranks, N equal NS5s take N / 2 of them."""
    groups = {(4096, 4096): 16}
    ns5 = lambda s, c: float(c)  # noqa: E731
    end, _, _ = model.simulate(model.old_owner_schedule(groups, 32, NO_NET, ns5, bucket_mb=16))
    assert end == pytest.approx(8.0)
    new_end, _, _ = model.simulate(model.owner_schedule(groups, 32, NO_NET, ns5))
    assert new_end == pytest.approx(1.0)  # one NS5 on each of 16 ranks at once


def test_bad_arguments_are_rejected_with_the_value(capsys):
    with pytest.raises(SystemExit):
        model.parse(["--inter-gbit", "0"])
    assert "--inter-gbit=0.0 is not valid" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        model.parse(["--presets", "dit_2b"])
    assert "dit_2b" in capsys.readouterr().err
