"""The matrix optimizers on dim-0 shards (docs/algorithms.md §6–7, optim/sharded_optimizer.py), on CPU/gloo with 2, 3
and 4 processes (a 1-D mesh) and 4 processes as a 2 x 2 HSDP mesh (replicate x shard: every collective within the
shard group): every optimizer and both whole-matrix modes give the single-process update at every step on the same
gradients (4 steps: refresh, two RowNorm steps, refresh for periodic_rowwise), Muon bit for bit, on both meshes;
the counted bytes equal the analytic expectation per collective and rank; each direction is computed once in owner
mode and on every rank in gather mode.

The matrices cover wide, tall and square shapes; shape groups of 1, 2 and 5 matrices (owner mode: fewer matrices
than ranks, and 5 = 2 x 2 + 1 = 3 + 2 = 4 + 1, never a multiple of the ranks, so exchanges of W and a shorter
last one); same-shape batches split across gather buckets; and shards that are uneven or empty (3 ranks: 50 ->
17/17/16 rows, 4 -> 2/2/0, 2 -> 1/1/0, 1 -> 1/0/0; 2 ranks: 1 -> 1/0; 4 ranks: 50 -> 13/13/13/11, 2 -> 1/1/0/0).
The compiled RowNorm cases run on COMPILED_SHAPES only (a wide bucket, tall matrices with uneven and empty shards)
and on 3 ranks only (COMPILED_WORLD): each shard shape is an inductor kernel to build on every rank. One spawn per
group size runs its cases (process start-up and compiles are the cost; 4 ranks: both meshes); the parent compares.
"""

import functools
import math

import pytest
import torch

from conftest import gloo_group, spawn_ranks

from dit_train.optim.collectives import shard_rows
from dit_train.optim.directions import MUD, NS5, RowNorm
from dit_train.optim.matrix_optimizer import MatrixOptimizer
from dit_train.optim.registry import build_optimizer
from dit_train.optim.owner_exchange import plan_exchanges
from dit_train.optim.whole_matrix_exchange import plan_buckets

SHAPES = [(24, 40), (24, 40), (40, 24), (40, 24), (32, 32), (4, 3), (2, 16), (1, 8), (50, 12)] + [(12, 20)] * 5
# The compiled cases build one inductor kernel per pass, bucket (shape group) and local shard shape on every rank:
# ~1 s each with a warm cache, ~5 s cold, two thirds of this file's time over all of SHAPES. They run on a wide
# bucket of 2 (rows split), a tall matrix with uneven shards (column sums travel) and a tall one with an empty
# shard on 3 ranks; the eager RowNorm cases cover every shape of SHAPES with the same sums and exchanges.
COMPILED_SHAPES = [(24, 40), (24, 40), (50, 12), (4, 3)]
# ... on 3 ranks, where those shards are 8/8/8 rows (wide), 17/17/16 (tall, uneven) and 2/2/0 (empty). The kernels
# are local to a shard; what crosses ranks (the column sums of squares, the spectral cap's power iteration) goes
# through the same reduce as in the eager RowNorm cases, which run on 2, 3 and 4 ranks and on the 2 x 2 mesh. On 2
# and 4 ranks and the mesh the compiled cases only built kernels for other shard shapes: the first compile in a
# rank alone is ~8 s of CPU, and the 4-rank spawn's compiled cases were half of its time (measured 30 of 67 s).
COMPILED_WORLD = 3
STEPS = 4
LR, WD = 0.02, 0.1


def kind_kwargs(kind, ns_dtype="bf16", rownorm_scale="spectral", compile_rownorm="auto", **rest):
    """The optimizer's direction objects for `kind` (adamw: every parameter in the AdamW group), plus `rest`."""
    ns5, rownorm = NS5(dtype=ns_dtype), RowNorm(rownorm_scale, compile_rownorm)
    return {**{"adamw": {}, "muon": dict(direction=ns5),
               "periodic_rowwise": dict(direction=ns5, between=rownorm, refresh_every=3),
               "rownorm": dict(direction=rownorm), "mud": dict(direction=MUD())}[kind], **rest}


