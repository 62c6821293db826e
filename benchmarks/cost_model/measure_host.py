"""This host measured as a hardware profile of the cost model (`--measure-host`): GEMM rates by side, the
streaming rate, each op category's rate, NS5's own matmuls, gloo between processes and the Python per op of the
sharded step; and the profile of one of P processes sharing its cores (host_profile)."""

from __future__ import annotations

import math
import os
import sys
import threading

from benchmarks.cost_model.floor import ADAMW_BYTES
from benchmarks.cost_model.hardware import Hardware
from benchmarks.cost_model.shapes import rownorm_buckets
from benchmarks.ns5_gemm_rates import measure_ns5_gemms
from benchmarks.op_cost import (host_op_rates, measure_fused_rates, measure_matvec_rates, measure_op_rates,
                                median_seconds)
from benchmarks.sharded_python import measure_python


# benchmarks/host_profile.json: beside the benchmarks, not inside this package
HOST_PROFILE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "host_profile.json")
NS5_SIDES = (128, 256, 512, 1024)  # short sides at which the host's NS5 GEMM rate is measured
FUSED_SIZES = 4  # bucket sizes at which the compiled RowNorm passes are measured (two kernels compiled each)


def gemm_rates_by_side(threads: int) -> list[list]:
    """[[r, flop/s], ...] of the plain NS5 iteration's three bf16 bmm's on 8 x r x 4r, by short side r."""
    import torch

    torch.set_num_threads(threads)
    rates = []
    for r in NS5_SIDES:
        B, c = 8, 4 * r
        X, A = torch.randn(B, r, c).bfloat16(), torch.randn(B, r, r).bfloat16()
        seconds = median_seconds(lambda: (torch.bmm(X, X.mT), torch.bmm(A, A), torch.bmm(A, X)))
        rates.append([r, B * (4 * r * r * c + 2 * r ** 3) / seconds])
    return rates


def calibration_buckets() -> list[tuple[int, int, int]]:
    """The RowNorm step's buckets (B, m, n) on dit_m as shipped and as the calibration's bench_optimizer runs it
    (calibration_round.BENCH_OPTIMIZER's preset, width and depth): shapes.rownorm_buckets, the optimizer's own
    bucketing."""
    from benchmarks.calibration_round import BENCH_OPTIMIZER
    from dit_train.model.dit import load_preset

    def arg(flag: str) -> str:
        return BENCH_OPTIMIZER[BENCH_OPTIMIZER.index(flag) + 1]
    bench = load_preset(arg("--preset"), int(arg("--hidden-size")), int(arg("--depth")))
    return rownorm_buckets(load_preset("dit_m")) + rownorm_buckets(bench)


def spanning_buckets(buckets, sizes: int = FUSED_SIZES) -> list[tuple[int, int, int]]:
    """Up to `sizes` of the buckets (B, m, n), spanning their sizes (elements): for each of `sizes` sizes evenly
    spaced in log from the smallest bucket's to the largest's, the bucket nearest it in log size (ties: the
    smaller), each size once; ascending."""
    def size(b):
        return math.prod(b)
    found = sorted(set(buckets), key=lambda b: (size(b), b))
    lo, hi = math.log(size(found[0])), math.log(size(found[-1]))
    chosen: dict[int, tuple] = {}
    for i in range(sizes):
        target = lo + (hi - lo) * i / max(sizes - 1, 1)
        best = min(found, key=lambda b: (abs(math.log(size(b)) - target), size(b), b))
        chosen.setdefault(size(best), best)
    return sorted(chosen.values(), key=size)


def measure_compute(threads: int, fused_buckets: list[tuple[int, int, int]]) -> dict:
    """bf16 GEMM rates by short side r (the plain NS5 iteration's three bmm's on 8 x r x 4r), the streaming
    rate of torch's fused AdamW (28 B per element over 32M fp32 elements, far beyond the caches) and each op
    category's rate (op_cost.measure_op_rates), each compiled RowNorm pass's rate on each of `fused_buckets`
    ((B, m, n); op_cost.measure_fused_rates: the momentum and the update pass timed apart), the power iteration's
    vector-matrix products by layout on the same buckets (op_cost.measure_matvec_rates) and NS5's own
    matmuls (ns5_gemm_rates: every bmm/baddbmm it dispatches on a grid of shapes and batches, ~5 s of CPU at 1
    thread), `threads` threads."""
    import torch

    _progress(f"{threads} thread(s): GEMM rates by side")
    rates = gemm_rates_by_side(threads)
    params = [torch.zeros(4 << 20, requires_grad=True) for _ in range(8)]
    for p in params:
        p.grad = torch.randn_like(p)
    adamw = torch.optim.AdamW(params, lr=1e-3, fused=True)
    _progress(f"{threads} thread(s): fused AdamW")
    stream = median_seconds(adamw.step)
    del params, adamw
    _progress(f"{threads} thread(s): op categories (stream, convert, reduce, matvec, dispatch, square GEMMs)")
    ops = measure_op_rates(threads)
    _progress(f"{threads} thread(s): each compiled RowNorm pass on buckets (B, m, n) {fused_buckets} (compiles on "
              "the first run)")
    ops["fused_passes"] = measure_fused_rates(threads, fused_buckets)
    _progress(f"{threads} thread(s): the power iteration's vector-matrix products by layout on the same buckets")
    ops["matvec_by_layout"] = measure_matvec_rates(threads, fused_buckets)
    _progress(f"{threads} thread(s): NS5's own matmuls (op, layout, shape, batch)")
    return {"gemm_flops": max(rate for _, rate in rates), "ns5_rates": rates,
            "memory_bytes_s": ADAMW_BYTES * 32 * 2**20 / stream, "ops": ops, "ns5_gemms": measure_ns5_gemms(threads)}


