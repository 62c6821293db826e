"""Directions (docs/algorithms.md §3) against independent references: SVD polar factor, row norms, MUD's fixed point and
convergence, the Gram form against the plain NS5 iteration, and the column-shard `reduce` hook."""

import threading

import pytest
import torch

from dit_train.optim.directions import (
    NS_COEFFICIENTS,
    mud_whiten,
    newton_schulz5,
    ns5_flops,
    oriented,
    row_inv_norms,
    row_norm,
    uses_gram,
)


pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def oriented_svd(Y):
    return torch.linalg.svd(oriented(Y).double(), full_matrices=False)


# ---- NS5 ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(48, 160), (160, 48), (64, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ns5_against_svd_polar_factor(shape, dtype):
    """Well-conditioned input: NS5's singular values lie in its band and its singular vectors are the polar
    factor's, i.e. U^T NS5(X) V is diagonal for X = U S V^T."""
    g = gen()
    r, c = min(shape), max(shape)
    P, _ = torch.linalg.qr(torch.randn(r, r, generator=g, dtype=torch.float64))
    Q, _ = torch.linalg.qr(torch.randn(c, r, generator=g, dtype=torch.float64))
    X = ((P * torch.linspace(1, 4, r, dtype=torch.float64)) @ Q.mT).float()  # singular values 1..4
    X = X.mT.contiguous() if shape[0] > shape[1] else X
    U, S, Vh = oriented_svd(X)
    Y = newton_schulz5(X.to(dtype), dtype=dtype)
    assert Y.shape == X.shape and Y.dtype == dtype and torch.isfinite(Y).all()
    core = U.mT @ oriented(Y).double() @ Vh.mT  # r x r: diagonal iff singular vectors match
    diag = core.diagonal()
    assert diag.min() > 0.5 and diag.max() < 1.5, diag
    off = core - torch.diag(diag)
    assert off.norm() / diag.norm() < (0.03 if dtype == torch.bfloat16 else 1e-4)
    polar = (U @ Vh).float()
    cos = (oriented(Y).float() * polar).sum() / (oriented(Y).float().norm() * polar.norm())
    assert cos > 0.97


@pytest.mark.parametrize("gram", [False, True])
def test_one_ns5_step_is_the_quintic_with_muons_coefficients(gram):
    """One fp64 step maps each singular value s of X / ||X||_F to a s + b s^3 + c s^5 with
    (a, b, c) = (3.4445, -4.7750, 2.0315) (docs/algorithms.md §3; torch.optim.Muon's defaults), singular vectors
    kept; a typo in a coefficient's third decimal moves the values by ~1e-3, far outside fp64 rounding."""
    from torch.optim import _muon

    a, b, c = 3.4445, -4.7750, 2.0315
    assert (_muon.DEFAULT_A, _muon.DEFAULT_B, _muon.DEFAULT_C) == (a, b, c)
    g = gen(13)
    P, _ = torch.linalg.qr(torch.randn(4, 4, generator=g, dtype=torch.float64))
    Q, _ = torch.linalg.qr(torch.randn(12, 4, generator=g, dtype=torch.float64))
    s = torch.tensor([3.0, 2.0, 1.0, 0.5], dtype=torch.float64)
    X = (P * s) @ Q.mT
    n = s / s.norm()
    expected = (P * (a * n + b * n ** 3 + c * n ** 5)) @ Q.mT
    torch.testing.assert_close(newton_schulz5(X, steps=1, dtype=torch.float64, eps=0.0, gram=gram), expected,
                               atol=1e-12, rtol=0)


