"""The persistent spectral estimate (optim/spectral_cap.py, docs/algorithms.md §4): one power-iteration round per
step from a vector carried in the optimizer state. Checked against the exact operator norm (SVD), against the
restart estimate on a run's first RowNorm step, eager against the C loops, and through state_dict and checkpoint
resumes. Sharded runs against the single process: tests/test_sharded_optim.py."""

import copy

import pytest
import torch

from dit_train.optim.directions import row_inv_norms
from dit_train.optim.matrix_optimizer import VECTOR_STATE, MatrixOptimizer
from dit_train.optim.spectral_cap import (capped_row_norm_scale, next_vectors, persistent_cap_factors,
                                          spectral_cap, start_vector)

SHAPES = [(48, 80), (80, 48)]  # wide: RowNorm's rows are W's rows; tall: its columns


def low_rank(shape, rank, seed, noise=0.05):
    g = torch.Generator().manual_seed(seed)
    m, n = shape
    return (torch.randn(m, rank, generator=g, dtype=torch.float64) @ torch.randn(rank, n, generator=g,
                                                                                 dtype=torch.float64)
            + noise * torch.randn(m, n, generator=g, dtype=torch.float64))


def rownorm_factors(U):
    return row_inv_norms(U, 1e-7, tall=U.shape[-2] > U.shape[-1])


def estimate(U, v, rounds=0):
    """sigma of the persistent estimate at v (a cap far below any norm makes factor = cap / sigma), and the next v."""
    s = rownorm_factors(U)
    tall = U.shape[-2] > U.shape[-1]
    cap = 1e-6
    (f, w, keep), = persistent_cap_factors([(U, s, tall, v, None, cap)], first_rounds=rounds)
    return cap / f.reshape(-1), torch.where(keep[:, None], next_vectors(U, s * f, tall, w), v)


@pytest.mark.parametrize("shape", SHAPES, ids=["wide", "tall"])
def test_the_estimate_stays_below_the_operator_norm_and_converges_to_it_over_steps(shape):
    """A fixed U (momentum that stopped changing): every step's sigma is a lower bound on ||R||_2 and the steps'
    rounds add up, so it reaches the SVD's value; rank 4 with a gap between the top singular values."""
    U = low_rank(shape, 4, seed=0)[None]
    R = U * rownorm_factors(U)
    exact = torch.linalg.matrix_norm(R, ord=2).item()
    v = start_vector(shape[0], shape[1], "cpu", torch.float64)[None]
    sigmas = []
    for _ in range(100):
        sigma, v = estimate(U, v)
        sigmas.append(sigma.item())
    assert all(s <= exact * (1 + 1e-12) for s in sigmas)
    assert sigmas[-1] == pytest.approx(exact, rel=1e-6)
    assert sigmas[0] < 0.999 * exact  # one round from the start vector is not already exact: the carry matters


@pytest.mark.parametrize("shape", SHAPES, ids=["wide", "tall"])
def test_the_first_step_takes_the_restart_estimates_rounds(shape):
    """On a run's first RowNorm step (2 extra rounds on the start vector) the estimate is 3 rounds' worth, as the
    restart estimate's: exact for rank 1, and within the restart estimate's own distance of the SVD's value."""
    for rank in (1, 4):
        U = low_rank(shape, rank, seed=rank, noise=0.0 if rank == 1 else 0.05)[None]
        s = rownorm_factors(U)
        exact = torch.linalg.matrix_norm(U * s, ord=2).item()
        sigma, _ = estimate(U, start_vector(*shape, "cpu", torch.float64)[None], rounds=2)
        restart = (spectral_cap(*sorted(shape)) / (capped_row_norm_scale(U, s) / s).flatten()[0]).item()
        if rank == 1:
            assert sigma.item() == pytest.approx(exact, rel=1e-9)
        assert abs(sigma.item() - exact) <= max(2 * abs(restart - exact), 1e-3 * exact)


def drifting(t, i, shape):
    """Low-rank gradients whose directions drift from step to step, as a training run's do."""
    return (low_rank(shape, 2, seed=i) + 0.3 * low_rank(shape, 2, seed=100 * t + i)).float()


def run(compile_rownorm, estimate="persistent", steps=7, K=3, grads=None, shapes=((40, 96), (40, 96), (120, 32))):
    """periodic_rowwise on low-rank gradients that drift from step to step (so that the cap is active)."""
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(0.1 * torch.randn(s, generator=g)) for s in shapes]
    opt = MatrixOptimizer(params, lr=0.02, weight_decay=0.1, direction="spectral", refresh_every=K,
                          between="rownorm", rownorm_scale="spectral", spectral_estimate=estimate,
                          compile_rownorm=compile_rownorm)
    for t in range(steps):
        for i, p in enumerate(params):
            p.grad = (grads or drifting)(t, i, p.shape)
        opt.step()
    return params, opt