def _progress(what: str) -> None:
    print(f"  measuring {what} ...", file=sys.stderr, flush=True)


def _gloo_rank(rank: int, world: int, port: int, queue, numel: int, work_numel: int, rounds: int) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from dit_train.parallel.fsdp import shutdown_process_group

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    try:
        inp = torch.zeros(numel)
        out = torch.empty(world * inp.numel())
        tiny = torch.zeros(1)
        gather = median_seconds(lambda: (dist.barrier(), dist.all_gather_into_tensor(out, inp)))
        barrier = median_seconds(dist.barrier)
        latency = median_seconds(lambda: (dist.all_reduce(tiny), dist.barrier())) - barrier
        busy = _busy_latency_s(tiny, work_numel, rounds)
        sent = (world - 1) * inp.numel() * 4  # what one rank sends (collectives.py's all-gather count)
        cpu = _collective_cpu(lambda: dist.all_gather_into_tensor(out, inp), sent, tiny, rounds)
        if rank == 0:
            queue.put({"link_bytes_s": sent / max(gather - barrier - latency, 1e-9), "latency_s": max(latency, 0.0),
                       "busy_latency_s": busy, **cpu})
        # every rank past its last collective, and rank 0 (the store's host) the last to leave
        shutdown_process_group()
    finally:
        if dist.is_initialized():  # an exception before the shutdown: leave without waiting for the others
            dist.destroy_process_group()


def _busy_latency_s(tiny, work_numel: int, rounds: int) -> float:
    """The cost of a collective between processes that compute between collectives, as the optimizer's ranks do
    (when processes outnumber the cores, a peer may be descheduled when the others arrive): every rank runs
    `rounds` x (an add over work_numel fp32 elements, a 4-byte all-reduce), against the same adds alone, all
    ranks at once in both; the difference per round."""
    import torch
    import torch.distributed as dist

    a, b = torch.randn(work_numel), torch.randn(work_numel)
    work = lambda: torch.add(a, b, out=a)  # noqa: E731
    alone = median_seconds(lambda: (dist.barrier(), [work() for _ in range(rounds)], dist.barrier()))
    synced = median_seconds(lambda: (dist.barrier(), [(work(), dist.all_reduce(tiny)) for _ in range(rounds)],
                                      dist.barrier()))
    return max(synced - alone, 0.0) / rounds


def other_threads_cpu_s() -> float | None:
    """CPU seconds run so far by this process's threads other than the calling one (Linux schedstat; None where it
    cannot be read): on a benchmark rank's main thread, gloo's worker and transport threads (torch's intra-op pool
    is idle between ops)."""
    me, total = threading.get_native_id(), 0
    try:
        for tid in os.listdir("/proc/self/task"):
            if int(tid) != me:
                with open(f"/proc/self/task/{tid}/schedstat") as f:
                    total += int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return total / 1e9


def _collective_cpu(gather, sent: int, tiny, calls: int) -> dict:
    """The CPU gloo's own threads spend on one rank for a collective (sharded_schedule charges it to the compute
    an asynchronous collective overlaps): {"cpu_s_per_call": a 4-byte all-reduce's, "cpu_s_per_byte": the
    all-gather's beyond that, per byte this rank sends (as many arrive)}, each less a barrier's, over `calls`
    calls; {} where the threads' CPU cannot be read."""
    import torch.distributed as dist

    def per_call(fn) -> float | None:
        dist.barrier()
        start = other_threads_cpu_s()
        for _ in range(calls):
            fn()
            dist.barrier()
        end = other_threads_cpu_s()
        return None if start is None or end is None else (end - start) / calls

    barrier, call, gathered = per_call(lambda: None), per_call(lambda: dist.all_reduce(tiny)), per_call(gather)
    if barrier is None or call is None or gathered is None:
        return {}
    return {"cpu_s_per_call": max(call - barrier, 0.0), "cpu_s_per_byte": max(gathered - barrier - call, 0.0) / sent}


