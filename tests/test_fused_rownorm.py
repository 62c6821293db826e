"""compile_rownorm (optim/fused_rownorm.py): RowNorm steps whose elementwise passes run as torch.compile'd kernels
give the eager steps' parameters and momentum to float rounding, on wide, tall and square matrices, with and
without Nesterov, weight decay, the spectral RowNorm scale and an empty matrix; a periodic schedule still runs its
refresh steps eagerly. (The sharded path is in tests/test_sharded_optim.py's "compiled" case.)"""

import pytest
import torch

from dit_train.optim import fused_rownorm
from dit_train.optim.matrix_optimizer import MatrixOptimizer

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

SHAPES = [(24, 40), (24, 40), (40, 24), (32, 32), (50, 12), (0, 8)]


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


@pytest.mark.parametrize("kw", [dict(direction="rownorm"),
                                dict(direction="rownorm", nesterov=False, rownorm_scale="spectral"),
                                dict(direction="spectral", between="rownorm", refresh_every=2)],
                         ids=["rownorm", "no-nesterov-spectral-scale", "periodic"])
def test_compiled_rownorm_steps_equal_eager(kw, monkeypatch):
    eager, start, opt_e = run(False, **kw)
    used, kernel = [], fused_rownorm._kernel  # the compiled functions this case's steps ask for (the cache is shared)
    monkeypatch.setattr(fused_rownorm, "_kernel", lambda fn: (used.append(fn), kernel(fn))[1])
    fused, _, opt_c = run(True, **kw)
    for a, r, w0 in zip(fused, eager, start):
        if r.numel() == 0:
            continue
        rel = ((a - r).norm() / (r - w0).norm()).item()
        assert rel <= 1e-5, f"shape {tuple(r.shape)}: relative error {rel:.2e}"
        torch.testing.assert_close(opt_c.state[a]["momentum_buffer"], opt_e.state[r]["momentum_buffer"])
    assert set(used) == {fused_rownorm._momentum, fused_rownorm._update}  # this case took the fused path
    assert not any("row_sumsq" in ws for ws in opt_c._workspace.values())  # and every step's sums were used