def test_the_c_loops_equal_the_eager_step():
    """compile_rownorm (z folded into the momentum pass, the next vectors into the update pass, U not stored) and
    the torch ops give the same weights and vectors to float rounding, first RowNorm step included."""
    fused, fo = run("auto")
    assert fo.compile_rownorm, "the C loops did not build here"
    eager, eo = run(False)
    for a, b in zip(fused, eager):
        assert torch.allclose(a, b, rtol=0, atol=2e-6)
        assert torch.allclose(fo.state[a][VECTOR_STATE], eo.state[b][VECTOR_STATE], rtol=1e-4, atol=1e-6)


def test_the_cap_is_active_and_the_estimates_differ_only_in_how_they_estimate():
    """On low-rank momentum both estimates cut the RowNorm steps (frobenius moves the weights further), and they
    land close to each other: the same cap, estimated two ways."""
    persistent, _ = run(False)
    restart, _ = run(False, "restart")
    g = torch.Generator().manual_seed(0)
    start = [0.1 * torch.randn(s, generator=g) for s in ((40, 96), (40, 96), (120, 32))]
    params = [torch.nn.Parameter(w.clone()) for w in start]
    opt = MatrixOptimizer(params, lr=0.02, weight_decay=0.1, direction="spectral", refresh_every=3,
                          between="rownorm", rownorm_scale="frobenius", compile_rownorm=False)
    for t in range(7):
        for i, p in enumerate(params):
            p.grad = drifting(t, i, p.shape)
        opt.step()
    for a, b, f, w0 in zip(persistent, restart, params, start):
        assert (a - w0).norm() < 0.8 * (f - w0).norm()
        assert (a - b).norm() < 0.05 * (b - w0).norm()


def test_a_zero_gradient_keeps_the_vector():
    """U = 0 (a zero-initialised gate's layers at step 0) gives z = 0: the vector stays as it was, not 0 or NaN."""
    zero_first = lambda t, i, shape: torch.zeros(shape) if t < 2 and i == 0 else drifting(t, i, shape)
    params, opt = run(False, steps=2, grads=zero_first)  # steps 0 (NS5) and 1 (the first RowNorm step)
    v = opt.state[params[0]][VECTOR_STATE]
    assert torch.equal(v, start_vector(40, 96, "cpu", torch.float32))
    assert not torch.equal(opt.state[params[1]][VECTOR_STATE], start_vector(40, 96, "cpu", torch.float32))
    run(False, steps=5, grads=zero_first)  # and the steps after it are finite
    assert all(torch.isfinite(p).all() for p in params)


def test_state_dict_resume_is_bit_for_bit_and_the_vectors_are_in_it():
    straight, so = run("auto", steps=8)
    cut, co = run("auto", steps=4)
    assert all(VECTOR_STATE in co.state[p] for p in cut)
    params = [torch.nn.Parameter(p.detach().clone()) for p in cut]
    opt = MatrixOptimizer(params, lr=0.02, weight_decay=0.1, direction="spectral", refresh_every=3,
                          between="rownorm", rownorm_scale="spectral", spectral_estimate="persistent")
    opt.load_state_dict(copy.deepcopy(co.state_dict()))
    for t in range(4, 8):
        for i, p in enumerate(params):
            p.grad = drifting(t, i, p.shape)
        opt.step()
    for a, b in zip(straight, params):
        assert torch.equal(a, b)


def test_groups_saved_before_the_key_restart():
    """A state_dict from before spectral_estimate existed resumes under the estimate it ran (restart)."""
    params, opt = run(False, "restart", steps=2)
    sd = opt.state_dict()
    for group in sd["param_groups"]:
        del group["spectral_estimate"]
    fresh = MatrixOptimizer([torch.nn.Parameter(p.detach().clone()) for p in params], lr=0.02)
    fresh.load_state_dict(sd)
    assert fresh.param_groups[0].get("spectral_estimate", "restart") == "restart"


def test_an_unknown_estimate_is_refused_naming_the_valid_ones():
    with pytest.raises(ValueError, match="spectral_estimate='warm' is not valid; choose one of persistent, restart"):
        MatrixOptimizer([torch.nn.Parameter(torch.zeros(4, 4))], lr=0.1, spectral_estimate="warm")
