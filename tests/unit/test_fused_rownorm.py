"""compile_rownorm (optim/fused_rownorm.py): RowNorm steps whose elementwise passes run as torch.compile'd
kernels (inductor's C++ on this CPU) give the eager steps' parameters and momentum to float
rounding, on wide, tall, square and one-row matrices, with and without Nesterov, weight decay, the spectral RowNorm
scale and an empty matrix; a periodic schedule still runs its refresh steps eagerly. (The sharded path is in
tests/integration/test_sharded_optim.py's "compiled" cases.)"""

import pytest
import torch

from dit_train.optim import fused_rownorm
from dit_train.optim.directions import NS5, RowNorm
from dit_train.optim.matrix_optimizer import MatrixOptimizer

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

SHAPES = [(24, 40), (24, 40), (40, 24), (32, 32), (50, 12), (1, 8), (0, 8)]  # (1, 8): one row, wide


def run(compile_rownorm: bool, steps: int = 3, rownorm_scale: str = "spectral", periodic: bool = False, **kw):
    g = torch.Generator().manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]
    start = [p.detach().clone() for p in ps]
    rownorm = RowNorm(rownorm_scale, compile_rownorm)
    directions = dict(direction=NS5(), between=rownorm, refresh_every=2) if periodic else dict(direction=rownorm)
    opt = MatrixOptimizer([{"params": ps, "kind": "matrix"}], lr=0.02, weight_decay=0.1, **directions, **kw)
    for _ in range(steps):
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    return ps, start, opt


needs_cxx = pytest.mark.skipif(fused_rownorm.cpp_compiler() is None,
                               reason="no C++ compiler on PATH: inductor cannot build the CPU kernels")


@needs_cxx
@pytest.mark.parametrize("kw", [dict(rownorm_scale="frobenius"), dict(nesterov=False, rownorm_scale="spectral"),
                                dict(periodic=True)],
                         ids=["rownorm-frobenius", "no-nesterov-spectral", "periodic-default-scale"])
def test_compiled_rownorm_steps_equal_eager(kw, monkeypatch):
    """The torch.compile'd passes (inductor's C++ kernels on CPU; Triton on CUDA runs the same graphs)."""
    eager, start, opt_e = run(False, **kw)
    used, kernel = [], fused_rownorm._kernel  # the compiled functions this case's steps ask for (the cache is shared)
    monkeypatch.setattr(fused_rownorm, "_kernel", lambda fn, *variant: (used.append(fn), kernel(fn, *variant))[1])
    fused, _, opt_c = run(True, **kw)
    for a, r, w0 in zip(fused, eager, start):
        if r.numel() == 0:
            continue
        rel = ((a - r).norm() / (r - w0).norm()).item()
        assert rel <= 1e-5, f"shape {tuple(r.shape)}: relative error {rel:.2e}"
        torch.testing.assert_close(opt_c.state[a]["momentum_buffer"], opt_e.state[r]["momentum_buffer"])
    assert set(used) == {fused_rownorm._momentum, fused_rownorm._update}  # this case took the compiled passes
    assert not any("row_sumsq" in ws for ws in opt_c._workspace.values())  # and every step's sums were used
    # RowNorm's U (fp32 here; a refresh step's NS5 input is bf16) is formed only where the spectral scale's power
    # iteration reads it; otherwise the update recomputes it from G and M
    stored = any(("u", torch.float32) in ws for ws in opt_c._workspace.values())
    assert stored == (kw.get("rownorm_scale", "spectral") == "spectral")  # spectral: the default


