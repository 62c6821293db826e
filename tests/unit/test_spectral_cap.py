"""The spectral RowNorm scale (optim/spectral_cap.py, docs/algorithms.md §4): RowNorm's direction with ||Phi||_2
scaled toward 1 + sqrt(r / c) by a power-iteration estimate (a target, not a bound), so that low-rank momentum no
longer gives steps sqrt(r) times larger in operator norm, while full-rank (Gaussian) input keeps its RowNorm
direction."""

import pytest
import torch

from dit_train.optim.directions import row_inv_norms
from dit_train.optim.directions import RowNorm
from dit_train.optim.matrix_optimizer import MatrixOptimizer, update_scale
from dit_train.optim.registry import build_optimizer
from dit_train.optim.spectral_cap import capped_row_norm_scale, spectral_cap, whole_matrix_problem

SHAPES = [(256, 256), (256, 1024), (1024, 256)]  # width 256: square, wide (MLP out), tall (MLP in)


def spectral_norms(X):
    return torch.linalg.matrix_norm(X.double(), ord=2)


def phi(U, scale):
    rs = row_inv_norms(U)
    return U * (capped_row_norm_scale(U, rs) if scale == "spectral" else rs)


@pytest.mark.parametrize("shape", SHAPES)
def test_rank_one_input_is_capped_to_the_full_rank_value(shape):
    g = torch.Generator().manual_seed(0)
    m, n = shape
    U = torch.randn(3, m, 1, generator=g) @ torch.randn(3, 1, n, generator=g)
    cap = spectral_cap(min(m, n), max(m, n))
    before, after = spectral_norms(phi(U, "frobenius")), spectral_norms(phi(U, "spectral"))
    torch.testing.assert_close(before, torch.full_like(before, min(m, n) ** 0.5))  # 16 at r = 256
    assert (after <= cap * (1 + 1e-4)).all() and (after >= cap * 0.999).all(), (after, cap)


# (m, n, the cap 1 + sqrt(r / c) worked out by hand with r = min(m, n), c = max(m, n)); both orientations
NON_SQUARE = [(64, 1024, 1.25), (1024, 64, 1.25), (128, 512, 1.5), (512, 128, 1.5)]