SMALL = 0.003  # gather mode's bucket_mb: ~3 KB buckets, so same-shape batches are split over several buckets
# name -> (optimizer, group kwargs shared with the single-process reference, placement kwargs)
FROBENIUS = {"rownorm_scale": "frobenius"}
EAGER = {"compile_rownorm": False}  # the RowNorm passes as torch ops: what CUDA runs (compile_rownorm auto)
CASES = {
    "adamw": ("adamw", {}, {}),
    "muon/gather": ("muon", {}, {"distributed_mode": "gather"}),
    "muon/owner": ("muon", {}, {}),  # owner mode is the default
    "muon/gather/fp32/buckets": ("muon", {"ns_dtype": "fp32"}, {"gather_dtype": "fp32", "bucket_mb": SMALL,
                                                                    "distributed_mode": "gather"}),
    "muon/owner/fp32": ("muon", {"ns_dtype": "fp32"}, {"gather_dtype": "fp32", "distributed_mode": "owner"}),
    # the paper's frobenius RowNorm scale, named (the default is spectral)
    "periodic_rowwise/gather/buckets": ("periodic_rowwise", {**FROBENIUS, **EAGER},
                                        {"bucket_mb": SMALL, "distributed_mode": "gather"}),
    "periodic_rowwise/owner": ("periodic_rowwise", {**FROBENIUS, **EAGER}, {"distributed_mode": "owner"}),
    "rownorm": ("rownorm", {**FROBENIUS, **EAGER}, {}),
    "mud/gather": ("mud", {}, {"gather_dtype": "fp32", "distributed_mode": "gather"}),
    "mud/owner": ("mud", {}, {"gather_dtype": "fp32", "distributed_mode": "owner"}),
    # the spectral RowNorm scale (optim/spectral_cap.py) on rank-1 gradients, where its cap is active
    "rownorm/spectral": ("rownorm", {"rownorm_scale": "spectral", **EAGER}, {}),
    "periodic_rowwise/spectral/owner": ("periodic_rowwise", {"rownorm_scale": "spectral", **EAGER},
                                        {"distributed_mode": "owner"}),
    # RowNorm's elementwise passes compiled (optim/fused_rownorm.py): the same column sums travel
    "periodic_rowwise/spectral/compiled": ("periodic_rowwise", {"rownorm_scale": "spectral"},
                                           {"compile_rownorm": True}),
    # ... and with the frobenius scale, where U is never formed (the update recomputes it from G and M)
    "periodic_rowwise/compiled": ("periodic_rowwise", FROBENIUS, {"compile_rownorm": True}),
}


def shapes_of(name=""):
    return COMPILED_SHAPES if name.endswith("/compiled") else SHAPES


def cases_on(world, replicate=1):
    """The cases a spawn of `world` ranks runs (on a replicate x shard mesh if replicate > 1)."""
    return [name for name in CASES
            if not name.endswith("/compiled") or (world == COMPILED_WORLD and replicate == 1)]


EAGER_CASES = [name for name in CASES if not name.endswith("/compiled")]  # on every world size and the mesh
COMPILED_CASES = [name for name in CASES if name.endswith("/compiled")]  # on COMPILED_WORLD ranks


def full_params(name=""):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=g) * 0.1 for s in shapes_of(name)], torch.randn(10, generator=g)


def step_grads(step, name=""):
    """Gaussian gradients; rank-1 ones for the spectral RowNorm cases (so that the momentum is low-rank)."""
    g = torch.Generator().manual_seed(100 + step)
    if "spectral" in name:
        return ([torch.randn(m, 1, generator=g) @ torch.randn(1, n, generator=g) for m, n in shapes_of(name)],
                torch.randn(10, generator=g))
    return [torch.randn(s, generator=g) for s in shapes_of(name)], torch.randn(10, generator=g)


def make_optimizer(cls, matrices, bias, name, **placement):
    kind, group_kw, _ = CASES[name]
    if kind == "adamw":
        return cls([{"params": [*matrices, bias], "kind": "adamw"}], lr=LR, weight_decay=WD)
    return cls([{"params": matrices, "kind": "matrix"}, {"params": [bias], "kind": "adamw"}], lr=LR,
               weight_decay=WD, **kind_kwargs(kind, **{**group_kw, **placement}))


