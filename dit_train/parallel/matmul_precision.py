"""fp32 matmul precision on CUDA, decided per computation (docs/algorithms.md, "fp32 matmul precision on CUDA").

The model's fp32 matmuls may use TF32 tensor cores (10-bit mantissa inputs, fp32 accumulation): `allow_tf32_globally`
sets that once per process (init_distributed, on CUDA). The optimizer's fp32 computations must not: NS5 in fp32
(ns_dtype=fp32 asks for fp32), MUD's Gram matrix and triangular solve (the Gram squares the condition number), and
the spectral scale's power iteration (matrix-vector products, memory bound: TF32 saves nothing there). They run
under `ieee_fp32_matmuls`, which sets full fp32 for their duration and restores the setting after.

Only the `allow_tf32` flags are used, not the newer `fp32_precision` settings: torch itself reads the flags (e.g.
dynamo's global-state key), and torch 2.13 raises on reading them once TF32 was switched on through the newer API.
On CPU the flags change nothing.
"""

from __future__ import annotations

import contextlib

import torch


def allow_tf32_globally() -> None:
    """fp32 matmuls and convolutions on CUDA may use TF32 (the model's fp32 work; the optimizer opts out)."""
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True


@contextlib.contextmanager
def ieee_fp32_matmuls():
    """Full fp32 for CUDA fp32 matmuls inside (also as a decorator); the previous setting is restored after."""
    matmul = torch.backends.cuda.matmul
    before = matmul.allow_tf32
    matmul.allow_tf32 = False
    try:
        yield
    finally:
        matmul.allow_tf32 = before
