"""Ordinary (non-log) training steps must not make the host wait for the device (docs/algorithms.md, "Host
synchronisation"): every host read from dit_train's step path is counted per step, and so is every host-to-device
copy (a tensor made from Python data, or a CPU tensor copied to a device: on CUDA a copy from pageable memory that
the host waits for); an ordinary step may make only the one justified read (Trainer.step_flags: the finite check and
the stop vote), a log step reads the rest."""

import os
import sys
from collections import defaultdict

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import ROOT, compose, needs_fashion
from dit_train.telemetry import clocks as timing
from dit_train.parallel.fsdp import DistInfo
from dit_train.trainer.loop import Trainer

PACKAGE = os.path.join(ROOT, "dit_train") + os.sep
HOST_DATA = os.path.join(PACKAGE, "data") + os.sep  # the loader's index lists are host tensors: not a device read
READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__")
LIFTS = (torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default)
COPIES = (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default)
TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
MODE_MACHINERY = tuple(os.path.join(TORCH_DIR, p)  # the wrappers between an op and the mode's __torch_dispatch__
                       for p in ("_dynamo" + os.sep, "_compile.py", os.path.join("utils", "_python_dispatch.py")))


def _ours(frame) -> bool:
    name = frame.f_code.co_filename
    return name.startswith(PACKAGE) and not name.startswith(HOST_DATA)


def _caller(frame):
    """The frame that issued the op, past the dispatch mode's own wrappers."""
    while frame.f_code.co_filename.startswith(MODE_MACHINERY):
        frame = frame.f_back
    return frame


class HostToDevice(TorchDispatchMode):
    """Calls `record(what, frame)` for every tensor made from Python data (aten.lift_fresh: torch.tensor,
    torch.as_tensor of numbers or lists) and every copy of a CPU tensor to another device that dit_train's code
    asks for itself (like the patched reads: not what torch's own Python code, e.g. the DataLoader, does for it)."""

    def __init__(self, record):
        super().__init__()
        self.record = record

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in LIFTS:
            what = "tensor from host data"
        elif func in COPIES:
            src, dst = (args[1], args[0]) if func is torch.ops.aten.copy_.default else (args[0], out)
            what = "host-to-device copy" if src.device.type == "cpu" and dst.device.type != "cpu" else None
        else:
            what = None
        if what is not None:
            frame = _caller(sys._getframe(1))
            if _ours(frame):
                self.record(what, frame)
        return out


def count_host_reads(monkeypatch, trainer) -> tuple[dict[int, list[str]], HostToDevice]:
    """Host reads and host-to-device copies made by dit_train code, per training step (from the start of step s's
    train_step to the start of step s + 1's: the step, its bookkeeping and whatever the loop does after it). The
    copies are counted while the returned mode is active."""
    reads: dict[int, list[str]] = defaultdict(list)
    current = {"step": 0}

    def record(what: str, frame) -> None:
        reads[current["step"]].append(f"{what} in {frame.f_code.co_name}")

    def record_direct(what: str) -> None:  # a patched call made by dit_train code itself
        caller = sys._getframe(2)
        if _ours(caller):
            record(what, caller)

    for method in READS:
        original = getattr(torch.Tensor, method)

        def counting(self, *a, _original=original, _method=method, **kw):
            record_direct(_method)
            return _original(self, *a, **kw)

        monkeypatch.setattr(torch.Tensor, method, counting)
    for owner, name in ((torch.cuda, "synchronize"), (timing.HostClock, "wait"), (timing.CudaClock, "wait")):
        original = getattr(owner, name)

        def counting(*a, _original=original, _name=name, **kw):
            record_direct(_name)
            return _original(*a, **kw)

        monkeypatch.setattr(owner, name, staticmethod(counting) if isinstance(owner, type) else counting)

    step = trainer.train_step

    def numbered_step(*a, **kw):
        current["step"] = trainer.state.step + 1
        return step(*a, **kw)

    trainer.train_step = numbered_step
    return reads, HostToDevice(record)


@needs_fashion
@pytest.mark.parametrize("optimizer", ["adamw", "rownorm"])  # rownorm: with the spectral scale's power iteration
def test_ordinary_steps_read_nothing_but_the_step_flags(tiny_cfg, monkeypatch, optimizer):
    tiny_cfg.optimizer = compose([f"optimizer={optimizer}"]).optimizer
    tiny_cfg.train.update({"steps": 6, "log_every": 3, "val_every": 0, "ckpt_every": 0})
    trainer = Trainer(tiny_cfg, DistInfo())
    reads, copies = count_host_reads(monkeypatch, trainer)
    with copies:
        trainer.fit()
    flags = ["tolist in step_flags"]
    for step in (1, 2, 4, 5):
        assert reads[step] == flags, (step, reads[step])
    for step in (3, 6):  # log steps read the window: one wait, one copy of the losses and gradient norms
        assert reads[step][0] == "tolist in step_flags"
        assert "wait in read" in reads[step] and "tolist in read" in reads[step], (step, reads[step])