def _entry(rank, world, port, fn, args):
    """One rank of a spawned gloo group: run fn(rank, world, *args) inside it."""
    with gloo_group(rank, world, port):
        fn(rank, world, *args)


def spawn(fn, world: int, *args, timeout: float = 240.0) -> None:
    """Run fn(rank, world, *args) (a module-level function) on `world` spawned gloo ranks."""
    spawn_ranks(_entry, world, (fn, args), timeout)


def run_cases(rank, world, out_path, replicate=1):
    """Every case on DTensor parameters, Shard(0) on a 1-D mesh or (Replicate, Shard(0)) on a replicate x shard
    mesh (FSDP2's HSDP layout); rank 0 saves the full parameters after the last step and every rank's per-step
    timer output, number of whole-matrix directions computed and local shards after each step."""
    import torch.distributed as dist
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from dit_train.optim.sharded_optimizer import ShardedMatrixOptimizer
    from dit_train.parallel.fsdp import ParallelPlan, fsdp_mesh
    from dit_train.telemetry.clocks import PhaseTimer

    mesh = fsdp_mesh(ParallelPlan(sharded=True, replicate=replicate), "cpu")
    placements = [Shard(0)] if replicate == 1 else [Replicate(), Shard(0)]
    shard = lambda t: distribute_tensor(t, mesh, placements)  # noqa: E731
    results = {}
    for name in cases_on(world, replicate):
        placement = CASES[name][2]
        W, b = full_params(name)
        ps = [torch.nn.Parameter(shard(w)) for w in W]
        pb = torch.nn.Parameter(shard(b))
        opt = make_optimizer(ShardedMatrixOptimizer, ps, pb, name, **placement)
        timer = PhaseTimer()
        opt.use_timer(timer)
        log, steps = [], []
        for step in range(STEPS):
            G, gb = step_grads(step, name)
            for p, g in zip(ps, G):
                p.grad = shard(g)
            pb.grad = shard(gb)
            timer.collect()
            opt.step()
            log.append((timer.collect(), opt.last_whole_matrices))
            steps.append([p.detach().to_local().clone() for p in ps + [pb]])  # no collective per step
        full = [p.detach().full_tensor() for p in ps] + [pb.detach().full_tensor()]
        logs, shards = [None] * world, [None] * world
        dist.all_gather_object(logs, log)
        dist.all_gather_object(shards, steps)
        results[name] = {"params": full, "logs": logs, "shards": shards}
    if rank == 0:
        torch.save(results, out_path)


def run_cases_on_both_meshes(rank, world, out_1d, out_hsdp):
    """Every case on the 1-D mesh, then on the 2 x 2 (replicate, shard) mesh, in one group: one start-up and one
    compile of the compiled cases per rank instead of two."""
    run_cases(rank, world, out_1d)
    run_cases(rank, world, out_hsdp, replicate=2)


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    """{"1d": results on 4 ranks, "hsdp": results on the 2 x 2 mesh}, from one spawn."""
    folder = tmp_path_factory.mktemp("four_ranks")
    spawn(run_cases_on_both_meshes, 4, str(folder / "1d.pt"), str(folder / "hsdp.pt"))
    return {mesh: torch.load(folder / f"{mesh}.pt", weights_only=True) for mesh in ("1d", "hsdp")}


@pytest.fixture(scope="module")
def three_ranks(tmp_path_factory):
    """Every case on COMPILED_WORLD = 3 ranks, the compiled ones too, from one spawn."""
    out = tmp_path_factory.mktemp("sharded3") / "results.pt"
    spawn(run_cases, COMPILED_WORLD, str(out))
    return torch.load(out, weights_only=True)


@pytest.fixture(scope="module", params=[2, 3, 4], ids=["2ranks", "3ranks", "4ranks"])
def sharded(request, tmp_path_factory):
    world = request.param
    if world == 4:
        return world, request.getfixturevalue("four_ranks")["1d"]
    if world == COMPILED_WORLD:
        return world, request.getfixturevalue("three_ranks")
    out = tmp_path_factory.mktemp(f"sharded{world}") / "results.pt"
    spawn(run_cases, world, str(out))
    return world, torch.load(out, weights_only=True)


