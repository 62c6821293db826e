"""Ordinary (non-log) training steps must not make the host wait for the device (docs/algorithms.md, "Host
synchronisation"): every host read from dit_train's step path is counted per step; an ordinary step may make only
the one justified read (Trainer.step_flags: the finite check and the stop vote), a log step reads the rest."""

import os
import sys
from collections import defaultdict

import torch

from conftest import needs_fashion
from dit_train import timing
from dit_train.parallel import DistInfo
from dit_train.train import Trainer

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "dit_train") + os.sep
HOST_DATA = os.path.join(PACKAGE, "data") + os.sep  # the loader's index lists are host tensors: not a device read
READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__")


def count_host_reads(monkeypatch, trainer) -> dict[int, list[str]]:
    """Host reads made by dit_train code, per training step (from the start of step s's train_step to the start of
    step s + 1's: the step, its bookkeeping and whatever the loop does after it)."""
    reads: dict[int, list[str]] = defaultdict(list)
    current = {"step": 0}

    def record(what: str) -> None:
        caller = sys._getframe(2)
        name = caller.f_code.co_filename
        if name.startswith(PACKAGE) and not name.startswith(HOST_DATA):
            reads[current["step"]].append(f"{what} in {caller.f_code.co_name}")

    for method in READS:
        original = getattr(torch.Tensor, method)

        def counting(self, *a, _original=original, _method=method, **kw):
            record(_method)
            return _original(self, *a, **kw)

        monkeypatch.setattr(torch.Tensor, method, counting)
    # a device tensor made from host values (torch.tensor(v, device=...)) is a blocking copy on CUDA: a sync too
    original_tensor = torch.tensor

    def counting_tensor(*a, _original=original_tensor, **kw):
        if kw.get("device") is not None:
            record("tensor(device=)")
        return _original(*a, **kw)

    monkeypatch.setattr(torch, "tensor", counting_tensor)
    for owner, name in ((torch.cuda, "synchronize"), (timing.HostClock, "wait"), (timing.CudaClock, "wait")):
        original = getattr(owner, name)

        def counting(*a, _original=original, _name=name, **kw):
            record(_name)
            return _original(*a, **kw)

        monkeypatch.setattr(owner, name, staticmethod(counting) if isinstance(owner, type) else counting)

    step = trainer.train_step

    def numbered_step(*a, **kw):
        current["step"] = trainer.state.step + 1
        return step(*a, **kw)

    trainer.train_step = numbered_step
    return reads


@needs_fashion
def test_ordinary_steps_read_nothing_but_the_step_flags(tiny_cfg, monkeypatch):
    tiny_cfg.train.update({"steps": 6, "log_every": 3, "val_every": 0, "ckpt_every": 0})
    trainer = Trainer(tiny_cfg, DistInfo())
    reads = count_host_reads(monkeypatch, trainer)
    trainer.fit()
    flags = ["tolist in step_flags"]
    for step in (1, 2, 4, 5):
        assert reads[step] == flags, (step, reads[step])
    for step in (3, 6):  # log steps read the window: one wait, one copy of the losses and gradient norms
        assert reads[step][0] == "tolist in step_flags"
        assert "wait in read" in reads[step] and "tolist in read" in reads[step], (step, reads[step])
