"""benchmarks/sharded_count.py: the collectives counted on a rank of a fake group (2 ranks at dit_xs; 8 at dit_1b3,
the paper's smallest cell at full width and 10 of its 30 blocks, on its CUDA path) against the optimizer's own
accounting (ShardComm's timer.add_bytes), the cost model's byte rules and the owner plan, the order of issues and
waits the schedule replays, and a collective priced by hand."""

from __future__ import annotations

import pytest
import torch

from benchmarks import sharded_count as sc
from benchmarks.cost_model.shapes import model_shapes, rank_bytes

CONFIGS = {"muon gather": ({"name": "muon", "distributed_mode": "gather"}, "gather", ["refresh"] * 3),
           "muon owner": ({"name": "muon", "distributed_mode": "owner"}, "owner", ["refresh"] * 3),
           "K=3 owner": ({"name": "periodic_rowwise", "K": 3}, "owner", ["refresh", "rownorm", "rownorm"]),
           "rownorm": ({"name": "rownorm"}, "owner", ["rownorm"] * 3)}


@pytest.fixture(scope="module")
def counted():
    from dit_train.model.dit import load_preset

    cfg = load_preset("dit_xs", 64, 2)
    return {label: sc.count_sharded_steps(cfg, c, 2) for label, (c, _, _) in CONFIGS.items()}


@pytest.mark.parametrize("label", list(CONFIGS))
def test_counted_collectives_are_the_optimizers_own(counted, label):
    _, mode, kinds = CONFIGS[label]
    shapes = model_shapes("dit_xs", 64, 2)
    for step, kind in zip(counted[label], kinds, strict=True):
        # one counted collective per ShardComm call, same kind and bytes, in order
        assert [(c.op, c.sent) for c in step.collectives] == step.accounted
        assert step.collectives, "a sharded matrix step on 2 ranks communicates"
        # and the total is what the cost model's byte rules give rank 0
        expected = sum(rank_bytes(shapes, kind, "spectral", mode, 2, 0).values())
        assert sum(c.sent for c in step.collectives) == expected
        assert step.records  # and it dispatched ops


def test_collectives_counted_and_priced_by_hand():
    f32 = torch.empty(100)  # 400 B
    assert sc.collective_of("direction", "allreduce_", ([f32, torch.empty(5)],), 4) == \
        sc.Collective("direction", "all_reduce", 420, 420)
    bf16 = torch.empty(10, dtype=torch.bfloat16)  # 20 B: 3 peers receive it
    gathered = torch.empty(40, dtype=torch.bfloat16)
    assert sc.collective_of("direction", "_allgather_base_", (gathered, bf16), 4).sent == 60
    # rank 0 keeps its 2 elements and sends 3 + 5 fp32 to the others; rank 1 keeps its 3
    args = (torch.empty(10), torch.empty(10), None, [1, 1, 8], [2, 3, 5])
    assert sc.collective_of("comm", "alltoall_base_", args, 3).to == (0, 12, 20)
    assert sc.collective_of("comm", "alltoall_base_", args, 3, rank=1).to == (8, 0, 20)
    assert sc.collective_of("comm", "alltoall_base_", args, 3).sent == 32
    with pytest.raises(ValueError, match="no byte rule"):
        sc.collective_of("x", "broadcast_", (f32,), 2)
    # a 400 B all-reduce on 4 ranks: a ring puts 2 x 3/4 x 400 = 600 B on the wire; at 1000 B/s + 0.1 s latency
    reduce = sc.Collective("direction", "all_reduce", 400, 400)
    assert sc.wire_seconds(reduce, 4, 1000.0, 0.1) == pytest.approx(0.7)


def test_every_collective_is_issued_once_and_waited_for_once_after_its_issue(counted):
    for label, steps in counted.items():
        for step in steps:
            issued = [i for kind, i in step.events if kind == "issue"]
            waited = [i for kind, i in step.events if kind == "wait"]
            assert issued == list(range(len(step.collectives))), label
            assert sorted(waited) == issued, label
            at = {ev: n for n, ev in enumerate(step.events) if ev[0] != "op"}
            assert all(at[("issue", i)] < at[("wait", i)] for i in issued), label
            assert [ev[1] for ev in step.events if ev[0] == "op"] == step.records, label


def test_owner_mode_has_its_inbound_exchanges_in_flight_while_it_computes(counted):
    from dit_train.optim.owner_exchange import IN_FLIGHT

    events = counted["muon owner"][0].events
    first_wait = next(n for n, ev in enumerate(events) if ev[0] == "wait")
    assert [ev for ev in events[:first_wait] if ev[0] == "issue"] == [("issue", i) for i in range(IN_FLIGHT)]
    # NS5 (the owner's bmm's) runs between the first wait and the last: while later exchanges are in flight
    last_wait = max(n for n, ev in enumerate(events) if ev[0] == "wait")
    assert any(ev[0] == "op" and ev[1].op in ("bmm", "baddbmm") for ev in events[first_wait:last_wait])


def test_another_rank_is_counted_with_its_own_bytes_and_ownership():
    from dit_train.model.dit import load_preset

    cfg, shapes = load_preset("dit_xs", 64, 2), model_shapes("dit_xs", 64, 2)
    rank1 = sc.count_sharded_steps(cfg, {"name": "muon", "distributed_mode": "owner"}, 2, steps=1, rank=1)[0]
    assert sum(c.sent for c in rank1.collectives) == sum(rank_bytes(shapes, "refresh", "spectral", "owner", 2,
                                                                        1).values())
    assert [(c.op, c.sent) for c in rank1.collectives] == rank1.accounted


