"""benchmarks/cost_model/: a 2-matrix toy whose FLOPs, bytes and seconds are worked out by hand, the logical
bytes against what the real ShardedMatrixOptimizer counts (rank 0 of a fake process group), and sanity of the
predictions' direction (bigger models cost more, larger K less)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from benchmarks.cost_model.bench_logs import parse_bench_distributed, parse_bench_optimizer, parse_distributed_phases
from benchmarks.cost_model.calibration import (calibration_rows, collective_cpu_rates, phase_rows, sharded_cycle,
                                               sharded_step, step_kinds)
from benchmarks.cost_model.cli import main
from benchmarks.cost_model.contender import Optim
from benchmarks.cost_model.hardware import Hardware, PROFILES
from benchmarks.cost_model.measure_host import (calibration_buckets, core_slots, host_profile, measure_gloo,
                                                other_threads_cpu_s, spanning_buckets)
from benchmarks.cost_model.predict import counted_records, forward_backward, optimizer_step, predict
from benchmarks.cost_model.shapes import Shapes, model_shapes, rank_bytes, rownorm_buckets
from benchmarks.cost_model.sharded import collective_seconds, counted_ranks, gpu_replayed, sharded_optimizer
from dit_train.optim.owner_exchange import plan_exchanges

# a wide-by-2 matrix (64 x 32: tall, Gram form at aspect 2) and a 32 x 128 (wide, aspect 4), 10 AdamW elements
TOY = Shapes(matrices=(((64, 32), 1), ((32, 128), 1)), rest=10, params=64 * 32 + 32 * 128 + 10,
             blocks=(3000, 3178), flops_per_image=10**6)
ROUND = Hardware("toy", matmul_flops=1e9, mfu=0.5, ns5_of_peak=0.5, memory_bytes_s=1e9, memory_efficiency=0.5,
                 intra_bytes_s=1e8, inter_bytes_s=1e7, link_efficiency=1.0, devices_per_node=2, latency_s=0.0,
                 launch_s=0.0, rownorm_kernels="eager")
ELEMENTS = 64 * 32 + 32 * 128  # 6144


def test_single_process_muon_step_by_hand():
    # NS5, plain count 5 (4 r^2 c + 2 r^3): 64x32 (r 32, c 64) 1,638,400 x Gram share (4*2 + 14) / (5*5) = 0.88;
    # 32x128 (r 32, c 128) 2,949,120 x (4*4 + 14) / (5*9) = 2/3; at 1e9 x 0.5 flop/s
    ns5 = (1638400 * 0.88 + 2949120 * 2 / 3) / 0.5e9
    # elementwise: 40 B per matrix element (refresh) + 28 per AdamW element, at 1e9 x 0.5 B/s
    moved = (40 * ELEMENTS + 28 * 10) / 0.5e9
    p = predict(TOY, Optim("muon"), ROUND, 1, images_per_rank=4)
    assert p["direction"] == pytest.approx(ns5)
    assert p["elementwise"] == pytest.approx(moved)
    assert p["optimizer"] == pytest.approx(ns5 + moved)
    assert p["compute"] == pytest.approx(4e6 / 0.5e9)  # 4 images x 1e6 flops at 1e9 x MFU 0.5
    assert p["step"] == pytest.approx(4e6 / 0.5e9 + ns5 + moved)
    assert p["bytes"] == 0


def test_periodic_cycle_is_one_refresh_and_k_minus_one_rownorm_steps():
    rownorm = (68 * ELEMENTS + 28 * 10) / 0.5e9  # spectral, torch ops: 68 B per element
    refresh = predict(TOY, Optim("muon"), ROUND, 1)["optimizer"]
    p = predict(TOY, Optim("periodic_rowwise", K=5), ROUND, 1)
    assert p["steps"]["rownorm"] == pytest.approx(rownorm)
    assert p["optimizer"] == pytest.approx((refresh + 4 * rownorm) / 5)


def test_two_ranks_bytes_and_fsdp_by_hand():
    # gather mode: each rank sends its half of every matrix, bf16: 32*32*2 + 16*128*2
    assert rank_bytes(TOY, "refresh", "spectral", "gather", 2, 0) == {"all_gather": 2048 + 4096}
    # RowNorm: the tall matrix's 32 column sums (fp32); spectral adds 3 rounds: wide 4 (3*128 + 1), tall 4 (2*32 + 1)
    assert rank_bytes(TOY, "rownorm", "frobenius", "owner", 2, 1) == {"all_reduce": 128}
    assert rank_bytes(TOY, "rownorm", "spectral", "owner", 2, 1) == {"all_reduce": 128 + 1540 + 260}
    # owner mode, 2 ranks, one matrix per shape: rank 0 owns both (one exchange per group, ties to rank 0): it
    # returns the other rank's rows (bf16) and sends nothing out; rank 1 sends its rows of both
    assert rank_bytes(TOY, "refresh", "spectral", "owner", 2, 0) == {"all_to_all": 2048 + 4096}
    assert rank_bytes(TOY, "refresh", "spectral", "owner", 2, 1) == {"all_to_all": 2048 + 4096}
    # FSDP over 2 ranks inside a node (1e8 B/s): all-gather forward P, backward the first block (not the last),
    # reduce-scatter 2 P (fp32)
    fb = forward_backward(TOY, ROUND, 2, images_per_rank=1)
    P = TOY.params
    assert fb["fsdp"] == pytest.approx((P + 3000 + 2 * P) / 1e8)
    compute = 1e6 / 0.5e9
    first_block = 3000 / 1e8
    assert fb["fsdp_exposed"] == pytest.approx(first_block + max(0.0, fb["fsdp"] - compute))
    # both blocks in one unit: nothing regathered in backward (the one unit is the last), and the first gather,
    # exposed, is the whole unit; with a latency, 3 collectives instead of 6
    one = forward_backward(TOY, ROUND, 2, images_per_rank=1, blocks_per_unit=2)
    assert one["fsdp"] == pytest.approx((P + 2 * P) / 1e8)
    assert one["fsdp_exposed"] == pytest.approx((3000 + 3178) / 1e8 + max(0.0, one["fsdp"] - compute))
    slow = lambda per_unit: forward_backward(TOY, replace(ROUND, latency_s=1.0), 2, 1, blocks_per_unit=per_unit)
    assert slow(1)["fsdp"] - slow(2)["fsdp"] == pytest.approx(3 + 3000 / 1e8)


def test_collectives_cross_nodes_at_the_slower_link():
    # 4 ranks on nodes of 2: RowNorm's all-reduces ride InfiniBand (1e7 B/s): 2 (W - 1) / W of each round's tensor
    p = optimizer_step(TOY, "rownorm", Optim("rownorm", scale="frobenius"), ROUND, 4)
    assert p["direction"] == pytest.approx(1.5 * 128 / 1e7)


@pytest.fixture(scope="module")
def counted_on_rank0():
    """comm_bytes/total of rank 0 of 4 (fake process group) per step of the real optimizers on a tiny DiT."""
    import torch
    import torch.distributed as dist

    from dit_train.parallel.memory_estimate import empty_all_to_all_inputs_allowed, init_fake_process_group
    from dit_train.model.dit import build_model, load_preset
    from dit_train.optim.registry import build_optimizer
    from dit_train.parallel.fsdp import ParallelPlan, fsdp_mesh, local, parallelize
    from dit_train.telemetry.clocks import PhaseTimer

    assert not dist.is_initialized()
    init_fake_process_group(4)
    timer = PhaseTimer(enabled=True)
    try:
        plan = ParallelPlan(sharded=True)
        model = parallelize(build_model(load_preset("dit_xs", 64, 2), device="meta"), plan,
                            mesh=fsdp_mesh(plan, "cpu"))
        model.to_empty(device="cpu")
        with torch.no_grad():
            for p in model.parameters():
                local(p).normal_(0.0, 0.02)
                p.grad = torch.zeros_like(p)
                local(p.grad).normal_(0.0, 1e-3)
        out = {}
        for label, cfg in {"muon gather": {"name": "muon", "distributed_mode": "gather"},
                           "K=3 gather": {"name": "periodic_rowwise", "K": 3, "distributed_mode": "gather"},
                           "K=3 owner": {"name": "periodic_rowwise", "K": 3}}.items():
            opt = build_optimizer(model, {"lr": 1e-6, **cfg})
            opt.use_timer(timer)
            steps = []
            with empty_all_to_all_inputs_allowed():
                for _ in range(3):
                    timer.collect()
                    opt.step()
                    steps.append(timer.collect().get("comm_bytes/total", 0.0))
            out[label] = steps
        return out
    finally:
        dist.destroy_process_group()


def test_logical_bytes_equal_the_sharded_optimizers_own_count(counted_on_rank0):
    shapes = model_shapes("dit_xs", 64, 2)
    for label, mode in (("K=3 gather", "gather"), ("K=3 owner", "owner")):
        predicted = [sum(rank_bytes(shapes, step, "spectral", mode, 4, 0).values())
                     for step in ("refresh", "rownorm", "rownorm")]
        assert counted_on_rank0[label] == predicted, label
    ratio = sum(counted_on_rank0["K=3 gather"]) / (3 * counted_on_rank0["muon gather"][0])
    model = (predict(shapes, Optim("periodic_rowwise", 3, mode="gather"), PROFILES["h100"], 4)["bytes"]
             / predict(shapes, Optim("muon", mode="gather"), PROFILES["h100"], 4)["bytes"])
    assert ratio == pytest.approx(model)  # gather mode: every rank sends the same, so rank 0's ratio is the mean's
    assert model > 1 / 3  # one gather in three steps, plus the RowNorm steps' all-reduces


def test_bigger_models_cost_more_and_larger_k_less():
    hw = PROFILES["h100"]
    small, big = model_shapes("dit_xs"), model_shapes("dit_m")
    for mode in ("gather", "owner"):
        muon = [predict(s, Optim("muon", mode=mode), hw, 8, 16) for s in (small, big)]
        assert muon[0]["optimizer"] < muon[1]["optimizer"] and muon[0]["step"] < muon[1]["step"]
        cycle = (Optim("muon", mode=mode), Optim("periodic_rowwise", 3, mode=mode),
                 Optim("periodic_rowwise", 5, mode=mode))
        times = [predict(big, o, hw, 8, 16, floor=True)["optimizer"] for o in cycle]
        assert times[0] > times[1] > times[2]
        # counted from the code on one GPU too; on 8 a RowNorm step's ~150 launches (8 us each) outweigh dit_m's
        # NS5 share (cost_model.md, "Counted from the code")
        times = [predict(big, o, hw, 1, 16)["optimizer"] for o in cycle]
        assert times[0] > times[1] > times[2]
    # more GPUs: less compute per rank at the same global batch; a faster memory never makes a step slower.
    # "compute" is the forward + backward's alone: floor=True leaves out counting the sharded optimizer step at
    # W = 2 and 4 (a third of this test's time), which it does not read
    steps = [predict(big, Optim("muon"), hw, w, 256 // w, floor=True)["compute"] for w in (2, 4, 8)]
    assert steps[0] > steps[1] > steps[2]
    h200 = predict(big, Optim("rownorm"), PROFILES["h200"], 8)["optimizer"]
    assert h200 < predict(big, Optim("rownorm"), hw, 8)["optimizer"]


BENCH_OPTIMIZER_LOG = """# optimizer step benchmark: dit_m width 512 depth 8, 38.8M params (38.7M in 43 matrices), torch 2.13.0+cpu, 2 threads
| optimizer | ms/step | / torch AdamW | / our muon | / torch Muon | notes |
| adamw | 11.7 | 0.15 | 0.03 | 0.02 |  |
| muon | 422.2 | 5.42 | 1.00 | 0.60 | NS5 1141 GFLOP/s = 140% of GEMM |
| periodic_rowwise K=3 average, rownorm_scale=spectral, compile_rownorm | 160.4 | 2.06 | 0.38 | 0.23 |  |
"""
BENCH_DISTRIBUTED_LOG = """### 2 process(es): gloo on cpu, 1 thread(s) each; dit_m width 256 depth 4, 3.3M params

