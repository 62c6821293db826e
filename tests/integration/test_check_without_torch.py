"""The command line is checked before torch is imported: a bad value, a shape the data refuses, an unknown encoder
and --help answer in the time Python and Hydra take to start (~1 s), not torch's ~2 s more. Each case runs
`python -m dit_train` with `import torch` made to fail: a module of the check path that imports torch at its top
(an optimizer's schema beside its kernels, a package __init__ that loads the datasets) turns the answer into a
traceback here."""

import subprocess
import sys

import pytest

from conftest import ROOT

# runs dit_train's command line with every torch import refused
NO_TORCH = """
import runpy, sys
class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("the check imported " + name)
sys.meta_path.insert(0, NoTorch())
sys.argv = ["dit_train", *sys.argv[1:]]
runpy.run_module("dit_train", run_name="__main__")
"""


@pytest.mark.parametrize("args,answer", [
    (["optimizer.lr=-1"], "error: optimizer.lr=-1 is not valid: expected a learning rate > 0"),
    (["optimizer=periodic_rowwise", "optimizer.rownorm_scale=exact"],
     "error: optimizer.rownorm_scale='exact' is not valid: choose one of frobenius, spectral"),
    (["optimizer=mud", "optimizer.mud_passes=0"], "error: optimizer.mud_passes=0 is not valid: expected an integer >= 1"),
    (["data.channels=3"], "error: the data in "),
    (["eval.encoder=dino"], "error: eval.encoder='dino' is not valid: choose one of dinov2, "),
    (["data.root=/nonexistent"], "error: data.root='/nonexistent' is not valid: not a folder of the four Fashion-MNIST"),
])
def test_refusals_need_no_torch(args, answer):
    r = subprocess.run([sys.executable, "-c", NO_TORCH, *args], cwd="/tmp", capture_output=True, text=True,
                       timeout=120, env={"PYTHONPATH": ROOT, "PATH": "/usr/bin:/bin"})
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip().startswith(answer) and len(r.stderr.strip().splitlines()) == 1, r.stderr[-2000:]


def test_help_needs_no_torch():
    r = subprocess.run([sys.executable, "-c", NO_TORCH, "--help", "optimizer=periodic_rowwise"], cwd="/tmp",
                       capture_output=True, text=True, timeout=120, env={"PYTHONPATH": ROOT, "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr[-2000:]
    assert "  rownorm_scale: spectral " in r.stdout and "  K: 3 " in r.stdout  # the chosen optimizer's keys