def test_a_second_process_group_is_refused():
    from dit_train.parallel.memory_estimate import init_fake_process_group
    import torch.distributed as dist

    init_fake_process_group(2)
    try:
        with pytest.raises(RuntimeError, match="already initialised"):
            sc.count_sharded_steps(None, {"name": "muon"}, 2)
    finally:
        dist.destroy_process_group()


# The paper cell's depth cut from 30 to 10 blocks: every matrix shape stays the preset's, each block's group still
# spans more than one exchange of 8 (8 + a shorter 2), and each fake-tensor op of the count is paid per matrix
# (30 blocks: ~52,000 ops, two thirds of this file's time).
PAPER_DEPTH = 10


@pytest.fixture(scope="module")
def paper_cell():
    """dit_1b3 (the paper's smallest preset, full width, PAPER_DEPTH blocks) as rank 0 of 8, each step kind as it
    runs on CUDA."""
    from dit_train.model.dit import load_preset

    contenders = {"K=3 owner": ({"name": "periodic_rowwise", "K": 3}, ["refresh", "rownorm"]),
                  "muon gather": ({"name": "muon", "distributed_mode": "gather"}, ["refresh"])}
    return sc.count_step_kinds(load_preset("dit_1b3", depth=PAPER_DEPTH), contenders, 8, gpu=True)


def test_a_paper_cell_counts_the_optimizers_own_collectives_and_bytes(paper_cell):
    from dit_train.optim.directions import ns5_flops
    from dit_train.optim.owner_exchange import plan_exchanges

    shapes = model_shapes("dit_1b3", depth=PAPER_DEPTH)
    for label, mode in (("K=3 owner", "owner"), ("muon gather", "gather")):
        for kind, step in paper_cell[label].steps.items():
            assert [(c.op, c.sent) for c in step.collectives] == step.accounted, (label, kind)
            assert sum(c.sent for c in step.collectives) == \
                sum(rank_bytes(shapes, kind, "spectral", mode, 8, 0).values()), (label, kind)
            # every collective is issued once, in order, and waited for once after its issue
            issued = [i for what, i in step.events if what == "issue"]
            assert issued == list(range(len(step.collectives))), (label, kind)
            assert sorted(i for what, i in step.events if what == "wait") == issued, (label, kind)
            assert [ev[1] for ev in step.events if ev[0] == "op"] == step.records, (label, kind)
    # on CUDA compile_rownorm auto compiles: the RowNorm step's passes are fused regions, each an op event
    rownorm = paper_cell["K=3 owner"].steps["rownorm"]
    assert any(what == "op" and rec.category == "fused" for what, rec in rownorm.events)
    # the NS5 flops each rank owns, read from the optimizer, are its owner plan's
    groups = {s: (s, c) for s, c in shapes.matrices}
    plan = plan_exchanges(groups, 8)
    assert paper_cell["K=3 owner"].owned == [sum(ex.counts[r] * ns5_flops(*ex.key) for ex in plan) for r in range(8)]
    assert paper_cell["muon gather"].owned is None


def test_k_only_mixes_the_counted_steps():
    # each kind's step is set, so periodic_rowwise K=3 and K=5 count the same steps (cost_model.sharded.step_key
    # shares them)
    from dit_train.model.dit import load_preset

    contenders = {K: ({"name": "periodic_rowwise", "K": K}, ["refresh", "rownorm"]) for K in (3, 5)}
    counted = sc.count_step_kinds(load_preset("dit_xs", 64, 2), contenders, 2)
    for kind in ("refresh", "rownorm"):
        three, five = counted[3].steps[kind], counted[5].steps[kind]
        assert three.records == five.records and three.collectives == five.collectives, kind
        assert three.events == five.events, kind
    assert counted[3].steps["refresh"].records != counted[3].steps["rownorm"].records


def test_the_refresh_step_is_muons_and_a_rownorm_step_is_the_same_without_a_refresh_before_it():
    # what lets a paper cell count the refresh step once per mode (cost_model.sharded.step_key): periodic_rowwise's
    # refresh step dispatches what Muon's does (same ops, collectives, order, owner plan), and its RowNorm step
    # counted alone (warmed up by a RowNorm step only) what it dispatches after a refresh
    from dit_train.model.dit import load_preset

    for mode in ("gather", "owner"):
        periodic = {"name": "periodic_rowwise", "K": 3, "distributed_mode": mode}
        counted = sc.count_step_kinds(load_preset("dit_xs", 64, 2), {
            "muon": ({"name": "muon", "distributed_mode": mode}, ["refresh"]),
            "periodic": (periodic, ["refresh", "rownorm"]), "rownorm alone": (periodic, ["rownorm"])}, 2, gpu=True)
        pairs = ((counted["muon"].steps["refresh"], counted["periodic"].steps["refresh"]),
                 (counted["periodic"].steps["rownorm"], counted["rownorm alone"].steps["rownorm"]))
        for a, b in pairs:
            assert a.records == b.records and a.collectives == b.collectives and a.events == b.events, mode
        assert counted["muon"].owned == counted["periodic"].owned, mode