def reference_run(build, grads_at, name="", trace=None):
    """A single process on whole tensors from full_params(name): `build(matrices, bias)` makes the optimizer,
    `grads_at(step)` gives (matrix gradients, bias gradient) for STEPS steps (a None gradient: that matrix has none
    this step). Returns the final parameters, bias last; `trace` (a list) receives a copy of them after each step."""
    W, b = full_params(name)
    ps = [torch.nn.Parameter(w.clone()) for w in W]
    pb = torch.nn.Parameter(b.clone())
    opt = build(ps, pb)
    for step in range(STEPS):
        G, gb = grads_at(step)
        for p, g in zip(ps, G):
            p.grad = g
        pb.grad = gb
        opt.step()
        opt.zero_grad(set_to_none=True)
        if trace is not None:
            trace.append([p.detach().clone() for p in ps + [pb]])
    return [p.detach() for p in ps] + [pb.detach()]


@functools.cache  # every world size and the HSDP mesh compare with the same reference (read only)
def single_process_steps(name, **group_kw):
    """The reference: MatrixOptimizer on whole tensors, same gradients (group_kw: overrides of the case's); the
    parameters after every step and at the start."""
    W, b = full_params(name)
    steps = []
    reference_run(lambda ps, pb: make_optimizer(MatrixOptimizer, ps, pb, name, **group_kw),
                  lambda step: step_grads(step, name), name, trace=steps)
    return steps, W + [b]


def single_process(name, **group_kw):
    """The reference's final parameters and the start."""
    steps, start = single_process_steps(name, **group_kw)
    return steps[-1], start


def steps_of(shards, ranks):
    """Every step's whole parameters from the local shards of `ranks` (one shard group, in rank order)."""
    return [[torch.cat([shards[r][step][i] for r in ranks]) for i in range(len(shards[ranks[0]][step]))]
            for step in range(STEPS)]


# Bounds, relative to the reference's movement, from every case on 2, 3 and 4 ranks and the 2 x 2 mesh (whose numbers
# are its 2-rank shard group's, digit for digit). One step's update, |dW - dW_ref| / |dW_ref|: at most 1.3e-6 (fp32
# NS5 in batches of another size), 9.4e-7 on RowNorm steps (column sums of squares added shard by shard, the
# spectral cap's power iteration, the compiled kernels' contracted multiply-adds), 6e-7 in AdamW (torch's fused
# kernel on shards of other lengths), 1.5e-7 on a later bf16 refresh (its input differs by that rounding): STEP_RTOL
# is ~8x above, and a 1e-4 scale error in an update is 10x above it. After 4 steps, |W - W_ref| / |W_ref - W_0|:
# at most 7.6e-7.
STEP_RTOL, FINAL_RTOL = 1e-5, 2e-5


def assert_steps_equal_single_process(name, got_steps, final, where):
    """Every step's update against the single process's (bit for bit where the inputs are: Muon with bf16 NS5, and
    periodic_rowwise's first refresh, computed from the same start), and the final parameters (the full_tensor()
    of the DTensors, `final`) against both the reference and the shards."""
    ref_steps, start = single_process_steps(name)
    kind, group_kw, _ = CASES[name]
    bf16 = kind in ("muon", "periodic_rowwise") and group_kw.get("ns_dtype", "bf16") == "bf16"
    refresh = refresh_steps(kind)
    for step, (got, ref) in enumerate(zip(got_steps, ref_steps)):
        got0, ref0 = (start, start) if step == 0 else (got_steps[step - 1], ref_steps[step - 1])
        exact = bf16 and (kind == "muon" or step == 0)
        what = "refresh" if refresh[step] else "RowNorm"
        for i, (a, r, a0, r0) in enumerate(zip(got, ref, got0, ref0)):
            at = f"{name}, {where}, step {step} ({what}), parameter {i} of shape {tuple(r.shape)}"
            assert a.shape == r.shape, at
            if exact:
                assert torch.equal(a, r), f"{at}: max difference {(a - r).abs().max().item():.2e}"
            else:
                rel = (((a - a0) - (r - r0)).norm() / (r - r0).norm()).item()
                assert rel <= STEP_RTOL, f"{at}: the step's update differs by {rel:.2e} relative"
    for i, (a, s, r, w0) in enumerate(zip(final, got_steps[-1], ref_steps[-1], start)):
        assert torch.equal(a, s), (name, where, i)
        rel = ((a - r).norm() / (r - w0).norm()).item()
        assert rel <= FINAL_RTOL, f"{name}, {where}, parameter {i} of shape {tuple(r.shape)}: relative error {rel:.2e}"


