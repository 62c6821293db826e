"""The frobenius RowNorm step in one C call per bucket (fused_rownorm.one_pass: momentum, row factors and update;
a wide bucket's rows read back from the cache, a tall bucket's two sweeps one after the other) gives the same bits as the two passes with the
factors computed by torch between them (momentum_pass, directions.inv_norms_from_sumsq, update_pass), on any
thread count and in both builds (OpenMP, pthreads), and MatrixOptimizer takes it where the factors are local."""


import pytest
import torch

from dit_train.optim import fused_rownorm, native_rownorm
from dit_train.optim.directions import inv_norms_from_sumsq
from dit_train.optim import matrix_optimizer
from dit_train.optim.matrix_optimizer import MatrixOptimizer

# B x rows x cols: wide rows over several chunks and row blocks (BLOCK_ROWS = 128) with a partial last one; square
# (wide); tall over several row blocks with a partial last one
SHAPES = [(3, 300, 270), (2, 130, 130), (2, 5, 1000), (3, 270, 40), (1, 1100, 1030)]
DTYPES = [torch.float32, torch.float64]


# both builds (OpenMP and the pthreads fallback), as tests/test_native_threads.py
pytestmark = pytest.mark.usefixtures("native_kernels")


def bucket(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape[1:], generator=g, dtype=dtype) for _ in range(shape[0])]


def tensors(shape, dtype):
    G, M, W = bucket(shape, dtype, 1), bucket(shape, dtype, 2), bucket(shape, dtype, 3)
    G[0][1].zero_(), M[0][1].zero_()  # a zero row: its factor is 1 / eps
    G[-1][:, 2].zero_(), M[-1][:, 2].zero_()  # a zero column (a tall matrix's row of O(X))
    return G, M, W


def two_passes(shape, dtype, nesterov, mu=0.95, eps=1e-7, decay=0.99, alpha=-0.01):
    G, M, W = tensors(shape, dtype)
    tall = shape[1] > shape[2]
    U = torch.zeros((), dtype=dtype).expand(shape)  # not stored, as the frobenius step runs it
    sums, _ = fused_rownorm.momentum_pass(G, M, U, mu, nesterov, tall, store_u=False)
    fused_rownorm.update_pass(W, G, M, U, False, inv_norms_from_sumsq(sums, eps), decay, alpha, mu, nesterov, tall)
    return M + W


def one_pass(shape, dtype, nesterov, threads, mu=0.95, eps=1e-7, decay=0.99, alpha=-0.01):
    torch.set_num_threads(threads)
    G, M, W = tensors(shape, dtype)
    assert fused_rownorm.one_pass_takes(W, G, M)
    fused_rownorm.one_pass(W, G, M, mu, nesterov, shape[1] > shape[2], eps, decay, alpha)
    return M + W


@pytest.mark.parametrize("nesterov", [True, False], ids=["nesterov", "plain"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_one_pass_equals_the_two_passes_bit_for_bit(shape, dtype, nesterov):
    ref = two_passes(shape, dtype, nesterov)
    for threads in (1, 2, 3):
        out = one_pass(shape, dtype, nesterov, threads)
        for a, b in zip(out, ref):
            assert torch.equal(a, b), f"one pass on {threads} threads differs from the two passes"


def run_optimizer(dtype, monkeypatch, one: bool):
    """Three frobenius compile_rownorm steps on wide, tall and square buckets; one: as shipped (counting the
    one-pass calls), else every bucket through the two passes."""
    g = torch.Generator().manual_seed(0)
    shapes = [(64, 300), (64, 300), (300, 64), (130, 130), (257, 33)]
    ps = [torch.nn.Parameter(torch.randn(s, generator=g, dtype=dtype)) for s in shapes]
    opt = MatrixOptimizer(ps, lr=0.02, weight_decay=0.1, direction="rownorm", rownorm_scale="frobenius",
                          compile_rownorm=True)
    calls = []
    with monkeypatch.context() as m:
        if one:
            take = matrix_optimizer.one_pass
            m.setattr(matrix_optimizer, "one_pass", lambda *a, **k: (calls.append(1), take(*a, **k))[1])
        else:
            m.setattr(opt, "_row_factors_local", lambda key: False)
        for _ in range(3):
            for p in ps:
                p.grad = torch.randn(p.shape, generator=g, dtype=dtype)
            opt.step()
    return [p.detach() for p in ps] + [opt.state[p]["momentum_buffer"] for p in ps], len(calls)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_optimizer_takes_the_one_pass_step_with_the_same_bits(dtype, monkeypatch):
    ref, none = run_optimizer(dtype, monkeypatch, one=False)
    out, calls = run_optimizer(dtype, monkeypatch, one=True)
    assert (none, calls) == (0, 3 * 4)  # every bucket (4 shapes), every step
    for a, b in zip(out, ref):
        assert torch.equal(a, b)
