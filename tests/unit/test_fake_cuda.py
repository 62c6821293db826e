"""The trainer's CUDA-only branches on fake CUDA tensors (#29 item 4): FakeTensorMode makes device="cuda" tensors on
a CPU-only build, so every decision taken from a tensor's device is checked here at dit_15b's per-matrix shapes
(4096 wide, 32 heads of 128; 2 of its 50 blocks: the same shapes and branches, 1/25 of the dispatch), and so is
what runs on them: AdamW's fused CUDA step.

What cannot run here: on a CPU-only build every op whose kernel takes a CUDA device guard raises on a fake CUDA
tensor (indexing, autograd's engine, so the model's forward and backward and the matrix optimizers' stacking of
their inputs), and FSDP2 asks the CUDA runtime for the current device. test_a_cpu_build_cannot_index_a_fake_cuda_tensor
pins that limit; those paths run on the device in benchmarks/gpu_check.sh's `optimizers` and dit_15b stages, and
docs/gpu_check.md lists the branches no test reaches."""

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from dit_train.runs.checkpoint_saver import resolve_async
from dit_train.model.dit import build_model, load_preset
from dit_train.optim.fused_rownorm import resolve_compile_rownorm
from dit_train.optim.registry import OPTIMIZERS, build_optimizer
from dit_train.optim.routing import route_parameters
from dit_train.parallel.fsdp import DistInfo, backend_for, compute_precision, resolve_plan
from dit_train.telemetry.clocks import CudaClock, clock_for

BLOCKS = 2
CUDA = torch.device("cuda", 0)
pytestmark = pytest.mark.skipif(torch.version.cuda is not None, reason="for CPU-only builds (a CUDA build runs "
                                                                       "these paths for real)")


def fake_cuda_dit_15b() -> nn.Module:
    """dit_15b with BLOCKS blocks, every parameter a fake CUDA tensor (call inside FakeTensorMode). Built on the meta
    device and swapped in: to_empty cannot swap a plain module's parameters for fake tensors."""
    model = build_model(load_preset("dit_15b", depth=BLOCKS), device="meta")
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            setattr(module, name, nn.Parameter(torch.empty(p.shape, device="cuda")))
    return model


def test_the_device_decides_the_cuda_branches():
    with FakeTensorMode():
        model = fake_cuda_dit_15b()
        matrices = [p for _, p in route_parameters(model).matrix]
        assert {tuple(p.shape) for p in matrices} == {(12288, 4096), (4096, 4096), (16384, 4096), (4096, 16384),
                                                      (24576, 4096), (8192, 4096), (4096, 256)}
        assert all(p.device == CUDA for p in model.parameters())
        # RowNorm's passes are torch.compile'd on CUDA (compile_rownorm=auto; eager on CPU)
        assert resolve_compile_rownorm("auto", matrices) is True
        for name in OPTIMIZERS:
            opt = build_optimizer(model, {"name": name})
            if name in ("rownorm", "periodic_rowwise"):
                assert opt.compile_rownorm is True, name
                assert "RowNorm passes fused (compile_rownorm auto)" in opt.routing_table, name
    assert compute_precision("auto", CUDA) == "bf16"
    plan = resolve_plan(OmegaConf.create({"fsdp": True}), DistInfo(device=CUDA))
    assert plan.param_dtype == torch.bfloat16 and plan.reduce_dtype == torch.float32
    assert resolve_async("auto", CUDA) is True  # checkpoints written in the background on CUDA
    assert isinstance(clock_for(CUDA), CudaClock)
    assert backend_for(CUDA) == "nccl"


def test_adamw_steps_on_fake_cuda_at_dit_15b_shapes():
    """The fused AdamW kernel on CUDA parameters (adamw_impl=fused): two steps, its state beside the parameters."""
    with FakeTensorMode():
        model = fake_cuda_dit_15b()
        opt = build_optimizer(model, {"name": "adamw"})
        for _ in range(2):
            for p in model.parameters():
                p.grad = torch.empty_like(p)
            opt.step()
            opt.zero_grad(set_to_none=True)
        fc1 = model.blocks[0].mlp.fc1.weight
        state = opt.state[fc1]
        for key in ("exp_avg", "exp_avg_sq"):
            assert (state[key].device, state[key].dtype, tuple(state[key].shape)) == (CUDA, torch.float32,
                                                                                     (16384, 4096))
        assert (fc1.device, fc1.dtype) == (CUDA, torch.float32)


def test_a_cpu_build_cannot_index_a_fake_cuda_tensor():
    """Why the model and the matrix optimizers are not traced here. Should this fail, torch traces them on a
    CPU-only build: extend test_adamw_steps_on_fake_cuda_at_dit_15b_shapes to every optimizer and the model's
    forward and backward."""
    with FakeTensorMode():
        stacked = torch.empty(2, 3, 4, device="cuda")
        assert stacked.device == CUDA
        with pytest.raises(RuntimeError, match="not linked with support for cuda devices"):
            stacked[0]