@needs_cxx
def test_compiled_passes_match_eager_ops_in_fp64():
    """The compiled passes alone (a bucket of one matrix), fp64, wide and tall, with U stored or not: M, U, the sums
    and W as independent eager formulas give them (to fp64 rounding); without a stored U the momentum pass writes
    nothing and the update pass updates M."""
    g = torch.Generator().manual_seed(1)
    mu, lr, wd, scale = 0.95, 0.1, 0.5, 2.0
    for shape, tall in (((6, 20), False), ((20, 6), True), ((48, 6), True)):  # 48: column sums in blocks of 16
        G, M, W = (torch.randn(shape, generator=g, dtype=torch.float64) for _ in range(3))
        M_ref = M + (1 - mu) * (G - M)  # the state holds (1 - mu) M: lerp toward G
        X = G + mu / (1 - mu) * M_ref
        sums_ref = (X * X).sum(dim=0 if tall else 1)
        s = torch.rand(shape[1] if tall else shape[0], dtype=torch.float64, generator=g)
        scale_rows = s[None] if tall else s[:, None]
        W_ref = W * (1 - lr * wd) - lr * scale * X * scale_rows
        for store in (True, False):
            M1, W1 = M.clone(), W.clone()
            U = torch.zeros(1, *shape, dtype=torch.float64)
            U_in = U if store else torch.zeros((), dtype=torch.float64).expand(1, *shape)
            sums = fused_rownorm.momentum_pass([G], [M1], U_in, mu, True, tall, store)
            torch.testing.assert_close(sums.reshape(-1), sums_ref)
            torch.testing.assert_close(M1, M_ref if store else M)  # without U, the momentum moves in the update
            fused_rownorm.update_pass([W1], [G], [M1], U_in, store, scale_rows[None],
                                      torch.tensor(lr, dtype=torch.float64), wd, scale, mu, True, tall)
            torch.testing.assert_close(M1, M_ref)
            torch.testing.assert_close(W1, W_ref)
            if store:
                torch.testing.assert_close(U[0], X)



@needs_cxx
@pytest.mark.parametrize("tall", [False, True])
def test_bf16_matrices_sum_their_squares_in_fp32(tall):
    """bf16 parameters: U is stored in bf16, but its sums of squares are fp32 (a bf16 sum over 64 elements keeps
    3 significant digits)."""
    g = torch.Generator().manual_seed(3)
    shape = (64, 8) if tall else (8, 64)
    G, M = (torch.randn(shape, generator=g).bfloat16() for _ in range(2))
    U = torch.zeros(1, *shape, dtype=torch.bfloat16)
    sums = fused_rownorm.momentum_pass([G], [M], U, 0.9, True, tall, True)
    X = U[0].float()
    assert sums.dtype == torch.float32
    # the kernel may square U before its rounding to bf16 (inductor keeps the fp32 value): bf16's 2^-8 apart
    torch.testing.assert_close(sums.reshape(-1), (X * X).sum(dim=0 if tall else 1), rtol=8e-3, atol=0)

@needs_cxx
@pytest.mark.parametrize("rownorm_scale", ["frobenius", "spectral"])
def test_a_large_bucket_compiles_chunks_of_bounded_size_with_the_same_results(rownorm_scale, monkeypatch):
    """A bucket of more matrices than MAX_MATRICES_PER_CALL (here 7 of each shape, 3 a call) runs as calls of 3 and
    one of 1: two compiled variants per pass and shape, whatever the bucket's size (each compiled function is
    unrolled over its matrices, and its cold compile grew with them: ~50 per bucket at dit_15b), with the weights
    and momentum of one call per bucket to float rounding."""
    def steps(chunk):
        monkeypatch.setattr(fused_rownorm, "MAX_MATRICES_PER_CALL", chunk)
        monkeypatch.setattr(fused_rownorm, "_compiled", {})
        g = torch.Generator().manual_seed(4)
        ps = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in [(8, 12)] * 7 + [(12, 8)] * 7]
        opt = MatrixOptimizer([{"params": ps, "kind": "matrix"}], lr=0.02, weight_decay=0.1,
                              direction=RowNorm(rownorm_scale, True))
        for _ in range(2):
            for p in ps:
                p.grad = torch.randn(p.shape, generator=g)
            opt.step()
        sizes = sorted(key[1] for key in fused_rownorm._compiled)  # key: (fn, matrices per call, ...)
        return ps, [opt.state[p]["momentum_buffer"] for p in ps], sizes

    whole, whole_m, whole_sizes = steps(None)
    chunked, chunked_m, sizes = steps(3)
    assert whole_sizes == [7] * 4  # two passes x two orientations, one call per bucket
    assert sizes == [1] * 4 + [3] * 4  # the same, in calls of 3 and a remainder of 1
    for a, r, ma, mr in zip(chunked, whole, chunked_m, whole_m):
        torch.testing.assert_close(a, r)
        torch.testing.assert_close(ma, mr)


