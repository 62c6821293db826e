"""The C kernels of RowNorm steps (optim/native_rownorm.py) spread their work over torch's intra-op threads with a
fixed partition into row blocks (optim/row_blocks.h): the momentum pass, the update and the spectral scale's
power-iteration products give the same bits on 1 thread as on 2 and 3, on buckets big enough to be split, with
OpenMP (torch's threads) and with the pthreads fallback; and the products equal the batched torch products to
float rounding."""

import pytest
import torch

from dit_train.optim import native_rownorm
from dit_train.optim.spectral_cap import _NativeProducts, _TorchProducts

# B x rows x cols: several row blocks (BLOCK_ROWS = 128), a partial last one, over the work threshold (2^16 elements
# per thread); 2 matrices on 3 threads; rows of >= DOT4_MIN_COLS (1024) values, whose dot products the power
# iteration takes 4 rows at a time where a group of 4 blocks (here spanning both matrices) has the row
SHAPES = [(3, 300, 270), (2, 270, 520), (2, 300, 1100)]
SHAPE_IDS = ["300x270", "270x520", "300x1100"]
DTYPES = [torch.float32, torch.float64]


# both builds: with OpenMP (torch's threads) and the pthreads fallback (conftest.native_kernels)
pytestmark = pytest.mark.usefixtures("native_kernels")


def bucket(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape[1:], generator=g, dtype=dtype) for _ in range(shape[0])]


def one_step(shape, dtype, tall, threads):
    """Momentum pass (with U stored and the folded R^T x0 where wide), update, and every product."""
    torch.set_num_threads(threads)
    B, rows, cols = shape
    G, M, W = bucket(shape, dtype, 1), bucket(shape, dtype, 2), bucket(shape, dtype, 3)
    U = torch.empty(shape, dtype=dtype)
    sums = torch.empty((B, 1, cols) if tall else (B, rows, 1), dtype=dtype)
    x0 = torch.randn(B, rows, generator=torch.Generator().manual_seed(4), dtype=dtype)
    y0 = native_rownorm.momentum(G, M, U, sums, 0.05, 19.0, True, tall, x0, 1e-7)
    s = sums.sqrt().clamp_min(1e-7).reciprocal()
    native_rownorm.update(W, G, M, U, s, 0.99, -0.01, 19.0, True, tall)
    out = [sums, U, y0, *M, *W]
    x = torch.randn(B, cols, generator=torch.Generator().manual_seed(5), dtype=dtype)
    for kind in (native_rownorm.TALL_PAIR, native_rownorm.TALL_LAST) if tall else (native_rownorm.WIDE_FIRST,
                                                                                  native_rownorm.WIDE_PAIR):
        v = x0 if kind == native_rownorm.WIDE_FIRST else x
        out += [t for t in native_rownorm.power_iteration_round(kind, U, s.reshape(B, -1), v) if t is not None]
    return [t for t in out if t is not None]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tall", [False, True], ids=["wide", "tall"])
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_results_do_not_depend_on_the_thread_count(shape, tall, dtype):
    ref = one_step(shape, dtype, tall, 1)
    for threads in (2, 3):
        for a, b in zip(one_step(shape, dtype, tall, threads), ref):
            assert torch.equal(a, b), f"{threads} threads differ from 1"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tall", [False, True], ids=["wide", "tall"])
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_products_equal_the_torch_products(tall, dtype, shape):
    g = torch.Generator().manual_seed(6)
    B, rows, cols = shape
    U = torch.randn(B, rows, cols, generator=g, dtype=dtype)
    s = torch.rand(B, cols if tall else rows, generator=g, dtype=dtype) + 0.5
    x0 = torch.randn(B, cols if tall else rows, generator=g, dtype=dtype)
    c, t = _NativeProducts(U, s, x0), _TorchProducts(U, s, x0)
    tol = 1e-6 if dtype == torch.float32 else 1e-14
    flat = lambda v: v.reshape(B, -1)  # noqa: E731

    def close(a, b, tol):  # relative to the vector's norm: single entries cancel
        err = ((a - b).norm() / b.norm()).item()
        assert err <= tol, err
    if tall:
        close(c.tall_pair(x0), flat(t.tall_pair(t.x0)), tol)
        close(c.tall_last(x0), flat(t.tall_last(t.x0)), tol)
    else:
        y = c.wide_first(x0)
        close(y, flat(t.wide_first(t.x0)), tol)
        for a, b in zip(c.wide_pair(y), t.wide_pair(t.vector(y))):
            close(a, flat(b), tol)
    # and the momentum pass's folded first product is the same product
    M = [torch.zeros(rows, cols, dtype=dtype) for _ in range(B)]
    if not tall:
        sums, Ub = torch.empty(B, rows, 1, dtype=dtype), torch.empty(B, rows, cols, dtype=dtype)
        y0 = native_rownorm.momentum(list(U.unbind(0)), M, Ub, sums, 1.0, 0.0, True, False, x0, 1e-7)
        r = sums.sqrt().clamp_min(1e-7).reciprocal().reshape(B, -1)
        close(y0, flat(_TorchProducts(U, r, x0).wide_first(x0.unsqueeze(1))), tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tall", [False, True], ids=["wide", "tall"])
def test_streamed_u_equals_u_written_through_the_cache(tall, dtype):
    """A bucket's U from STREAM_MIN_BYTES (16 MiB) up is written with streaming stores (row_blocks.h): the same bits
    for U, M, the sums and the folded first product as the same matrices one call each (8-9 MiB, plain stores).
    Rows of 1000 (fp32) or 500 (fp64) values start off the 64-byte lines, so the unaligned head and the tail run."""
    rows, cols = (1000, 2200) if not tall else (2200, 1000)
    if dtype == torch.float64:
        cols //= 2
    shape = (2, rows, cols)
    assert 2 * rows * cols * dtype.itemsize >= 16 << 20 > rows * cols * dtype.itemsize

    def run(pieces):
        G, M = bucket(shape, dtype, 1), bucket(shape, dtype, 2)
        x0 = torch.randn(2, rows, generator=torch.Generator().manual_seed(4), dtype=dtype)
        us, sums_, ys = [], [], []
        for idx in pieces:
            U = torch.empty(len(idx), rows, cols, dtype=dtype)
            sums = torch.empty((len(idx), 1, cols) if tall else (len(idx), rows, 1), dtype=dtype)
            y0 = native_rownorm.momentum([G[i] for i in idx], [M[i] for i in idx], U, sums, 0.05, 19.0, True, tall,
                                         x0[idx].contiguous(), 1e-7)
            us += U.unbind(0)
            sums_ += sums.unbind(0)
            ys += [] if y0 is None else y0.unbind(0)
        return us + sums_ + ys + M

    streamed, plain = run([[0, 1]]), run([[0], [1]])
    assert len(streamed) == len(plain)
    for a, b in zip(streamed, plain):
        assert torch.equal(a, b)
