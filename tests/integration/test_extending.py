"""docs/extending.md's worked example, from outside the package: a new direction (sign of U, with a key of its
own) is one class plus one registry line; it builds through the normal config path (check_optimizer: its key
typed and defaulted, a bad value refused in one line) and trains a tiny DiT, whose matrix updates equal an
independent reference of the maths (docs/algorithms.md §2: momentum, Nesterov, decoupled weight decay, s(W))."""

import math
from dataclasses import dataclass

import pytest
import torch
from omegaconf import OmegaConf

from test_optim_optimizers import flow_batch, flow_loss, tiny_dit

from dit_train.config import ConfigError, load_option
from dit_train.config.fields import number
from dit_train.optim.directions import Direction
from dit_train.optim.optimizer_config import MatrixConfig
from dit_train.optim.registry import OPTIMIZERS, build_optimizer, matrix


# ---- the example: what my_directions/sign.py would hold ----------------------------------------------------------
@dataclass
class SignConfig:
    sign_dead_zone: float = number("expected >= 0", lambda v: v >= 0, default=0.0,
                                   doc="entries of U with |u| at or below this move by 0")


class Sign(Direction):
    """Phi(U) = sign(U), zero where |U| <= dead_zone (signSGD-style)."""

    name = "sign"
    Config = SignConfig

    def __init__(self, dead_zone: float = 0.0):
        self.dead_zone = dead_zone

    @classmethod
    def from_config(cls, values):
        return cls(values["sign_dead_zone"])

    def group_keys(self):
        return {"sign_dead_zone": self.dead_zone}

    def __call__(self, U, group, ws, **placement):
        return torch.sign(U) * (U.abs() > group["sign_dead_zone"]), None


# ------------------------------------------------------------------------------------------------------------------
@pytest.fixture
def registered(monkeypatch):
    monkeypatch.setitem(OPTIMIZERS, "sign", matrix("sign", Sign))  # the one registry line


def matrix_defaults() -> dict:
    """The shared matrix-optimizer values (MatrixConfig's keys, as muon has them)."""
    muon = OmegaConf.to_container(load_option("optimizer", "muon"), resolve=True)
    return {k: v for k, v in muon.items() if k in MatrixConfig.__dataclass_fields__}


def test_the_new_key_is_checked_and_defaulted(registered):
    with pytest.raises(ConfigError, match=r"^optimizer.sign_dead_zone=-1 is not valid: expected >= 0$"):
        build_optimizer(tiny_dit(), {**matrix_defaults(), "name": "sign", "sign_dead_zone": -1})
    opt = build_optimizer(tiny_dit(), {**matrix_defaults(), "name": "sign"})
    assert {g.get("sign_dead_zone") for g in opt.param_groups if g["kind"] == "matrix"} == {0.0}
    assert "sign: matrix direction sign every step" in opt.routing_table


def test_a_tiny_dit_trains_with_the_new_direction_as_the_reference_says(registered):
    lr, wd, mu, dead = 0.01, 0.1, 0.9, 1e-3
    model = tiny_dit(perturb=True).double()
    opt = build_optimizer(model, {**matrix_defaults(), "name": "sign", "lr": lr, "weight_decay": wd, "momentum": mu,
                                  "sign_dead_zone": dead})
    names = {id(p): n for n, p in model.named_parameters()}
    matrices = [p for p in opt.param_groups[0]["params"]]
    assert opt.param_groups[0]["kind"] == "matrix" and len(matrices) >= 8
    M = {id(p): torch.zeros_like(p) for p in matrices}
    for step in range(3):
        loss = flow_loss(model, tuple(t.double() if t.is_floating_point() else t for t in flow_batch(step)))
        loss.backward()
        expected = {}
        for p in matrices:  # the reference, from the gradients alone
            G, (m, n) = p.grad.detach(), p.shape
            M[id(p)] = mu * M[id(p)] + G
            U = G + mu * M[id(p)]
            phi = torch.where(U.abs() > dead, torch.sign(U), torch.zeros_like(U))
            expected[id(p)] = (1 - lr * wd) * p.detach() - lr * 0.2 * math.sqrt(max(m, n)) * phi
        opt.step()
        opt.zero_grad(set_to_none=True)
        for p in matrices:
            torch.testing.assert_close(p.detach(), expected[id(p)], rtol=0, atol=1e-12,
                                       msg=lambda s: f"step {step}, {names[id(p)]}: {s}")


def test_the_optimizer_library_loads_no_training_loop_module():
    """optim/ is a library (issue 27): importing the registry brings in config and maths, not the trainer or its
    timers (the old and the new layout's names)."""
    import subprocess
    import sys

    from conftest import ROOT

    code = "import sys, dit_train.optim.registry; print(' '.join(m for m in sys.modules if m.startswith('dit_train')))"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    loaded = r.stdout.split()
    assert "dit_train.optim.registry" in loaded
    trainer = ("dit_train.train", "dit_train.trainer", "dit_train.timing", "dit_train.telemetry", "dit_train.build")
    assert not [m for m in loaded if m.startswith(trainer)], loaded


def test_a_metric_of_the_package_is_the_pages_file_and_one_line(tmp_path):
    """docs/extending.md: a new metric of the package is its own file plus one line. The line was an entry of
    metric.py's METRICS, whose import (above METRICS, to name the class there) stopped the page's file in a circular
    ImportError (it imports register_metric, defined below); now the module's name in PACKAGE_METRICS, imported once
    register_metric exists. Done in a copy of the package, as its developer would: the page's file as it is."""
    import os
    import re
    import shutil
    import subprocess
    import sys

    from conftest import ROOT

    shutil.copytree(os.path.join(ROOT, "dit_train"), tmp_path / "dit_train",
                    ignore=shutil.ignore_patterns("__pycache__"))
    page = open(os.path.join(ROOT, "docs", "extending.md")).read()
    assert "`dit_train.evaluation.metric.PACKAGE_METRICS`" in page
    block = next(b for b in re.findall(r"```python\n(.*?)```", page, re.S) if "class MeanPixel(Metric)" in b)
    (tmp_path / "dit_train" / "evaluation" / "mean_pixel.py").write_text(block)
    metric = tmp_path / "dit_train" / "evaluation" / "metric.py"
    line = "PACKAGE_METRICS: tuple[str, ...] = ()\n"
    assert line in metric.read_text()
    metric.write_text(metric.read_text().replace(line, line.replace("()", '("dit_train.evaluation.mean_pixel",)')))
    r = subprocess.run([sys.executable, "-m", "dit_train", "experiment=debug", "eval.mean_pixel.num_images=0"],
                       cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(tmp_path)}, capture_output=True, text=True,
                       timeout=120)
    # its keys joined the config (checked, refused in one line), as for a metric registered from outside
    assert r.returncode == 2 and r.stderr.splitlines() == [
        "error: eval.mean_pixel.num_images=0 is not valid: expected an integer >= 1"], r.stderr[-2000:]