@needs_cxx
@pytest.mark.parametrize("rownorm_scale", ["frobenius", "spectral"])
def test_compiled_step_never_recompiles(rownorm_scale, monkeypatch):
    """Once a bucket's passes are compiled, later steps with another lr (a schedule changes it every step) and other
    gradients run the same graphs: a recompile is an error here. (With lr as a Python float they recompiled at
    every new lr until dynamo's limit of 8, then ran eagerly.)"""
    g = torch.Generator().manual_seed(2)
    ps = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in ((24, 40), (24, 40), (40, 24))]
    opt = MatrixOptimizer([{"params": ps, "kind": "matrix"}], lr=0.02, weight_decay=0.1,
                          direction=RowNorm(rownorm_scale, True))
    for step in range(4):
        if step == 1:
            monkeypatch.setattr(torch._dynamo.config, "error_on_recompile", True)
        for group in opt.param_groups:
            group["lr"] = 0.02 / (step + 1)
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()


def test_compile_rownorm_auto_compiles_on_cuda_only():
    """auto (the default): compiled for CUDA parameters (DTensors report their mesh's device type), eager on CPU and
    for fake tensors; a bad value is refused in one line; the run's optimizer line says which path auto took."""
    from types import SimpleNamespace

    from conftest import compose

    from dit_train.config import ConfigError, validate
    from dit_train.optim.registry import build_optimizer

    cuda = SimpleNamespace(device=torch.device("cuda"))  # what resolve reads of a CUDA parameter
    resolve = fused_rownorm.resolve_compile_rownorm
    assert resolve("auto", [cuda, cuda]) and not resolve("auto", [cuda, torch.zeros(2)])
    assert not resolve("auto", [torch.zeros(4, 8)]) and not resolve("auto", [])
    assert resolve(True, [torch.zeros(4, 8)]) and not resolve(False, [cuda])
    with pytest.raises(ValueError, match="compile_rownorm='yes' is not valid; choose auto, true or false"):
        resolve("yes", [cuda])
    assert compose(["optimizer=periodic_rowwise", "run_dir=/tmp/unused"]).optimizer.compile_rownorm == "auto"
    for setting, path in (("auto", "eager"), (True, "fused")):
        opt = build_optimizer(torch.nn.Linear(8, 8), {"name": "rownorm", "compile_rownorm": setting})
        assert f"RowNorm passes {path} (compile_rownorm {setting})" in opt.routing_table
    with pytest.raises(ConfigError, match="compile_rownorm"):
        validate(compose(["optimizer=rownorm", "optimizer.compile_rownorm=yes", "run_dir=/tmp/unused"]))


def test_the_first_compile_of_a_process_is_said_once(monkeypatch, caplog):
    """On the GPU check's first H200 run a first RowNorm step took 13.9 s against 0.2 s after it, silently: a
    user would think the step hung. The first compile of the process is said, once, whatever the buckets."""
    import logging

    from dit_train.optim import fused_rownorm

    monkeypatch.setattr(fused_rownorm, "_compiled", {})
    monkeypatch.setattr(fused_rownorm.torch, "compile", lambda fn, **kwargs: fn)  # the message, not the compiler
    caplog.set_level(logging.INFO, logger="dit_train")
    for shape in ((4, 3), (4, 3), (5, 2)):
        g = torch.ones(*shape)
        fused_rownorm.momentum_pass([g], [g.clone()], g[None].clone(), 0.9, True, False, False)
    said = [r.getMessage() for r in caplog.records if "compiling the RowNorm passes" in r.getMessage()]
    assert len(fused_rownorm._compiled) == 2 and len(said) == 1, said