@pytest.mark.parametrize("m, n, cap", NON_SQUARE)
def test_the_cap_is_the_operator_norm_rownorm_gives_gaussian_input_of_that_shape(m, n, cap):
    """What the cap is meant to be (docs/algorithms.md §4): the operator norm of the unit rows of a Gaussian
    r x c matrix (R ~ X / sqrt(c), largest singular value ~ 1 + sqrt(r / c)), here measured by SVD of the
    row-normalised wide orientation (the columns of a tall U); the cap the optimizer passes for U of that shape is
    the same number. A transposed ratio (1 + sqrt(c / r): 5 at 64 x 1024) is 4x off."""
    U = torch.randn(3, m, n, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    R = U / U.norm(dim=-1 if m <= n else -2, keepdim=True)
    measured = spectral_norms(R)
    assert ((measured / cap - 1).abs() < 0.04).all(), (measured, cap)
    assert spectral_cap(min(m, n), max(m, n)) == pytest.approx(cap, rel=1e-12)
    assert whole_matrix_problem(U.float(), row_inv_norms(U.float()), m > n)[-1] == pytest.approx(cap, rel=1e-12)


@pytest.mark.parametrize("m, n, cap", NON_SQUARE)
def test_rank_one_non_square_input_is_capped_to_the_hand_computed_value(m, n, cap):
    """The spectral scale's output on rank-1 input has operator norm 1 + sqrt(r / c) (not sqrt(r) = 8 or 11.3, and
    not a cap from the other ratio), against a number written out here rather than the function's own."""
    g = torch.Generator().manual_seed(5)
    U = torch.randn(2, m, 1, generator=g) @ torch.randn(2, 1, n, generator=g)
    after = spectral_norms(phi(U, "spectral"))
    torch.testing.assert_close(after, torch.full_like(after, cap), rtol=1e-3, atol=0)


@pytest.mark.parametrize("shape", SHAPES)
def test_gaussian_input_keeps_its_rownorm_direction(shape):
    U = torch.randn(3, *shape, generator=torch.Generator().manual_seed(1))
    frob, spec = phi(U, "frobenius"), phi(U, "spectral")
    assert ((spec - frob).norm(dim=(-2, -1)) <= 0.03 * frob.norm(dim=(-2, -1))).all()


def test_the_scale_only_ever_shrinks_and_leaves_norms_below_the_cap_alone():
    """min(1, cap / sigma): never a factor above 1. Unit orthonormal rows (RowNorm leaves them as they are,
    ||R||_2 = 1) at 8 x 1024 sit below the cap 1 + sqrt(8 / 1024) = 1.088 and pass exactly unchanged; Gaussian input,
    whose ||R||_2 is just under its cap (1.98 against 2 at 256 x 256), is never scaled up."""
    g = torch.Generator().manual_seed(6)
    Q, _ = torch.linalg.qr(torch.randn(2, 1024, 8, generator=g, dtype=torch.float64))
    rows = Q.mT.float().contiguous()
    rs = row_inv_norms(rows)
    assert torch.equal(capped_row_norm_scale(rows, rs), rs)
    for shape in SHAPES:
        U = torch.randn(3, *shape, generator=g)
        rs = row_inv_norms(U)
        assert (capped_row_norm_scale(U, rs) <= rs).all()


@pytest.mark.parametrize("rank", [4, 32])
def test_low_rank_input_overshoots_the_cap_by_little(rank):
    """Power iteration underestimates ||R||_2 when the top singular values are close, and Phi then exceeds the cap
    (measured at width 256 over 64 draws x 4 seeds: up to 1.25x the cap (rank 4), 1.28x (rank 32); 64 x 96 rank 8
    up to 1.38x), where the frobenius scale gives 4.3x and 2.0x on average."""
    g = torch.Generator().manual_seed(2)
    U = torch.randn(16, 256, rank, generator=g) @ torch.randn(16, rank, 256, generator=g)
    cap = spectral_cap(256, 256)
    after = spectral_norms(phi(U, "spectral"))
    assert after.max() <= 1.3 * cap and after.mean() <= 1.15 * cap, after
    assert spectral_norms(phi(U, "frobenius")).min() >= 1.5 * cap


def test_zero_and_empty_input_stay_finite():
    U = torch.zeros(2, 8, 16)
    assert torch.equal(phi(U, "spectral"), torch.zeros_like(U))


def test_optimizer_steps_with_the_spectral_scale_move_rank_one_momentum_at_most_the_cap():
    """One rownorm step on a rank-1 gradient: the update's operator norm / (lr s(W)) is sqrt(r) with the paper's
    frobenius scale and at most the cap with the spectral one; the key is checked like every config key."""
    g = torch.Generator().manual_seed(3)
    grad = torch.randn(64, 1, generator=g) @ torch.randn(1, 128, generator=g)
    moved = {}
    for scale in ("frobenius", "spectral"):
        W = torch.nn.Parameter(torch.zeros(64, 128))
        opt = MatrixOptimizer([W], lr=0.1, direction=RowNorm(scale))
        W.grad = grad.clone()
        opt.step()
        moved[scale] = spectral_norms(W.detach()).item() / (0.1 * update_scale("moonlight", 64, 128))
    assert moved["frobenius"] == pytest.approx(8.0, rel=1e-4)
    assert moved["spectral"] == pytest.approx(spectral_cap(64, 128), rel=1e-3)
    with pytest.raises(ValueError, match=r"optimizer.rownorm_scale='operator' .*frobenius, spectral"):
        build_optimizer(torch.nn.Linear(4, 4), {"name": "rownorm", "rownorm_scale": "operator"})
    with pytest.raises(ValueError, match="rownorm_scale"):  # muon takes no RowNorm steps
        build_optimizer(torch.nn.Linear(4, 4), {"name": "muon", "rownorm_scale": "spectral"})
    opt = build_optimizer(torch.nn.Linear(4, 4), {"name": "periodic_rowwise", "rownorm_scale": "frobenius"})
    assert {g["rownorm_scale"] for g in opt.param_groups} == {"frobenius"}


@pytest.mark.parametrize("name", ["rownorm", "periodic_rowwise"])
def test_the_default_scale_is_spectral_from_hydra_and_from_python(name):
    """The shipped config and the constructor agree (docs/algorithms.md §4 says why spectral)."""
    from conftest import compose

    cfg = compose([f"optimizer={name}", "run_dir=/tmp/unused"])
    assert cfg.optimizer.rownorm_scale == "spectral"
    opt = build_optimizer(torch.nn.Linear(4, 4), {"name": name})
    assert {g["rownorm_scale"] for g in opt.param_groups} == {"spectral"}
    opt = MatrixOptimizer([torch.nn.Parameter(torch.zeros(4, 4))], lr=0.1, direction=RowNorm())
    assert opt.param_groups[0]["rownorm_scale"] == "spectral"


def test_checkpoints_from_before_the_key_resume_under_the_papers_scale_only():
    from dit_train.runs.resume_policy import config_changes

    saved = {"optimizer": {"name": "rownorm", "lr": 0.002}}
    assert config_changes(saved, {"optimizer": {**saved["optimizer"], "rownorm_scale": "frobenius"}}) == []
    assert config_changes(saved, {"optimizer": {**saved["optimizer"], "rownorm_scale": "spectral"}}) == [
        ("optimizer.rownorm_scale", "frobenius", "spectral")]


def test_a_fake_tensor_made_by_a_counted_step_is_never_cached_for_a_real_one():
    """The planning tools step the optimizer on fake tensors (benchmarks/sharded_count.py): the read-only start
    vectors and caps they made were cached, and a real step later in the same process read them (its spectral
    update came out 0; test_sharded_count.py then this file failed in one pytest process)."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    from dit_train.optim.spectral_cap import cap_vector, start_vectors

    cpu = torch.device("cpu")
    with FakeTensorMode():
        fake = start_vectors(3, 7, cpu, torch.float32)
        assert isinstance(fake, FakeTensor) and isinstance(cap_vector(((1.5, 2),), cpu, torch.float32), FakeTensor)
        assert start_vectors(3, 7, cpu, torch.float32) is fake  # kept while the mode lives, as a real run keeps it
    x0 = start_vectors(3, 7, cpu, torch.float32)
    g = torch.Generator().manual_seed(1_000_003 * 7 + 3)
    assert type(x0) is torch.Tensor and torch.equal(x0, torch.randn(3, 7, generator=g, dtype=torch.float64).float())
    assert torch.equal(cap_vector(((1.5, 2),), cpu, torch.float32), torch.tensor([1.5, 1.5]))
    assert start_vectors(3, 7, cpu, torch.float32) is x0  # real ones are still cached
