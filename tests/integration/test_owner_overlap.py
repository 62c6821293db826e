"""Owner mode's exchange behind backward (optimizer.overlap_exchange, optim/backward_overlap.py) on the optimizer
alone, on 2 and 3 CPU/gloo ranks: the hooks are called as FSDP2 calls them (after setting each sharded gradient,
in reverse parameter order, like a backward), and the parameters after 4 steps equal the run without overlap and
the single process bit for bit (muon, bf16 U; periodic_rowwise: overlap equals no overlap), for test_sharded_optim's shapes: shape groups of 1, 2 and 5
matrices, never a multiple of the ranks, and uneven or empty shards. Cases: the prefetch used on every refresh
step; dropped because clipping scaled the gradients, a matrix without a gradient, or a second backward before the
step (the step then exchanges itself). The training loop with FSDP2 itself is
tests/integration/test_backward_overlap.py.
"""

import pytest
import torch

from test_sharded_optim import LR, STEPS, WD, full_params, reference_run, spawn, step_grads

from dit_train.optim.directions import NS5, RowNorm
from dit_train.optim.matrix_optimizer import MatrixOptimizer

# name -> (optimizer kwargs, what happens before each step)
CASES = {
    "used": ({"direction": NS5()}, "unscaled"),
    "periodic_rowwise": ({"direction": NS5(), "between": RowNorm(), "refresh_every": 3}, "unscaled"),
    "clipped": ({"direction": NS5()}, "scaled"),
    "missing_grad": ({"direction": NS5()}, "missing"),
    "second_backward": ({"direction": NS5()}, "twice"),
}
MISSING = 6  # the (2, 16) matrix: a group of one loses its only member on odd steps


def grads_of(step, event):
    G, gb = step_grads(step)
    if event == "missing" and step % 2:
        G[MISSING] = None
    return G, gb


def make(cls, ps, pb, kw, **placement):
    return cls([{"params": ps, "kind": "matrix"}, {"params": [pb], "kind": "adamw"}], lr=LR, weight_decay=WD,
               **kw, **placement)


def backward(ps, pb, G, gb, shard, hooks: bool):
    """Set the sharded gradients and, as FSDP2 does after each reduce-scatter, call the post-accumulate hooks."""
    pb.grad = shard(gb)
    for p, g in reversed(list(zip(ps, G))):
        p.grad = None if g is None else shard(g)
        if hooks and g is not None:
            for hook in p._post_accumulate_grad_hooks.values():
                hook(p)


def run_cases(rank, world, out_path):
    import torch.distributed as dist
    from torch.distributed.tensor import Shard, distribute_tensor

    from dit_train.optim.sharded_optimizer import ShardedMatrixOptimizer
    from dit_train.parallel.fsdp import ParallelPlan, fsdp_mesh
    from dit_train.telemetry.clocks import PhaseTimer

    mesh = fsdp_mesh(ParallelPlan(sharded=True), "cpu")
    shard = lambda t: distribute_tensor(t, mesh, [Shard(0)])  # noqa: E731
    results = {}
    for name, (kw, event) in CASES.items():
        for on in (True, False):
            W, b = full_params()
            ps = [torch.nn.Parameter(shard(w)) for w in W]
            pb = torch.nn.Parameter(shard(b))
            opt = make(ShardedMatrixOptimizer, ps, pb, kw, distributed_mode="owner", overlap_exchange=on)
            used = []
            for step in range(STEPS):
                G, gb = grads_of(step, event)
                for _ in range(2 if event == "twice" else 1):
                    backward(ps, pb, G, gb, shard, hooks=on)
                opt.gradients_scaled(event == "scaled")
                opt.step()
                used.append(opt.step_info().get("opt/exchanged_in_backward"))
                opt.zero_grad(set_to_none=True)
            full = [p.detach().full_tensor() for p in ps] + [pb.detach().full_tensor()]
            results[(name, on)] = {"params": full, "used": used}
    if rank == 0:
        torch.save(results, out_path)
    dist.barrier()


@pytest.fixture(scope="module", params=[2, 3], ids=["2ranks", "3ranks"])
def sharded(request, tmp_path_factory):
    world = request.param
    out = tmp_path_factory.mktemp(f"owner_overlap{world}") / "results.pt"
    spawn(run_cases, world, str(out))
    return world, torch.load(out, weights_only=False)


def single(name):
    """The single-process reference on the same gradients (None where a matrix has none)."""
    kw, event = CASES[name]
    return reference_run(lambda ps, pb: make(MatrixOptimizer, ps, pb, kw), lambda step: grads_of(step, event))


@pytest.mark.parametrize("name", list(CASES))
def test_overlap_equals_no_overlap_and_the_single_process_bit_for_bit(sharded, name):
    world, results = sharded
    on, off, ref = results[(name, True)]["params"], results[(name, False)]["params"], single(name)
    for i, (a, b, r) in enumerate(zip(on, off, ref, strict=True)):
        where = f"{name}, {world} ranks, parameter {i} of shape {tuple(r.shape)}"
        assert torch.equal(a, b), f"{where}: overlap differs from no overlap by {(a - b).abs().max().item():.2e}"
        if name != "periodic_rowwise":  # RowNorm sums over shards: equal to fp32 rounding (test_sharded_optim)
            assert torch.equal(b, r), f"{where}: differs from the single process by {(b - r).abs().max().item():.2e}"


# matrices whose inbound all-to-all started in backward, per step: all 14 on a refresh step, none where the
# prefetch is dropped (periodic_rowwise K=3: refresh, RowNorm, RowNorm, refresh; the hooks do nothing on RowNorm
# steps); a missing gradient drops it on odd steps only
USED = {"used": [14] * 4, "periodic_rowwise": [14, 0, 0, 14], "clipped": [0] * 4, "missing_grad": [14, 0, 14, 0],
        "second_backward": [0] * 4}


@pytest.mark.parametrize("name", list(CASES))
def test_the_prefetch_is_used_exactly_where_it_holds(sharded, name):
    _, results = sharded
    assert results[(name, True)]["used"] == USED[name]
    assert results[(name, False)]["used"] == [None] * STEPS
