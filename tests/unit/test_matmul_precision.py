"""fp32 matmul precision per computation (dit_train/parallel/matmul_precision.py, docs/algorithms.md): with TF32 allowed
globally for the model (as init_distributed does on CUDA), every fp32 matmul of the optimizer's directions runs
under full fp32, and the global setting is back afterwards. On CPU the flag changes no result, so the tests watch
the flag each matmul is dispatched under."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dit_train.parallel.matmul_precision import allow_tf32_globally
from dit_train.optim.directions import mud_whiten, newton_schulz5
from dit_train.optim.registry import build_optimizer
from dit_train.optim.spectral_cap import capped_row_norm_scale
from test_optim_optimizers import flow_batch, flow_loss, tiny_dit

aten = torch.ops.aten
MATMULS = {aten.mm.default, aten.bmm.default, aten.addmm.default, aten.baddbmm.default, aten.matmul.default,
           aten.mm.out, aten.bmm.out, aten.baddbmm.out, aten.addmm.out}


class MatmulPrecisions(TorchDispatchMode):
    """Whether CUDA fp32 matmuls may use TF32 at each fp32 matmul ("tf32" or "ieee")."""

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in MATMULS and any(isinstance(a, torch.Tensor) and a.dtype == torch.float32 for a in args):
            self.seen.append("tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee")
        return func(*args, **(kwargs or {}))


@pytest.fixture
def tf32_everywhere():
    """TF32 allowed globally, as on a CUDA run; the process's settings restored afterwards."""
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    allow_tf32_globally()
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def run_watched(fn):
    with MatmulPrecisions() as watch:
        fn()
    assert torch.backends.cuda.matmul.allow_tf32  # the model's setting, back after the computation
    assert torch._C._get_cublas_allow_tf32()  # what torch itself reads (dynamo's global state): readable
    return watch.seen


@pytest.mark.parametrize("name", ["ns5_plain", "ns5_gram", "mud", "spectral_cap"])
def test_each_direction_runs_its_fp32_matmuls_in_full_fp32(tf32_everywhere, name):
    X = torch.randn(3, 16, 64)
    fns = {"ns5_plain": lambda: newton_schulz5(X, dtype=torch.float32, gram=False),
           "ns5_gram": lambda: newton_schulz5(X, dtype=torch.float32, gram=True),
           "mud": lambda: mud_whiten(X),
           "spectral_cap": lambda: capped_row_norm_scale(X, torch.rand(3, 16, 1))}
    seen = run_watched(fns[name])
    assert seen and set(seen) == {"ieee"}, seen


@pytest.mark.parametrize("name, extra", [("muon", {"ns_dtype": "fp32"}), ("mud", {}),
                                         ("rownorm", {"compile_rownorm": False})])
def test_an_optimizer_step_runs_every_fp32_matmul_in_full_fp32(tf32_everywhere, name, extra):
    model = tiny_dit(perturb=True)
    opt = build_optimizer(model, {"name": name, **extra})
    flow_loss(model, flow_batch(0)).backward()
    seen = run_watched(opt.step)
    assert seen and set(seen) == {"ieee"}, seen


def test_the_model_keeps_tf32(tf32_everywhere):
    """What the optimizer opts out of is still on for the model's fp32 matmuls."""
    model = tiny_dit()
    seen = run_watched(lambda: flow_loss(model, flow_batch(0)))
    assert seen and set(seen) == {"tf32"}, seen
