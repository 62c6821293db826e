"""The elementwise passes of a RowNorm step fused into two torch.compile'd passes per shape bucket
(`compile_rownorm`; `auto`, the default, compiles on CUDA and runs eagerly on CPU).

Eager, a RowNorm step is six torch ops per matrix (momentum lerp, Nesterov input stacked into U, U's row sums of
squares, weight decay, scaled update), ~2x the time of torch's fused AdamW kernel on the same matrices
(docs/bench_optimizer.md). Every row's norm needs the whole row before any of the update can be written, so two
passes are the fewest the maths allows:
- momentum_pass: M <- lerp(M, G, 1 - mu); U = G + c M (c = mu / (1 - mu); or c M without Nesterov); U's sums of
  squares over the rows of O(U) (rows if wide, columns if tall), unreduced, so that a sharded caller sums a tall
  shard's columns over the ranks as before. U is written into the caller's stacked workspace only when the
  direction reads it (the spectral RowNorm scale's power iteration); otherwise nothing but M is stored;
- update_pass: W <- decay W + alpha U s (s: the row factors, shaped to broadcast against W), with U read from the
  workspace or, when it was not stored, recomputed from G and M (two reads instead of one write and one read).
Read and written once each, that is 3 + 4 transfers per element, as many as fused AdamW's 7.
Both are torch.compile'd functions (Triton on CUDA, C++ from inductor on CPU), one call per bucket with dynamic
shapes; a tall matrix's column sums reduce blocks of COLUMN_SUM_BLOCK rows first, as inductor's plain reduction
over dim -2 walks the columns with a stride on CPU. The results agree with the eager path to float rounding, not
bit for bit: the kernels contract multiply-adds and sum the squares in another order (tests/unit/test_fused_rownorm.py).
"""

from __future__ import annotations

import os
import shutil
import types

import torch
from torch import Tensor

COLUMN_SUM_BLOCK = 16


def resolve_compile_rownorm(setting, matrices: list) -> bool:
    """compile_rownorm as the optimizer runs it. "auto" (the default): compiled where every matrix parameter is on
    CUDA (DTensor parameters report their mesh's device type), eager elsewhere: on CPU inductor's kernels were no
    faster than eager at one thread (docs/bench_optimizer.md) and cost compile seconds at the first RowNorm step.
    true compiles on every device, false never does."""
    if setting == "auto":
        return bool(matrices) and all(p.device.type == "cuda" for p in matrices)
    if not isinstance(setting, bool):
        raise ValueError(f"compile_rownorm={setting!r} is not valid; choose auto, true or false")
    return setting


def cpp_compiler() -> str | None:
    """The C++ compiler inductor builds CPU kernels with ($CXX, else g++, c++ or clang++ on PATH), or None."""
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


def check_buildable(setting, device) -> None:
    """optimizer.compile_rownorm=true on CPU runs inductor's C++ kernels: without a C++ compiler it is refused in one
    line before the run folder is written (instead of an InductorError traceback at the first RowNorm step)."""
    if setting is not True or torch.device(device).type != "cpu" or cpp_compiler() is not None:
        return
    from dit_train.config.errors import ConfigError

    raise ConfigError("optimizer.compile_rownorm=true on CPU needs a C++ compiler for torch.compile's kernels, and "
                      "none is on PATH ($CXX, g++, c++ or clang++): install one, or use optimizer.compile_rownorm=auto "
                      "(eager on CPU)")


def _sumsq(x: Tensor, tall: bool) -> Tensor:
    x = x.to(torch.promote_types(x.dtype, torch.float32))
    x = x * x
    if not tall:
        return x.sum(dim=-1, keepdim=True)
    m, n = x.shape
    if m % COLUMN_SUM_BLOCK == 0:
        return x.view(m // COLUMN_SUM_BLOCK, COLUMN_SUM_BLOCK, n).sum(dim=1).sum(dim=0, keepdim=True)
    return x.sum(dim=0, keepdim=True)


def _direction_input(g: Tensor, buf: Tensor, c: float, nesterov: bool, dtype: torch.dtype) -> Tensor:
    return (g + c * buf if nesterov else buf * c).to(dtype)


def _momentum(grads: list[Tensor], bufs: list[Tensor], us: list[Tensor] | None, keep: float, c: float,
              nesterov: bool, tall: bool, dtype: torch.dtype) -> Tensor:
    sums = []
    for j, (g, buf) in enumerate(zip(grads, bufs)):
        buf.lerp_(g, keep)
        x = _direction_input(g, buf, c, nesterov, dtype)
        if us is not None:
            us[j].copy_(x)
        sums.append(_sumsq(x, tall))
    return torch.stack(sums)


def _update(params: list[Tensor], grads: list[Tensor], bufs: list[Tensor], us: list[Tensor] | None,
            scales: list[Tensor], decay: float, alpha: float, c: float, nesterov: bool, dtype: torch.dtype) -> None:
    for j, (p, s) in enumerate(zip(params, scales)):
        u = us[j] if us is not None else _direction_input(grads[j], bufs[j], c, nesterov, dtype)
        p.mul_(decay).addcmul_(u, s, value=alpha)


_compiled: dict = {}


def _kernel(fn, *variant):
    """fn compiled once per variant (bucket size, orientation, whether U is stored, ...): each variant gets its own
    copy of fn's code, so that dynamo's per-code recompile limit (8) counts one variant's recompiles, not all."""
    key = (fn, *variant)
    if key not in _compiled:
        copy = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__)
        _compiled[key] = torch.compile(copy, dynamic=True)
    return _compiled[key]


def _coefficient(mu: float, nesterov: bool) -> float:
    """`bufs` hold (1 - mu) M, as in MatrixOptimizer: G + mu M = G + c buf, M = c buf."""
    return mu / (1.0 - mu) if nesterov else 1.0 / (1.0 - mu)


def momentum_pass(grads: list[Tensor], bufs: list[Tensor], U: Tensor, mu: float, nesterov: bool, tall: bool,
                  store_u: bool) -> Tensor:
    """The momentum update of every matrix of a bucket and U's row sums of squares, stacked ([B, m, 1] wide,
    [B, 1, n] tall; fp32, fp64 for fp64 input); U[j] = the direction input of matrix j if store_u (U's dtype
    either way). Empty shards run the same function uncompiled (a zero size would specialise a graph)."""
    us = list(U.unbind(0)) if store_u else None
    args = (grads, bufs, us, 1.0 - mu, _coefficient(mu, nesterov), nesterov, tall, U.dtype)
    if U.numel() == 0:
        return _momentum(*args)
    return _kernel(_momentum, len(grads), tall, store_u)(*args)


def update_pass(params: list[Tensor], grads: list[Tensor], bufs: list[Tensor], U: Tensor, stored_u: bool,
                row_scale: Tensor, decay: float, alpha: float, mu: float, nesterov: bool, tall: bool) -> None:
    """W_j <- decay W_j + alpha U_j row_scale_j for the bucket's matrices, one pass; U_j recomputed from G_j and
    the (updated) momentum unless momentum_pass stored it."""
    us = list(U.unbind(0)) if stored_u else None
    args = (params, grads, bufs, us, list(row_scale.unbind(0)), decay, alpha, _coefficient(mu, nesterov), nesterov,
            U.dtype)
    if U.numel() == 0:
        return _update(*args)
    _kernel(_update, len(params), tall, stored_u)(*args)
