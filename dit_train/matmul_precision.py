"""fp32 matmul precision on CUDA, decided per computation (docs/algorithms.md, "fp32 matmul precision").

The model's fp32 matmuls may use TF32 tensor cores (10-bit mantissa inputs, fp32 accumulation): `allow_tf32_globally`
sets that once per process (init_distributed, on CUDA). The optimizer's fp32 computations must not: NS5 in fp32
(ns_dtype=fp32 asks for fp32), MUD's Gram matrix and triangular solve (the Gram squares the condition number), and
the spectral scale's power iteration (matrix-vector products, memory bound: TF32 saves nothing there). They run
under `ieee_fp32_matmuls`, which sets full fp32 for their duration and restores the setting after.

Only the new API (`fp32_precision`) is used: torch refuses to report a precision set through a mix of it and the
legacy `allow_tf32` flags. On CPU the flags change nothing.
"""

from __future__ import annotations

import contextlib

import torch


def allow_tf32_globally() -> None:
    """fp32 matmuls and convolutions on CUDA may use TF32 (the model's fp32 work; the optimizer opts out)."""
    torch.backends.cuda.matmul.fp32_precision = "tf32"
    torch.backends.cudnn.conv.fp32_precision = "tf32"


@contextlib.contextmanager
def ieee_fp32_matmuls():
    """Full fp32 for CUDA fp32 matmuls inside (also as a decorator); the previous setting is restored after."""
    matmul = torch.backends.cuda.matmul
    before = matmul.fp32_precision
    matmul.fp32_precision = "ieee"
    try:
        yield
    finally:
        matmul.fp32_precision = before
