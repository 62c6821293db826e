"""RMS norm over the last dimension (the DiT's qk-norm), with a cheaper autograd on the CPU.

On CUDA, and under torch.compile, `F.rms_norm` is used as it is (a fused kernel; inductor fuses it). On the CPU eager
path torch has no fused kernel: `F.rms_norm` is decomposed into ~6 elementwise ops whose autograd backward makes ~10
more full-size passes (about half of qk_norm's cost on the CPU presets, docs/qk_norm.md). `_CpuRmsNorm` runs the same
forward ops, so its output is bit-for-bit `F.rms_norm`'s, and a hand-derived backward of 6 passes; its input gradient
equals autograd's to float rounding (not bitwise: another order of the same arithmetic). tests/test_rms_norm.py checks
both against `F.rms_norm`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

LOW_PRECISION = (torch.bfloat16, torch.float16)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`F.rms_norm(x, (x.shape[-1],), weight, eps)`: the same values, a faster backward on the CPU."""
    if x.device.type != "cpu" or torch.compiler.is_compiling():
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return _CpuRmsNorm.apply(x, weight, eps)


class _CpuRmsNorm(torch.autograd.Function):
    """y = x r w with r = 1 / sqrt(mean(x^2) + eps), computed in fp32 for bf16/fp16 inputs and cast back, as
    F.rms_norm does. Backward: dw = sum over rows of g x r; dx = r (g w - x r mean(g w x r))."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        xc = x.float() if x.dtype in LOW_PRECISION else x  # F.rms_norm's opmath upcast
        r = torch.rsqrt(xc.pow(2).mean(-1, keepdim=True).add_(eps))
        ctx.save_for_backward(x, r, weight)
        return (xc * r * weight).type_as(x)

    @staticmethod
    def backward(ctx, g):
        x, r, weight = ctx.saved_tensors
        xr = x.to(r.dtype) * r  # recomputed: saving it would keep an fp32 copy of a bf16 input
        g = g.to(r.dtype)
        dw = None
        if ctx.needs_input_grad[1]:
            dw = (g * xr).reshape(-1, xr.shape[-1]).sum(0).to(weight.dtype)
        gw = g * weight
        dx = (gw - xr * (gw * xr).mean(-1, keepdim=True)).mul_(r)
        return dx.to(x.dtype), dw, None