| optimizer | opt ms/step | / muon-gather | exposed comm ms | direction ms | MB/step/rank (mean) | MB busiest rank | bytes / muon-gather | whole |
| muon-gather | 30.5 | 1.00 | 1.0 | 20.0 | 2.50 | 2.50 | 1.000 | 22.0 |
"""


def test_the_benchmarks_logs_are_read_by_row():
    model, rows = parse_bench_optimizer(BENCH_OPTIMIZER_LOG)
    assert model == ("dit_m", 512, 8)
    assert rows == {"adamw": pytest.approx(0.0117), "muon": pytest.approx(0.4222),
                    "periodic_rowwise K=3 average, rownorm_scale=spectral, compile_rownorm": pytest.approx(0.1604)}
    dist_rows = parse_bench_distributed(BENCH_DISTRIBUTED_LOG)
    assert dist_rows == {2: (("dit_m", 256, 4), {"muon-gather": (pytest.approx(0.0305), 2.5 * 2**20)})}
    assert parse_distributed_phases(BENCH_DISTRIBUTED_LOG) == {2: {"muon-gather": pytest.approx((0.001, 0.02))}}


@pytest.mark.parametrize("args, message", [(["--paper", "--worlds", "3"], "--worlds [3] is not valid"),
                                           (["--calibrate"], "--calibrate needs")])
def test_bad_arguments_are_one_line_errors(args, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(args)
    assert e.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("content, message", [
    ('{"compute": {}}', "lacks the key(s) cores, gloo; a host profile (--measure-host's output) has the keys "
                        "cores, compute, gloo, python, load_average (cores, compute, gloo required)"),
    ("[1, 2]", "holds a JSON list, not an object"),
    ("not json", "not readable as JSON (Expecting value")])
def test_a_profile_that_is_not_a_host_profile_is_one_line_naming_file_and_keys(tmp_path, capsys, content, message):
    """A --profile JSON without `cores` was a KeyError traceback from deep in the calibration."""
    profile, log = tmp_path / "bad.json", tmp_path / "bench.log"
    profile.write_text(content)
    log.write_text("")
    with pytest.raises(SystemExit) as e:
        main(["--calibrate", "--profile", str(profile), "--bench-optimizer", str(log)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"python -m benchmarks.cost_model: error: --profile {profile}") and message in err, err


def test_the_usage_line_names_the_module_it_runs_as(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    assert capsys.readouterr().out.startswith("usage: python -m benchmarks.cost_model ")


def test_gloo_profile_has_the_cost_of_a_collective_between_busy_processes():
    # tiny sizes: that every number is measured and sane, not its value (this host is loaded)
    g = measure_gloo(2, numel=1024, work_numel=1024, rounds=2)
    assert set(g) == {"link_bytes_s", "latency_s", "busy_latency_s", "cpu_s_per_call", "cpu_s_per_byte"}
    assert g["link_bytes_s"] > 0 and g["latency_s"] >= 0 and g["busy_latency_s"] >= 0
    assert g["cpu_s_per_call"] >= 0 and g["cpu_s_per_byte"] >= 0


def test_other_threads_cpu_is_the_cpu_of_threads_but_the_callers():
    import threading

    worked, release = threading.Event(), threading.Event()

    def work():
        sum(i * i for i in range(300_000))
        worked.set()
        release.wait()  # alive while measured: a thread's CPU leaves /proc/self/task with it

    before = other_threads_cpu_s()
    worker = threading.Thread(target=work)
    worker.start()
    worked.wait()
    own = other_threads_cpu_s()
    sum(i * i for i in range(300_000))  # the caller's own work is not counted
    after = other_threads_cpu_s()
    release.set()
    worker.join()
    assert own > before and after == pytest.approx(own, abs=2e-3)


def fast_profile() -> dict:
    """A host profile of 2 cores where every op costs next to nothing and gloo has no latency: only what a test
    adds to it shows."""
    return {"cores": 2, "compute": {"1": {"gemm_flops": 1e9, "ns5_rates": [[1, 1e9]], "memory_bytes_s": 1e9,
                                          "ops": {"stream": 1e9, "convert": 1e9, "reduce": 1e9, "matvec": 1e9,
                                                  "op_s": 0.0, "square": [[1, 1e9]], "fused": 1e9}}},
            "gloo": {"2": {"link_bytes_s": 1e12, "latency_s": 0.0}}}


def test_sharded_lines_use_the_busy_latency_where_the_profile_has_it():
    measured = fast_profile()
    shapes = model_shapes("dit_xs", 64, 2)
    idle = sharded_step(shapes, "rownorm", measured, 2)
    measured["gloo"]["2"]["busy_latency_s"] = 1.0
    busy = sharded_step(shapes, "rownorm", measured, 2)
    # each of RowNorm's 4 collectives waits its busy latency (the ops that overlap the async one take microseconds)
    assert busy["collectives"] == 4
    assert busy["total_s"] - idle["total_s"] == pytest.approx(busy["collectives"] * 1.0, rel=1e-3)


def test_sharded_lines_price_the_python_per_op_where_the_profile_has_it():
    # AdamW's sharded step: 2 ops per step on every rank, no collective; the profile's Python per op is added to
    # each, divided by the share of a core a process gets (2 processes on 2 cores: all of it)
    measured = fast_profile()
    shapes = model_shapes("dit_xs", 64, 2)
    without = sharded_step(shapes, "adamw", measured, 2)
    measured["python"] = {"2": {"adamw": {"direction": 0.0, "other": 0.5}}}
    priced = sharded_step(shapes, "adamw", measured, 2)
    assert without["ops"] == 2 and priced["total_s"] - without["total_s"] == pytest.approx(2 * 0.5)
    assert step_kinds(Optim("periodic_rowwise", 3, mode="gather"), 4) == ["refresh gather", "rownorm",
                                                                          "rownorm", "refresh gather"]


def test_owner_modes_all_to_alls_take_their_cpu_from_the_ns5_they_overlap():
    # dit_xs width 64 depth 2 on 2 ranks, owner mode: shape groups of 3, 3, 2, 2, 2 and 1 matrices, 2 per exchange,
    # so 2 + 2 + 1 + 1 + 1 + 1 = 8 exchanges, 16 all-to-alls per rank. Every op costs 1 s (windows >> the CPU): all
    # but two overlap compute, the first inbound one (the 4 in flight are issued back to back and it is waited for
    # before any compute) and the last return (waited for after all compute), so 14 are charged 1 ms each
    measured = fast_profile()
    measured["compute"]["1"]["ops"]["op_s"] = 1.0
    shapes = model_shapes("dit_xs", 64, 2)
    free = sharded_step(shapes, "muon-owner", measured, 2)
    measured["gloo"]["2"].update(cpu_s_per_call=1e-3, cpu_s_per_byte=0.0)
    charged = sharded_step(shapes, "muon-owner", measured, 2)
    assert charged["collectives"] == 16 and free["collective_cpu_s"] == 0.0
    assert charged["collective_cpu_s"] == pytest.approx(14e-3)
    assert charged["direction_s"] - free["direction_s"] == pytest.approx(14e-3)
    # 4 processes on 2 cores: the CPU is a whole core's, the replay shares the cores (next test)
    measured["gloo"]["4"] = {"link_bytes_s": 1e12, "latency_s": 0.0, "cpu_s_per_call": 1e-3, "cpu_s_per_byte": 0.0}
    assert collective_cpu_rates(measured, 4) == (1e-3, 0.0) and collective_cpu_rates(measured, 2) == (1e-3, 0)


def test_more_single_thread_processes_than_cores_share_them_while_they_compute():
    # adamw on dit_xs: 2 ops per rank and step, no collective; every op 1 s on a whole core. 2 processes on the 2
    # cores: a core each, 2 s. 4 single-thread processes: 2 cores' worth of threads (core_slots), all 4 compute
    # at once, half a core each: 4 s; the Python per op is CPU too and shared alike (0.5 s per op -> 6 s)
    measured = fast_profile()
    one = measured["compute"]["1"]
    one["ops"].update(op_s=1.0, stream=1e30)
    one["memory_bytes_s"] = 1e30  # fused AdamW's rate: its bytes free
    measured["gloo"]["4"] = {"link_bytes_s": 1e12, "latency_s": 0.0}
    shapes = model_shapes("dit_xs", 64, 2)
    assert (core_slots(measured, 2), core_slots(measured, 4)) == (None, 2.0)
    assert sharded_step(shapes, "adamw", measured, 2)["total_s"] == pytest.approx(2.0)
    assert sharded_step(shapes, "adamw", measured, 4)["total_s"] == pytest.approx(4.0)
    measured["python"] = {"4": {"adamw": {"direction": 0.0, "other": 0.5}}}
    assert sharded_step(shapes, "adamw", measured, 4)["total_s"] == pytest.approx(6.0)


def test_the_python_per_op_of_the_sharded_step_is_measured_per_class():
    # the shrunk step of a tiny model: that both classes are measured and sane, not their values (loaded host)
    from benchmarks.sharded_python import python_per_op
    from dit_train.model.dit import load_preset

    rates = python_per_op(load_preset("dit_xs", 64, 2), {"name": "muon", "distributed_mode": "owner"}, 2, repeats=1)
    assert set(rates) == {"direction", "other"} and all(0 < v < 1e-2 for v in rates.values())


def test_every_rank_is_counted_and_owner_modes_ranks_differ():
    # owner mode gives each rank its own matrices: rank 1 of 2 dispatches other ops than rank 0 (on dit_xs, more
    # NS5), so counting rank 0 alone would not give the slowest rank that bench_distributed reports
    cycle = sharded_cycle(model_shapes("dit_xs", 64, 2), "muon-owner", 2)
    assert [len(step) for step in cycle] == [2, 2, 2]
    flops = [sum(rec.flops for rec in rank.records) for rank in cycle[0]]
    assert flops[0] != flops[1]


def test_the_host_profile_prices_ns5_at_its_own_measured_matmuls():
    # a profile with NS5's matmuls measured (at 1e6 flop/s, 1000x slower than its other GEMM rates): Muon's
    # direction is every counted direction op at its rate, its GEMMs at 1e6, not at the rates by side
    from benchmarks.ns5_gemm_rates import ns5_matmuls

    measured = {**fast_profile(), "cores": 1}  # one process of one thread
    shapes = model_shapes("dit_xs", 64, 2)
    measured["compute"]["1"]["ns5_gemms"] = [[*p, 1e6] for p in ns5_matmuls(sides=(32,), batches=(1,))]
    records = [r for r in counted_records(shapes, "refresh", "spectral", "eager") if r.phase == "direction"]
    expect = sum(r.flops / 1e6 if r.category == "gemm" else r.bytes / 1e9 for r in records)
    assert any(r.category == "gemm" for r in records)
    assert predict(shapes, Optim("muon"), host_profile(measured, 1), 1)["direction"] == pytest.approx(expect)


def test_the_sharded_lines_price_ns5_at_its_own_measured_matmuls():
    # gather-mode Muon on 2 processes: every rank runs every NS5; with NS5's matmuls measured at 1e6 flop/s the
    # direction phase is (next to) the busiest rank's matmul FLOPs at 1e6, averaged over the counted steps
    from benchmarks.ns5_gemm_rates import ns5_matmuls

    measured = fast_profile()
    shapes = model_shapes("dit_xs", 64, 2)
    measured["compute"]["1"]["ns5_gemms"] = [[*p, 1e6] for p in ns5_matmuls(sides=(32,), batches=(1,))]
    cycle = sharded_cycle(shapes, "muon-gather", 2)
    flops = [max(sum(r.flops for r in rank.records if r.category == "gemm") for rank in step) for step in cycle]
    assert min(flops) > 0
    predicted = sharded_step(shapes, "muon-gather", measured, 2)["direction_s"]
    assert predicted == pytest.approx(sum(flops) / len(flops) / 1e6, rel=0.01)


def _gpu(**kw) -> Hardware:
    """A GPU profile with round numbers: no fixed costs, infinite links and memory unless given."""
    inf = float("inf")
    base = dict(matmul_flops=1e12, mfu=1.0, ns5_of_peak=1.0, memory_bytes_s=inf, memory_efficiency=1.0,
                intra_bytes_s=inf, inter_bytes_s=inf, link_efficiency=1.0, devices_per_node=8, latency_s=0.0,
                launch_s=0.0, rownorm_kernels="compiled", op_s=0.0)
    return Hardware("toy GPU", **{**base, **kw})


def test_gpu_replay_of_a_hand_built_step():
    # 1 s per op (10 kB at 10 kB/s); on 2 ranks of one node (1 kB/s): an all-gather sending 3 kB (3 s), an
    # all-reduce of 1 kB (a ring: 2 x 1/2 x 1 kB, 1 s), an all-to-all sending 1 kB to rank 1 (1 s)
    from types import SimpleNamespace

    from benchmarks.op_cost import OpRecord
    from benchmarks.sharded_count import Collective

    hw = _gpu(memory_bytes_s=1e4, intra_bytes_s=1e3)
    op = OpRecord("direction", "add_", "stream", 5000, 5000)
    colls = [Collective("direction", "all_gather", 3000, 3000), Collective("direction", "all_reduce", 1000, 1000),
             Collective("direction", "all_to_all", 1000, 1000, (0, 1000))]
    assert [collective_seconds(c, 2, hw, 0) for c in colls] == [3.0, 1.0, 1.0]
    events = [("issue", 0), ("op", op), ("op", op), ("wait", 0), ("op", op), ("issue", 1), ("issue", 2),
              ("wait", 2)]
    step = SimpleNamespace(records=[op] * 3, collectives=colls, events=events)
    # the all-gather runs beside ops 0 and 1 (0-2 s) until 3 s: the wait holds the compute stream 1 s; op 2 ends
    # at 4; the all-reduce runs 4-5 and the all-to-all, queued behind it on the one communication stream, 5-6;
    # its wait holds compute until 6 (summed: 3 + 3 + 1 + 1 = 8 s)
    done = gpu_replayed({0: step}, hw, 2)
    assert done["total_s"] == pytest.approx(6.0) and done["waited"] == [pytest.approx(3.0)]
    # a second counted rank that computes 2 s more before issuing the all-gather delays it for both: it runs 2-5,
    # the all-reduce 6-7, the all-to-all 7-8; both ranks end at 8, rank 0 blocked 3 + 2 s, rank 3 1 + 2 s: the tie
    # goes to the rank whose own work ends the step
    late = SimpleNamespace(records=[op] * 5, collectives=colls, events=[("op", op), ("op", op)] + events)
    done = gpu_replayed({0: step, 3: late}, hw, 2)
    assert done["ends"] == [pytest.approx(8.0), pytest.approx(8.0)]
    assert done["waited"] == [pytest.approx(5.0), pytest.approx(3.0)] and done["slowest"] == 3


def test_an_all_to_all_crosses_nodes_at_infiniband_and_stays_inside_at_nvlink_at_once():
    from benchmarks.sharded_count import Collective

    hw = _gpu(intra_bytes_s=1e3, inter_bytes_s=1e2, devices_per_node=2, latency_s=0.5)
    # rank 1 of 4 on nodes of 2: 1 kB to rank 0 (its node, 1 s), 50 B to ranks 2 and 3 (the other, 1 s at 1e2)
    c = Collective("comm", "all_to_all", 1100, 1100, (1000, 0, 50, 50))
    assert collective_seconds(c, 4, hw, 1) == pytest.approx(0.5 + 1.0)
    # the same bytes sent by rank 2: the 1 kB to rank 0 crosses (10 s at 1e2), 100 B stay (0.1 s at 1e3)
    assert collective_seconds(c, 4, hw, 2) == pytest.approx(0.5 + 10.0)


def test_owner_mode_step_is_the_slowest_ranks_not_rank_0s():
    # dit_xs 64 wide, 2 deep on 8 ranks: the owner plan gives rank 2 the most NS5 flops (1.23x rank 0's). On a
    # profile where only GEMM flops cost, rank 0 replayed alone is done after its own NS5; the step is at least
    # rank 2's NS5 (its owned matrices' executed flops), and more: rank 2 also waits for exchanges rank 0 issues
    # only after computing its own matrices (IN_FLIGHT ahead)
    from dit_train.optim.directions import ns5_executed_flops

    gemm_only = _gpu()
    shapes = model_shapes("dit_xs", 64, 2)
    plan = plan_exchanges({s: (s, c) for s, c in shapes.matrices}, 8)
    ns5_s = [sum(ex.counts[r] * ns5_executed_flops(*ex.key) for ex in plan) / 1e12 for r in range(8)]
    assert max(range(8), key=lambda r: ns5_s[r]) == 2 and ns5_s[2] > 1.2 * ns5_s[0]
    p = sharded_optimizer(shapes, Optim("muon"), gemm_only, 8)
    assert p["ranks"] == [0, 2] and p["slowest"] == {"refresh": 2}
    rank0 = counted_ranks(shapes, [Optim("muon")], 8, True)[Optim("muon")][0]["refresh"]
    assert gpu_replayed({0: rank0}, gemm_only, 8)["total_s"] == pytest.approx(ns5_s[0])
    assert p["steps"]["refresh"] > ns5_s[2] * (1 - 1e-9)
    assert predict(shapes, Optim("muon"), gemm_only, 8)["optimizer"] == p["steps"]["refresh"]
    # rank 0's bytes are what the optimizer's rules give rank 0
    assert p["bytes"]["refresh"] == sum(rank_bytes(shapes, "refresh", "spectral", "owner", 8, 0).values())


def test_a_paper_cell_counts_the_refresh_step_once_per_counted_rank(monkeypatch):
    # Muon and periodic_rowwise (each RowNorm scale) dispatch the same refresh step, so a cell asks the sharded
    # count for it once per rank, and for each scale's RowNorm step once; every contender still gets every kind
    from benchmarks import sharded_count
    from benchmarks.cost_model.paper import paper_contenders

    asked = []
    count = sharded_count.count_step_kinds

    def recorded(model_cfg, contenders, world, rank=0, gpu=False):
        asked.extend((rank, kind) for _, kinds in contenders.values() for kind in kinds)
        return count(model_cfg, contenders, world, rank, gpu)

    monkeypatch.setattr(sharded_count, "count_step_kinds", recorded)
    shapes = model_shapes("dit_xs", 64, 1)  # counted by no other test (the cache lives for the session)
    contenders = paper_contenders("owner")
    ranks = counted_ranks(shapes, contenders, 2, True)
    assert sorted(kind for rank, kind in asked if rank == 0) == ["refresh", "rownorm", "rownorm"]
    assert all(set(steps) == set(o.steps()) for o in contenders for steps in ranks[o].values())


def test_the_rownorm_buckets_are_the_optimizers_own():
    # dit_xs width 64 depth 2, per block: qkv 192x64, proj 64x64, fc1 256x64, fc2 64x256, adaLN 384x64; the
    # timestep MLP's 64x256 and 64x64 join fc2's and proj's buckets, the final adaLN 128x64 is alone (patch
    # embedding, final linear and class table are AdamW's)
    from dit_train.model.dit import load_preset

    assert sorted(rownorm_buckets(load_preset("dit_xs", 64, 2))) == [(1, 128, 64), (2, 192, 64), (2, 256, 64),
                                                                     (2, 384, 64), (3, 64, 64), (3, 64, 256)]


def test_the_compiled_passes_are_measured_on_buckets_spanning_the_sizes():
    # sizes 100, 200, 10k (twice), 100k: four sizes evenly in log from 100 to 100k are 100, 1k, 10k, 100k; the
    # bucket nearest 1k is the 200 one, of the two at 10k the smaller tuple
    buckets = [(1, 10, 10), (1, 10, 10), (2, 10, 10), (4, 50, 50), (1, 100, 100), (1, 1000, 100)]
    assert spanning_buckets(buckets, 4) == [(1, 10, 10), (2, 10, 10), (1, 100, 100), (1, 1000, 100)]
    assert spanning_buckets(buckets, 3) == [(1, 10, 10), (1, 100, 100), (1, 1000, 100)]
    # the measured sizes span the buckets of dit_m and of the calibration's bench_optimizer (width 512, depth 8)
    sizes = sorted(b * m * n for b, m, n in calibration_buckets())
    chosen = [b * m * n for b, m, n in spanning_buckets(calibration_buckets())]
    assert (chosen[0], chosen[-1]) == (sizes[0], sizes[-1]) and len(chosen) == 4


def _fused_only_profile(fused_buckets=None, fused_passes=None) -> dict:
    """One process of one thread where everything but the compiled RowNorm passes is free."""
    fast = 1e30
    ops = {"stream": fast, "convert": fast, "reduce": fast, "matvec": fast, "op_s": 0.0, "square": [[1, fast]],
           "fused_buckets": fused_buckets, "fused_passes": fused_passes}
    return {"cores": 1, "compute": {"1": {"gemm_flops": fast, "ns5_rates": [[1, fast]], "memory_bytes_s": fast,
                                          "ops": ops}}, "gloo": {}}


def test_a_compiled_bench_line_prices_each_bucket_at_its_own_sizes_rate():
    # dit_xs width 64 depth 2: 6 buckets, 176,128 matrix elements (test above); the compiled frobenius passes move
    # 28 B per element (and the factors). Flat: every bucket at 1e9 B/s. Steep: the rate proportional to the
    # bucket's elements, 1e9 at 16,384, so every bucket's passes take 28 x 16,384 / 1e9 s whatever its size: the
    # line changes by 6 x 16,384 / 176,128 (the factors' bytes: < 0.3%)
    log = ("# optimizer step benchmark: dit_xs width 64 depth 2\n"
           "| periodic_rowwise non-refresh step, rownorm_scale=frobenius, compile_rownorm | 1.0 |  |\n")

    def line(fused_buckets) -> float:
        (row,) = calibration_rows(_fused_only_profile(fused_buckets), log, None)
        return row[3]
    flat = line([[1, 1, 1, 1e9], [1, 1, 2**30, 1e9]])
    steep = line([[1, 1, 1, 1e9 / 16384], [1, 1, 2**30, 1e9 * 2**30 / 16384]])
    assert flat == pytest.approx(28 * 176128 / 1e9, rel=5e-3)
    assert steep / flat == pytest.approx(6 * 16384 / 176128, rel=5e-3)


def test_a_momentum_pass_at_half_the_update_pass_rate_doubles_only_the_momentum_line():
    # bench_optimizer's phases of the compiled frobenius step (dit_xs width 64 depth 2): each pass at 1e9 B/s at
    # every size, then the momentum pass at 5e8: its line doubles, the update and direction lines stay
    log = ("# optimizer step benchmark: dit_xs width 64 depth 2\n"
           "phases (median ms): periodic_rowwise non-refresh compiled: adamw 1, direction 1, momentum 1, update 1\n")

    def lines(momentum_rate: float) -> dict:
        rows = [[1, 1, 1, momentum_rate], [1, 1, 2**30, momentum_rate]]
        passes = {"_momentum": rows, "_update": [[1, 1, 1, 1e9], [1, 1, 2**30, 1e9]]}
        return {phase: counted for _, phase, counted, _ in phase_rows(_fused_only_profile(fused_passes=passes), log)}
    same, half = lines(1e9), lines(5e8)
    assert same["momentum"] == pytest.approx(8 * 176128 / 1e9, rel=5e-3)  # G, M read: 8 B per element
    assert half["momentum"] == pytest.approx(2 * same["momentum"])
    assert (half["update"], half["direction"]) == (same["update"], same["direction"])
    assert same["update"] > 0


def test_a_profile_measured_before_the_rates_by_bucket_prices_the_compiled_passes_as_before():
    import json
    import os

    from benchmarks.op_cost import seconds
    from conftest import ROOT

    with open(os.path.join(ROOT, "docs", "cost_model", "idle_host_profile.json")) as f:
        measured = json.load(f)
    ops = measured["compute"]["2"]["ops"]  # one process of the 2-core host: 2 threads
    rates = host_profile(measured, 1).op_rates()
    assert "fused_buckets" not in ops and rates.fused_by_size == () and rates.fused == ops["fused"]
    fused = [r for r in counted_records(model_shapes("dit_xs", 64, 2), "rownorm", "frobenius", "compiled")
             if r.category == "fused"]
    assert len(fused) == 12 and all(r.elements for r in fused)
    assert all(seconds(r, rates) == pytest.approx(r.bytes / ops["fused"] + ops["op_s"]) for r in fused)