# ---- equality with the single process ---------------------------------------------------------------------------
@pytest.mark.parametrize("name", EAGER_CASES)
def test_sharded_steps_equal_single_process(sharded, name):
    """Muon with bf16 NS5 (the default) reads bit-identical inputs (gather_dtype bf16), computes each matrix's
    direction alone in its batch, and the update is elementwise on the rows: the parameters are bit for bit the
    single process's after every step, in both modes (and after periodic_rowwise's first refresh). Where sums run
    over shards (RowNorm and MUD on tall matrices, the spectral RowNorm scale), directions are fp32 or the RowNorm
    passes compiled, every step's update agrees with the single process's to fp32 rounding (STEP_RTOL), and so do
    the parameters after the last step (FINAL_RTOL, relative to the distance moved)."""
    world, results = sharded
    steps = steps_of(results[name]["shards"], list(range(world)))
    assert_steps_equal_single_process(name, steps, results[name]["params"], f"{world} ranks")


@pytest.mark.parametrize("name", COMPILED_CASES)
def test_compiled_rownorm_on_uneven_and_empty_shards_equals_single_process_and_counts_its_bytes(three_ranks, name):
    """The compiled RowNorm passes on COMPILED_WORLD = 3 ranks (why only there: COMPILED_WORLD): every step within
    the bounds of the eager cases, and the bytes the analytic expectation (test_sharded_steps_equal_single_process
    and test_counted_bytes_equal_the_analytic_expectation for them)."""
    results = three_ranks
    world = COMPILED_WORLD
    steps = steps_of(results[name]["shards"], list(range(world)))
    assert_steps_equal_single_process(name, steps, results[name]["params"], f"{world} ranks")
    assert_counted_bytes(name, world, results)


# ---- HSDP: a 2 x 2 (replicate, shard) mesh ------------------------------------------------------------------
@pytest.fixture(scope="module")
def hsdp(four_ranks):
    return four_ranks["hsdp"]


@pytest.mark.parametrize("name", EAGER_CASES)
def test_hsdp_steps_equal_single_process_replicas_agree_and_bytes_stay_in_the_shard_group(hsdp, name):
    """Ranks 0, 1 and 2, 3 are the shard groups (2 ranks each), ranks 0, 2 and 1, 3 replicas of each other. Every
    step equals the single process with the bounds of the 1-D mesh (the replicas get the same gradients and every
    collective runs within a shard group of 2: the numbers are those of 2 ranks, digit for digit); replicas hold
    bit-identical shards after every step (they computed the same update from the same gradients); every rank
    counts the bytes of a 2-rank shard group. The replicas' gradient average is FSDP2's, in backward:
    test_hsdp_train.py compares it with one process (a 1e-4 scale error there moves train/grad_norm 10x its bound)."""
    got = hsdp[name]
    shards = got["shards"]
    for rank in (0, 1):
        for step in range(STEPS):
            assert all(torch.equal(a, b) for a, b in zip(shards[rank][step], shards[rank + 2][step])), \
                (name, rank, step)
    assert_steps_equal_single_process(name, steps_of(shards, [0, 1]), got["params"], "2x2 mesh")
    kind = CASES[name][0]
    for rank, log in enumerate(got["logs"]):
        for step, ((timings, _), refresh) in enumerate(zip(log, refresh_steps(kind))):
            counted = {k.split("/", 1)[1]: v for k, v in timings.items()
                       if k.startswith("comm_bytes/") and k != "comm_bytes/total"}
            assert counted == expected_bytes(name, 2, rank % 2, refresh), (name, rank, step)


