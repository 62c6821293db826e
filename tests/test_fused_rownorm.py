"""compile_rownorm (optim/fused_rownorm.py): RowNorm steps whose elementwise passes run fused, as C loops
(optim/native_rownorm.py) or torch.compile'd kernels, give the eager steps' parameters and momentum to float
rounding, on wide, tall, square and one-row matrices, with and without Nesterov, weight decay, the spectral RowNorm
scale and an empty matrix; a periodic schedule still runs its refresh steps eagerly. (The sharded path is in
tests/test_sharded_optim.py's "compiled" cases.)"""

import subprocess
import sys

import pytest
import torch

from conftest import ROOT
from dit_train.optim import fused_rownorm, native_rownorm
from dit_train.optim.matrix_optimizer import MatrixOptimizer

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

SHAPES = [(24, 40), (24, 40), (40, 24), (32, 32), (50, 12), (1, 8), (0, 8)]  # (1, 8): one row, wide


def run(compile_rownorm: bool, steps: int = 3, **kw):
    g = torch.Generator().manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]
    start = [p.detach().clone() for p in ps]
    opt = MatrixOptimizer([{"params": ps, "kind": "matrix"}], lr=0.02, weight_decay=0.1,
                          compile_rownorm=compile_rownorm, **kw)
    for _ in range(steps):
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    return ps, start, opt


@pytest.mark.parametrize("backend", ["c", "inductor"])
@pytest.mark.parametrize("kw", [dict(direction="rownorm", rownorm_scale="frobenius"),
                                dict(direction="rownorm", nesterov=False, rownorm_scale="spectral"),
                                dict(direction="spectral", between="rownorm", refresh_every=2)],
                         ids=["rownorm-frobenius", "no-nesterov-spectral", "periodic-default-scale"])
def test_compiled_rownorm_steps_equal_eager(kw, backend, monkeypatch):
    """Both CPU backends of compile_rownorm: the C loops (native_rownorm.py, the default where they build) and
    the torch.compile kernels (what CUDA runs)."""
    eager, start, opt_e = run(False, **kw)
    used, kernel = [], fused_rownorm._kernel  # the compiled functions this case's steps ask for (the cache is shared)
    monkeypatch.setattr(fused_rownorm, "_kernel", lambda fn, *variant: (used.append(fn), kernel(fn, *variant))[1])
    for name in ("momentum", "update", "step"):  # record the C loops' calls
        fn = getattr(native_rownorm, name)
        monkeypatch.setattr(native_rownorm, name,
                            lambda *a, _fn=fn, _n=name, **k: (used.append(_n), _fn(*a, **k))[1])
    if backend == "inductor":
        monkeypatch.setattr(native_rownorm, "supports", lambda *tensors: False)
    else:
        assert native_rownorm.load() is not None, "the C kernels did not build (is there a C compiler?)"
    fused, _, opt_c = run(True, **kw)
    for a, r, w0 in zip(fused, eager, start):
        if r.numel() == 0:
            continue
        rel = ((a - r).norm() / (r - w0).norm()).item()
        assert rel <= 1e-5, f"shape {tuple(r.shape)}: relative error {rel:.2e}"
        torch.testing.assert_close(opt_c.state[a]["momentum_buffer"], opt_e.state[r]["momentum_buffer"])
    # this case took the fused path, on the backend asked for; with the frobenius scale the C loops run each
    # bucket's two passes as one call (whole matrices here: every bucket's row factors are local)
    c_calls = {"step"} if kw.get("rownorm_scale") == "frobenius" else {"momentum", "update"}
    expected = c_calls if backend == "c" else {fused_rownorm._momentum, fused_rownorm._update}
    assert set(used) == expected
    # and every step's sums (and the spectral scale's first products) were used
    assert not any(k in ws for ws in opt_c._workspace.values() for k in ("row_sumsq", "first_product"))
    # RowNorm's U (fp32 here; a refresh step's NS5 input is bf16) is formed only where the spectral scale's power
    # iteration reads it; otherwise the update recomputes it from G and M
    stored = any(("u", torch.float32) in ws for ws in opt_c._workspace.values())
    assert stored == (kw.get("rownorm_scale", "spectral") == "spectral")  # spectral: the default