@pytest.mark.parametrize("gram", [False, True])
def test_ns5_batched_equals_per_matrix_and_input_untouched(gram):
    X = torch.randn(3, 24, 80, generator=gen(1))
    X[1] *= 1e-3  # per-matrix normalisation: scale of one matrix must not affect the others
    before = X.clone()
    Y = newton_schulz5(X, dtype=torch.float32, gram=gram)
    assert torch.equal(X, before)
    for i in range(3):
        torch.testing.assert_close(Y[i], newton_schulz5(X[i], dtype=torch.float32, gram=gram), atol=1e-5, rtol=1e-4)
    # tall batch: same as transposing, computing, transposing back
    Yt = newton_schulz5(X.mT.contiguous(), dtype=torch.float32, gram=gram)
    torch.testing.assert_close(Yt, Y.mT, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("fn", ["ns5", "ns5_gram", "rownorm", "mud"])
@pytest.mark.parametrize("shape", [(16, 40), (40, 16), (2, 12, 12)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zero_and_rank_deficient_inputs_are_finite(fn, shape, dtype):
    f = {
        "ns5": lambda X: newton_schulz5(X, dtype=dtype, gram=False),
        "ns5_gram": lambda X: newton_schulz5(X, dtype=dtype, gram=True),
        "rownorm": row_norm,
        "mud": mud_whiten,
    }[fn]
    Z = torch.zeros(shape, dtype=dtype)
    out = f(Z)
    assert out.shape == Z.shape and out.dtype == dtype and torch.isfinite(out).all() and (out == 0).all()
    a = torch.randn(*shape[:-1], 1, generator=gen(2))
    b = torch.randn(*shape[:-2], 1, shape[-1], generator=gen(3))
    rank1 = (a @ b).to(dtype)
    rank1[..., 0, :] = 0  # a zero row as well
    assert torch.isfinite(f(rank1)).all()


def test_ns5_rank_deficient_keeps_the_null_space_empty_in_fp32():
    X = torch.randn(32, 4, generator=gen(4)) @ torch.randn(4, 96, generator=gen(5))
    Y = newton_schulz5(X, dtype=torch.float32)
    S = torch.linalg.svdvals(Y.double())
    assert 0.5 < S[:4].min() and S[:4].max() < 1.5
    assert S[4:].max() < 1e-3


def test_ns5_flops_count():
    assert ns5_flops(512, 2048) == ns5_flops(2048, 512) == 5 * (4 * 512 ** 2 * 2048 + 2 * 512 ** 3)


# ---- Gram form ------------------------------------------------------------------------------------------------
def _inputs(kind, r, c, g):
    if kind == "gauss":
        return torch.randn(3, r, c, generator=g)
    if kind == "lowrank":
        return torch.randn(3, r, 6, generator=g) @ torch.randn(3, 6, c, generator=g) + 1e-3 * torch.randn(3, r, c, generator=g)
    if kind == "decay":  # singular values 1 ... 1e-4
        U, _ = torch.linalg.qr(torch.randn(3, r, r, generator=g))
        V, _ = torch.linalg.qr(torch.randn(3, c, r, generator=g))
        return (U * torch.logspace(0, -4, r)) @ V.mT
    X = torch.randn(3, r, c, generator=g)
    X[:, r // 2:] = 0  # zero rows
    return X


def test_gram_form_is_the_same_map_in_exact_arithmetic():
    X = torch.randn(2, 24, 96, generator=gen(6), dtype=torch.float64)
    torch.testing.assert_close(newton_schulz5(X, dtype=torch.float64, gram=True),
                               newton_schulz5(X, dtype=torch.float64, gram=False), atol=1e-10, rtol=1e-10)


def _keller_ns5(X):
    """Keller Jordan's reference Muon iteration in bf16 (X = a X + B @ X with separately rounded terms)."""
    a, b, c = NS_COEFFICIENTS
    Xo = oriented(X).bfloat16()
    Xo = Xo / (Xo.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(5):
        A = Xo @ Xo.mT
        B = b * A + c * A @ A
        Xo = a * Xo + B @ Xo
    return Xo.mT if X.shape[-2] > X.shape[-1] else Xo


@pytest.mark.parametrize("kind", ["gauss", "lowrank", "decay", "zero_rows"])
@pytest.mark.parametrize("rc", [(48, 96), (32, 80), (48, 192), (32, 192), (192, 32), (96, 48)])
def test_gram_form_matches_plain_within_bf16_tolerance(kind, rc):
    """The Gram form runs in bf16 only where this holds. Against the exact (fp64) NS5 map, its error is no larger
    than that of the reference bf16 Muon iteration (Keller's, separately rounded terms), at most 2.5x that of our
    fused plain iteration (measured worst over 12 seeds: 2.0x on Gaussian input, where both are ~1-3%), and no
    larger than the plain iteration's on low-rank and ill-conditioned input (measured: 0.5-0.9x). For scale,
    torch.optim.Muon's own result moves by ~2% when its input is scaled by 0.05, as its EMA momentum does."""
    r, c = min(rc), max(rc)
    X = _inputs(kind, r, c, gen(7))
    if rc[0] > rc[1]:  # tall: the same matrices transposed
        X = X.mT.contiguous()
    exact = newton_schulz5(X.double(), dtype=torch.float64, gram=False)

    def err(Y):
        return ((Y.double() - exact).flatten(1).norm(dim=1) / exact.flatten(1).norm(dim=1)).max().item()

    e_plain = err(newton_schulz5(X, gram=False))
    e_gram = err(newton_schulz5(X, gram=True))
    e_ref = err(_keller_ns5(X))
    assert e_gram <= e_ref and e_gram <= 2.5 * e_plain, (e_gram, e_plain, e_ref)
    if kind in ("lowrank", "decay"):
        assert e_gram <= e_plain


@pytest.mark.parametrize("shape", [(2, 24, 96), (2, 96, 24), (2, 40, 40)])
def test_workspace_gives_the_same_result_and_is_reused(shape):
    X = torch.randn(*shape, generator=gen(14))
    for fn in (lambda X, ws: newton_schulz5(X, workspace=ws), lambda X, ws: newton_schulz5(X, gram=True, workspace=ws),
               lambda X, ws: mud_whiten(X, 2, workspace=ws),
               lambda X, ws: mud_whiten(X, 2, solve="triangular", workspace=ws)):
        ws = {}
        first = fn(X, ws).clone()
        n_buffers = len(ws)
        assert n_buffers > 0 and torch.equal(first, fn(X, None))
        again = fn(X, ws)
        assert torch.equal(first, again) and len(ws) == n_buffers  # no new buffers on the second call


def test_gram_is_chosen_only_for_elongated_matrices():
    assert uses_gram(512, 2048) and uses_gram(3072, 512) and uses_gram(512, 1536) and uses_gram(1024, 512)
    assert not uses_gram(512, 512) and not uses_gram(512, 768)


# ---- RowNorm --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(12, 40), (40, 12), (4, 12, 40)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rownorm_unit_rows_and_frobenius(shape, dtype):
    X = (torch.randn(*shape, generator=gen(8)) * torch.logspace(-3, 3, shape[-1])).to(dtype)
    R = row_norm(X)
    assert R.dtype == dtype
    Ro = oriented(R).double()
    r = Ro.shape[-2]
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(Ro.norm(dim=-1), torch.ones(Ro.shape[:-1], dtype=torch.float64), atol=tol, rtol=0)
    torch.testing.assert_close(Ro.square().sum((-2, -1)), torch.full(Ro.shape[:-2], float(r), dtype=torch.float64),
                               atol=r * tol * 2, rtol=0)
    # the rows are those of the r x c side: for a tall matrix, the columns
    ref = oriented(X).double() / oriented(X).double().norm(dim=-1, keepdim=True)
    torch.testing.assert_close(Ro, ref, atol=tol, rtol=tol)
    torch.testing.assert_close(R.double(), (X * row_inv_norms(X)).double(), atol=tol, rtol=0)


# ---- MUD ------------------------------------------------------------------------------------------------------
def test_rownorm_floors_the_norm_at_eps_not_its_square():
    """1 / max(||row||, eps): a row of norm 1e-5 (tiny gradients) still comes out with unit norm, and only rows
    below eps = 1e-7 are scaled by 1 / eps (a floor on the sum of squares instead would stop at norm 3e-4)."""
    X = torch.zeros(3, 16, dtype=torch.float64)
    X[0, 0], X[1, :4], X[2, 5] = 1e-5, 5e-5, 1e-9
    torch.testing.assert_close(row_inv_norms(X).flatten(), torch.tensor([1e5, 1e4, 1e7], dtype=torch.float64))
    torch.testing.assert_close(row_norm(X).norm(dim=1), torch.tensor([1.0, 1.0, 1e-2], dtype=torch.float64))


def _orth_err(Q):
    Q = oriented(Q).double()
    return (Q @ Q.mT - torch.eye(Q.shape[-2], dtype=torch.float64)).norm().item()


def test_mud_row_orthonormal_is_fixed_point():
    O, _ = torch.linalg.qr(torch.randn(256, 64, generator=gen(9), dtype=torch.float64))
    for X in (O.mT, O):  # wide and tall
        for solve in ("inverse", "triangular"):
            torch.testing.assert_close(mud_whiten(X, 1, solve=solve), X, atol=1e-12, rtol=0)
    Of = O.float().mT.contiguous()
    torch.testing.assert_close(mud_whiten(Of, 2), Of, atol=1e-5, rtol=0)


def test_mud_quadratic_on_well_conditioned_input():
    """64x256 Gaussian: ||QQ^T - I||_F falls every pass, quadratically once small (an independent implementation
    measured 1.2 -> 0.15 -> 3e-3 -> 3e-6 over passes 1-4)."""
    X = torch.randn(64, 256, generator=gen(10), dtype=torch.float64)
    e = [_orth_err(mud_whiten(X, p)) for p in range(1, 5)]
    assert all(b < a for a, b in zip(e, e[1:])), e
    assert 0.5 < e[0] < 2.5 and e[1] < 0.3 and e[2] < 1e-2 and e[3] < 1e-4, e
    assert e[2] <= 0.5 * e[1] ** 2 and e[3] <= 0.5 * e[2] ** 2, e  # quadratic, not linear
    # the tall orientation and the triangular-solve variant are the same map
    torch.testing.assert_close(mud_whiten(X.mT, 3), mud_whiten(X, 3).mT, atol=1e-10, rtol=0)
    torch.testing.assert_close(mud_whiten(X, 3, solve="triangular"), mud_whiten(X, 3), atol=1e-10, rtol=0)


@pytest.mark.parametrize("shape", [(64, 64), (48, 200)])
def test_mud_monotone_on_square_and_ill_conditioned(shape):
    """Square or ill-conditioned input: the decrease is only linear, so only monotonicity is asserted."""
    r, c = shape
    g = gen(11)
    U, _ = torch.linalg.qr(torch.randn(r, r, generator=g, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(c, r, generator=g, dtype=torch.float64))
    cond = torch.logspace(0, -3, r, dtype=torch.float64) if r < c else torch.ones(r, dtype=torch.float64)
    X = (U * cond) @ V.mT if r < c else torch.randn(r, c, generator=g, dtype=torch.float64)
    e = [_orth_err(mud_whiten(X, p)) for p in range(1, 6)]
    assert all(b < a for a, b in zip(e, e[1:])), e


def test_mud_fp32_and_bf16_inputs_compute_in_fp32():
    X = torch.randn(32, 96, generator=gen(12))
    y32 = mud_whiten(X, 2)
    ybf = mud_whiten(X.bfloat16(), 2, out_dtype=torch.float32)
    assert y32.dtype == torch.float32 and mud_whiten(X.bfloat16()).dtype == torch.bfloat16
    assert _orth_err(y32) < 0.3 and _orth_err(ybf) < 0.3


# ---- column shards through the reduce hook (docs/algorithms.md §6 reuses the same maths) -----------------------------
class _ThreadAllReduce:
    """A sum all-reduce between threads, standing in for torch.distributed.all_reduce on column shards."""

    def __init__(self, n):
        self.n, self.slots, self.lock = n, {}, threading.Lock()
        self.barrier = threading.Barrier(n)

    def __call__(self, rank):
        def reduce(t):
            with self.lock:
                self.slots[rank] = t.clone()
            self.barrier.wait()
            total = sum(self.slots[i] for i in range(self.n))
            self.barrier.wait()
            return total.to(t.dtype)
        return reduce


@pytest.mark.parametrize("fn", ["ns5", "ns5_gram", "rownorm", "mud"])
def test_column_shards_with_all_reduce_equal_the_whole_matrix(fn):
    """A tall m x n weight sharded along dim 0 (FSDP2) is a column-sharded X = W^T: every function, given a sum
    all-reduce as `reduce`, reproduces the whole-matrix result on each shard."""
    W = torch.randn(120, 24, generator=gen(13), dtype=torch.float64)
    f = {
        "ns5": lambda X, red: newton_schulz5(X, dtype=torch.float64, gram=False, reduce=red, tall=True),
        "ns5_gram": lambda X, red: newton_schulz5(X, dtype=torch.float64, gram=True, reduce=red, tall=True),
        "rownorm": lambda X, red: row_norm(X, reduce=red, tall=True),
        "mud": lambda X, red: mud_whiten(X, 2, reduce=red, tall=True),
    }[fn]
    whole = f(W, None)
    shards = list(W.split([60, 50, 10]))  # uneven shards; the last one is wide on its own
    ar = _ThreadAllReduce(len(shards))
    out = [None] * len(shards)

    def run(i):
        out[i] = f(shards[i], ar(i))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(shards))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    torch.testing.assert_close(torch.cat(out), whole, atol=1e-10, rtol=1e-10)