def measure_gloo(world: int, numel: int = 4 << 20, work_numel: int = 1 << 18, rounds: int = 20) -> dict:
    """gloo between `world` processes on this host: the bytes/s one rank sends in an all-gather, the fixed cost
    of a collective (a 4-byte all-reduce) between otherwise idle processes, its cost between processes that
    compute between collectives (busy_latency_s), and the CPU gloo's threads spend per collective and per byte
    (_collective_cpu): numel fp32 elements gathered per rank (16 MB), work_numel per add between rounds of the
    busy measure (1 MB, ~0.1-1 ms), `rounds` of it and of each CPU measure (tests shrink them)."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # forked from a server process: one that imported torch already (the test suite's, tests/conftest.py) saves
    # every rank the import "spawn" repeated; otherwise the same fresh processes
    ctx = mp.get_context("forkserver")
    queue = ctx.Queue()
    mp.start_processes(_gloo_rank, args=(world, port, queue, numel, work_numel, rounds), nprocs=world,
                       start_method="forkserver")
    return queue.get(timeout=10)


# a host profile's keys, as measure_host writes them; --calibrate reads the first three
PROFILE_KEYS = ("cores", "compute", "gloo", "python", "load_average")
REQUIRED_PROFILE_KEYS = PROFILE_KEYS[:3]


def profile_problem(measured) -> str | None:
    """Why a loaded host profile cannot be used (None if it can): not an object, or required keys missing."""
    if not isinstance(measured, dict):
        return f"holds a JSON {type(measured).__name__}, not an object"
    missing = [k for k in REQUIRED_PROFILE_KEYS if k not in measured]
    if missing:
        return f"lacks the key(s) {', '.join(missing)}"
    return None


def measure_host(worlds=(2, 4)) -> dict:
    cores = os.cpu_count() or 1
    threads = sorted({1, cores})
    fused = spanning_buckets(calibration_buckets())
    compute = {str(t): measure_compute(t, fused) for t in threads}
    gloo, python = {}, {}
    for w in worlds:
        _progress(f"gloo between {w} processes")
        gloo[str(w)] = measure_gloo(w)
        _progress(f"Python per op of the sharded step, rank 0 of {w} (shrunk model)")
        python[str(w)] = measure_python(w)
    return {"cores": cores, "compute": compute, "gloo": gloo, "python": python,
            "load_average": list(os.getloadavg())}


def core_share(measured: dict, procs: int) -> float:
    """The share of a core each of bench_distributed's threads gets on this host: `procs` processes of
    cores // procs threads (at least one each)."""
    cores = measured["cores"]
    return min(1.0, cores / (procs * max(1, cores // procs)))


def core_slots(measured: dict, procs: int) -> float | None:
    """How many of `procs` processes (cores // procs threads each, at least one) run at full speed at once on this
    host's cores: cores / threads where the processes' threads outnumber the cores (sharded_schedule.simulate
    shares the cores among those computing), None where every thread has a core."""
    cores = measured["cores"]
    threads = max(1, cores // procs)
    return cores / threads if procs * threads > cores else None


def host_profile(measured: dict, processes: int = 1, share: float | None = None) -> Hardware:
    """This host as the profile of one of `processes` processes sharing its cores, each with the benchmarks'
    cores // processes threads (at least one): rates of that thread count, times `share`: by default the share
    of the cores a process gets when all compute at once and there are more threads than cores (core_share);
    1 for a replay that shares the cores itself (core_slots)."""
    threads = max(1, measured["cores"] // processes)
    share = core_share(measured, processes) if share is None else share
    rates = measured["compute"][str(threads)]
    if "ops" not in rates:
        raise ValueError("the host profile has no op rates (measured before op_cost.py): run --measure-host again")
    gloo = measured["gloo"].get(str(processes), {"link_bytes_s": float("inf"), "latency_s": 0.0})
    ops = host_op_rates(rates["ops"], rates["ns5_rates"], rates["memory_bytes_s"],
                        rates.get("ns5_gemms", ())).shared(share)
    return Hardware(f"this host ({processes} process(es) x {threads} thread(s))", rates["gemm_flops"] * share,
                    mfu=1.0, ns5_of_peak=1.0, memory_bytes_s=rates["memory_bytes_s"] * share, memory_efficiency=1.0,
                    intra_bytes_s=gloo["link_bytes_s"], inter_bytes_s=gloo["link_bytes_s"], link_efficiency=1.0,
                    devices_per_node=max(processes, 1), latency_s=gloo["latency_s"], launch_s=0.0,
                    rownorm_kernels="eager", ns5_rates=tuple((r, f * share) for r, f in rates["ns5_rates"]), ops=ops)