def test_c_loops_match_eager_passes_in_fp64():
    """The C loops alone (on a bucket of one matrix), fp64, wide and tall, with U stored or not: M, U, the sums and
    W as the eager ops give them (to fp64 rounding)."""
    assert native_rownorm.load() is not None, "the C kernels did not build (is there a C compiler?)"
    g = torch.Generator().manual_seed(1)
    for shape, tall in (((6, 20), False), ((20, 6), True)):
        G, M, W = (torch.randn(shape, generator=g, dtype=torch.float64) for _ in range(3))
        keep, c = 0.05, 19.0
        M_ref = M.clone().lerp_(G, keep)
        X = G + c * M_ref
        sums_ref = (X * X).sum(dim=0 if tall else 1)
        s = torch.rand(shape[1] if tall else shape[0], dtype=torch.float64, generator=g)
        W_ref = W * 0.9 + 0.1 * X * (s if tall else s[:, None])
        for store in (True, False):
            M1, W1 = M.clone(), W.clone()
            U, sums = torch.zeros(1, *shape, dtype=torch.float64), torch.empty(1, len(s), dtype=torch.float64)
            native_rownorm.momentum([G], [M1], U if store else None, sums, keep, c, True, tall)
            native_rownorm.update([W1], [G], [M1], U if store else None, s[None], 0.9, 0.1, c, True, tall)
            torch.testing.assert_close(M1, M_ref)
            torch.testing.assert_close(sums[0], sums_ref)
            torch.testing.assert_close(W1, W_ref)
            if store:
                torch.testing.assert_close(U[0], X)


def test_compile_rownorm_auto_fuses_where_the_c_loops_run():
    """auto (the default): the C loops for fp32/fp64 CPU parameters, eager for others (bf16 here; CUDA's DTensors
    report device type cuda, like the meta tensors below); a bad value is refused in one line."""
    from conftest import compose

    from dit_train.config import ConfigError, validate

    assert native_rownorm.load() is not None, "the C kernels did not build (is there a C compiler?)"

    def fused(*matrices, setting="auto"):
        return MatrixOptimizer([torch.nn.Parameter(m) for m in matrices], lr=0.1,
                               compile_rownorm=setting).compile_rownorm

    assert fused(torch.zeros(4, 8), torch.zeros(8, 4, dtype=torch.float64))
    assert not fused(torch.zeros(4, 8), torch.zeros(4, 8, dtype=torch.bfloat16))
    assert not fused(torch.zeros(4, 8, device="meta"))
    assert fused(torch.zeros(4, 8, device="meta"), setting=True) and not fused(torch.zeros(4, 8), setting=False)
    with pytest.raises(ValueError, match="compile_rownorm='yes' is not valid; choose auto, true or false"):
        fused(torch.zeros(4, 8), setting="yes")
    assert compose(["optimizer=periodic_rowwise", "run_dir=/tmp/unused"]).optimizer.compile_rownorm == "auto"
    from dit_train.optim.registry import build_optimizer  # the run's optimizer line says which path auto took

    for dtype, path in ((torch.float32, "fused"), (torch.bfloat16, "eager")):
        opt = build_optimizer(torch.nn.Linear(8, 8, dtype=dtype), {"name": "rownorm"})
        assert f"RowNorm passes {path} (compile_rownorm auto)" in opt.routing_table
    with pytest.raises(ConfigError, match="compile_rownorm"):
        validate(compose(["optimizer=rownorm", "optimizer.compile_rownorm=yes", "run_dir=/tmp/unused"]))


ZEN4 = "vendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\nflags\t\t: fpu sse avx2 avx512f avx512bw\n"


@pytest.mark.parametrize("cpuinfo, width", [
    (ZEN4, 256),  # 512-bit operations split into two 256-bit halves
    (ZEN4.replace("avx512f avx512bw", ""), 512),  # Zen 3: no AVX-512, the flag changes nothing
    (ZEN4.replace("cpu family\t: 25", "cpu family\t: 26"), 512),  # Zen 5
    (ZEN4.replace("AuthenticAMD", "GenuineIntel").replace(": 25", ": 6"), 512),
    ("", 512),
], ids=["zen4", "zen3", "zen5", "intel", "unknown"])
def test_the_c_loops_are_built_for_256_bit_vectors_on_zen4_only(cpuinfo, width):
    assert native_rownorm.vector_width(cpuinfo) == width


def test_the_build_benchmark_builds_another_variant_and_times_it():
    """benchmarks/bench_rownorm_builds.py: sources copied, -DPI_GROUP and the vector width applied, a table row each."""
    r = subprocess.run([sys.executable, "-m", "benchmarks.bench_rownorm_builds", "--preset", "dit_xs", "--hidden-size", "64",
                        "--depth", "1", "--widths", "256", "--pi-groups", "1", "--repeats", "1"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [line for line in r.stdout.splitlines() if line.startswith("| 256")]
    assert len(rows) == 1 and rows[0].split("|")[2].strip() == "1", r.stdout