# ---- counted bytes --------------------------------------------------------------------------------------------
def refresh_steps(kind):
    return {"periodic_rowwise": [True, False, False, True], "rownorm": [False] * STEPS}.get(kind, [True] * STEPS)


def expected_bytes(name, world, rank, refresh):
    """Analytic bytes per collective this rank sends in one step (collectives.py's counting rules)."""
    kind, group_kw, placement = CASES[name]
    if world == 1 or kind == "adamw":  # AdamW is elementwise on the local shard
        return {}
    shapes = shapes_of(name)
    tall = [(m, n) for m, n in shapes if m > n]
    if kind == "rownorm" or (kind == "periodic_rowwise" and not refresh):
        sums = sum(4 * n for _, n in tall)  # one fp32 sum of squares per column; wide: nothing
        if group_kw.get("rownorm_scale") == "spectral":  # 3 power-iteration rounds (spectral_cap.py), fp32:
            sums += sum(4 * (3 * n + 1) for m, n in shapes if m <= n)  # rows split: R^T x (c = n) 3x, |x|^2 once
            sums += sum(4 * (2 * n + 1) for _, n in tall)  # columns split: R y (r = n) 2x, then |R^T x|^2
        return {"all_reduce": sums}
    out = {}
    whole = shapes
    if kind == "mud":  # tall: the Gram's lower triangle + column norms before and after the solve; wide: whole
        out["all_reduce"] = sum(4 * (n * (n + 1) // 2 + 2 * n) for _, n in tall)
        whole = [(m, n) for m, n in shapes if m <= n]
    b_in = 2 if placement.get("gather_dtype", "bf16") == "bf16" else 4
    b_out = 4 if kind == "mud" or group_kw.get("ns_dtype") == "fp32" else 2
    if placement.get("distributed_mode", "owner") == "gather":  # (p - 1) padded shards of every matrix
        out["all_gather"] = sum((world - 1) * math.ceil(m / world) * n * b_in for m, n in whole)
    else:  # to owners: my rows of others' matrices; back: the other ranks' rows of mine
        owners = owners_of(whole, world)
        sent = 0
        for i, (m, n) in enumerate(whole):
            mine = shard_rows(m, world)[rank][1]
            sent += (m - mine) * n * b_out if owners[i] == rank else mine * n * b_in
        out["all_to_all"] = sent
    return out


def owners_of(shapes, world, per_rank=1):
    """Owner rank of every matrix: shape groups in order of first appearance, as the optimizer stacks them, split
    into exchanges by plan_exchanges, each owning contiguous ranges in rank order."""
    groups = {}
    for s in shapes:
        groups[s] = (s, groups.get(s, (s, 0))[1] + 1)
    owner = {}
    for ex in plan_exchanges(groups, world, per_rank):
        for r in range(world):
            first, count = ex.owned(r)
            owner.update({(ex.key, j): r for j in range(first, first + count)})
    seen: dict = {}
    out = []
    for s in shapes:
        j = seen[s] = seen.get(s, -1) + 1
        out.append(owner[(s, j)])
    return out


@pytest.mark.parametrize("name", EAGER_CASES)
def test_counted_bytes_equal_the_analytic_expectation(sharded, name):
    world, results = sharded
    assert_counted_bytes(name, world, results)


def assert_counted_bytes(name, world, results):
    kind = CASES[name][0]
    for rank, log in enumerate(results[name]["logs"]):
        for step, ((timings, _), refresh) in enumerate(zip(log, refresh_steps(kind))):
            counted = {k.split("/", 1)[1]: v for k, v in timings.items()
                       if k.startswith("comm_bytes/") and k != "comm_bytes/total"}
            assert counted == expected_bytes(name, world, rank, refresh), (name, rank, step)
            assert timings.get("comm_bytes/total", 0.0) == sum(counted.values())
            phases = {"time/adamw"} if kind == "adamw" else {"time/momentum", "time/direction", "time/update"}
            assert phases <= set(timings)
            if counted:
                assert "time/comm" in timings  # the exposed wait is timed as its own phase


def test_the_spectral_cases_differ_from_the_frobenius_scale(sharded):
    """The cap was active in the spectral cases (else their equality with the single process would test nothing):
    on rank-1 momentum it cuts the RowNorm steps, so the weights move less than under the frobenius scale."""
    world, results = sharded
    for name in [n for n in ("rownorm/spectral", "periodic_rowwise/spectral/owner",
                             "periodic_rowwise/spectral/compiled") if n in results]:  # compiled: on 3 ranks
        frobenius, start = single_process(name, rownorm_scale="frobenius")
        for i, (a, f, w0) in enumerate(zip(results[name]["params"][:-1], frobenius, start)):
            if min(w0.shape) >= 12:  # rank-1 RowNorm has norm sqrt(r), well above the cap (<= 2) only for larger r
                assert (a - w0).norm() < 0.8 * (f - w0).norm(), (name, i, tuple(w0.shape))


def test_rownorm_on_wide_matrices_sends_nothing_and_tall_ones_n_floats():
    # the case table above in words: RowNorm's only traffic is n fp32 per tall matrix
    assert expected_bytes("rownorm", 3, 0, False) == {"all_reduce": 4 * (24 + 24 + 3 + 12)}


@pytest.mark.parametrize("name", ["muon/gather", "muon/owner", "periodic_rowwise/owner", "mud/owner"])
def test_owner_mode_computes_each_direction_once_gather_mode_on_every_rank(sharded, name):
    world, results = sharded
    kind, _, placement = CASES[name]
    n_whole = len([s for s in shapes_of(name) if kind != "mud" or s[0] <= s[1]])
    per_step = [sum(log[step][1] for log in results[name]["logs"]) for step in range(STEPS)]
    once = placement.get("distributed_mode", "owner") == "owner"
    expected = [(n_whole if once else world * n_whole) if r else 0 for r in refresh_steps(kind)]
    assert per_step == expected


def test_owner_mode_bytes_are_about_2_over_p_of_gather_mode():
    """Even shards (p divides every m): per rank on average 2 (p - 1) / p^2 of the matrices against (p - 1) / p."""
    shapes, world = [(64, 32), (32, 96), (96, 32), (64, 64)] * 2, 4
    gather = sum((world - 1) * (m // world) * n * 2 for m, n in shapes)
    owners = owners_of(shapes, world)
    per_rank = [0] * world
    for (m, n), o in zip(shapes, owners):
        for r in range(world):
            per_rank[r] += (m - m // world) * n * 2 if r == o else (m // world) * n * 2
    assert sum(per_rank) / world == pytest.approx(2 / world * gather)
    # owners are balanced by NS5 flops, not bytes: here the busiest rank sends 1.11x the mean
    assert max(per_rank) <= 1.25 * 2 / world * gather


# ---- pieces without processes ---------------------------------------------------------------------------------
def test_shard_rows_follow_torch_chunk_like_fsdp2():
    for m in range(0, 13):
        for p in range(1, 6):
            sizes = [len(c) for c in torch.chunk(torch.arange(m), p)] if m else []
            sizes += [0] * (p - len(sizes))
            rows = shard_rows(m, p)
            assert [r for _, r in rows] == sizes and sum(sizes) == m
            assert all(s == sum(sizes[:i]) for i, (s, _) in enumerate(rows) if rows[i][1])


def test_owner_rows_are_rearranged_as_rank_by_rank_chunks():
    """Owner mode's buffers hold rank 0's rows of every matrix of an exchange, then rank 1's... (torch.chunk
    shares: full, one shorter, empty): the batched views (_rank_major) read and write exactly what slicing each
    rank's rows in turn does, both ways, with uneven and empty shares."""
    from dit_train.optim.owner_exchange import _rank_major

    for m, world in [(50, 3), (50, 4), (64, 32), (12, 5), (4, 3), (2, 4), (1, 2), (7, 1), (33, 32)]:
        for count in (0, 1, 3):
            n = 5
            whole = torch.arange(count * m * n, dtype=torch.float32).view(count, m, n)
            rows_of = shard_rows(m, world)
            by_rank = torch.cat([whole[:, s:s + r].reshape(-1) for s, r in rows_of])
            flat = torch.full_like(by_rank, -1.0)
            for part, rows in _rank_major(flat, whole, rows_of):
                part.copy_(rows)
            assert torch.equal(flat, by_rank), (m, world, count)
            back = torch.full_like(whole, -1.0)
            for part, rows in _rank_major(by_rank, back, rows_of):
                rows.copy_(part)
            assert torch.equal(back, whole), (m, world, count)
            if count:
                assert len(_rank_major(flat, whole, rows_of)) <= 2  # one or two copies, not one per rank


def test_gather_buckets_keep_shapes_together_within_the_size():
    counts = {((512, 512),): 9, ((1536, 512),): 8, ((512, 2048),): 8}
    buckets = plan_buckets(counts, 2, 8 * 2**20)
    items = [it for b in buckets for it in b]
    assert len(items) == 25 and len(set(items)) == 25
    assert all(sum(math.prod(it.shape) * 2 for it in b) <= 8 * 2**20 for b in buckets)


@pytest.mark.parametrize("per_rank", [1, 2, 0])
@pytest.mark.parametrize("world", [2, 3, 4, 8, 32])
def test_owner_exchanges_cover_every_matrix_once_and_balance_flops(world, per_rank):
    """Each group is cut into exchanges of per_rank x world matrices (0: the whole group) that own contiguous rank
    ranges and cover the group once, in order; a shorter exchange gives q or q + 1 per rank, the extra matrices
    to the least-loaded ranks, so the busiest rank stays within one matrix (of the largest shape) of the mean:
    the schedule's ideal share (preset-like groups, 1 and 2 matrices included)."""
    from dit_train.optim.directions import ns5_flops

    shapes = {(512, 512): 9, (1536, 512): 8, (512, 2048): 8, (2048, 512): 7, (512, 256): 1, (1024, 512): 1}
    exchanges = plan_exchanges({s: (s, c) for s, c in shapes.items()}, world, per_rank)
    load, covered = [0] * world, {s: [] for s in shapes}
    for ex in exchanges:
        assert len(ex.counts) == world and max(ex.counts) - min(ex.counts) <= 1
        assert ex.size <= (per_rank * world if per_rank else shapes[ex.key])
        for r in range(world):
            first, count = ex.owned(r)
            covered[ex.key] += range(first, first + count)
            load[r] += count * ns5_flops(*ex.key)
    assert covered == {s: list(range(c)) for s, c in shapes.items()}
    biggest = max(ns5_flops(*s) for s in shapes)
    assert max(load) <= sum(load) / world + biggest
    assert max(load) - min(load) <= biggest


@pytest.mark.parametrize("key,value,valid", [
    ("distributed_mode", "ring", "gather, owner"),
    ("gather_dtype", "float16", "bf16, fp32"),
    ("bucket_mb", 0, "> 0"),
])
def test_placement_keys_are_validated(key, value, valid):
    from test_optim_optimizers import tiny_dit

    for name in ("muon", "periodic_rowwise", "mud"):
        with pytest.raises(ValueError) as e:
            build_optimizer(tiny_dit(), {"name": name, key: value})
        msg = str(e.value)
        assert "\n" not in msg and f"optimizer.{key}={value!r}" in msg and valid in msg, msg
    opt = build_optimizer(tiny_dit(), {"name": "muon", "distributed_mode": "owner", "bucket_mb": 4})
    assert type(opt) is MatrixOptimizer  # a single process ignores the placement keys


def test_split_row_norms_equal_row_inv_norms_with_a_reduce():
    """The batched RowNorm path (row_sumsq, one all-reduce for all tall buckets, inv_norms_from_sumsq) is the
    hooked one (row_inv_norms with reduce=) split in two: two column halves summed give the whole matrix's factors."""
    from dit_train.optim.directions import inv_norms_from_sumsq, row_inv_norms, row_sumsq

    X = torch.randn(3, 40, 12, generator=torch.Generator().manual_seed(0))
    top, bottom = X[:, :17], X[:, 17:]
    summed = row_sumsq(top, tall=True) + row_sumsq(bottom, tall=True)
    torch.testing.assert_close(inv_norms_from_sumsq(summed), row_inv_norms(X))
    torch.testing.assert_close(row_inv_norms(top, reduce=lambda t: t + row_sumsq(bottom, tall=True), tall=True),
                               row_inv_norms(X))
