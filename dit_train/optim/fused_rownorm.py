"""The elementwise passes of a RowNorm step fused into two torch.compile'd passes per shape bucket
(`compile_rownorm`; `auto`, the default, compiles on CUDA and runs eagerly on CPU).

Eager, a RowNorm step is six torch ops per matrix (momentum lerp, Nesterov input stacked into U, U's row sums of
squares, weight decay, scaled update), ~2x the time of torch's fused AdamW kernel on the same matrices
(docs/bench_optimizer.md). Every row's norm needs the whole row before any of the update can be written, and a
tall matrix's rows of O(U) are its columns, so two passes over memory per bucket:
- momentum_pass: U's sums of squares over the rows of O(U) (rows if wide, columns if tall), unreduced, so that a
  sharded caller sums a tall shard's columns over the ranks as before, with U = G + c lerp(M, G, 1 - mu)
  (c = mu / (1 - mu); or c M without Nesterov). With the frobenius scale it only reads G and M (8 B per fp32
  element) and writes nothing. With the spectral scale, whose power iteration reads U, it also updates M and
  writes U into the caller's stacked workspace;
- update_pass: W <- (1 - lr wd) W - lr scale U s (s: the row factors, shaped to broadcast against W), with U read
  from the workspace or, when it was not stored, the momentum updated here and U recomputed from G and M: reads G,
  M, W and writes M, W (20 B).
So the frobenius step moves 28 B per fp32 element, as fused AdamW does. The momentum update sits in the second
pass because inductor's C++ backend splits a pass that both reduces and writes M into a reduction loop and a
store loop, reading G and M twice (36 B in all). One pass over memory for wide matrices (a row's sums, then its
update, while it is in cache: 20 B) needs both in one graph, which inductor 2.13's C++ backend fails to compile
(KeyError in its outer-loop local-buffer fusion on a graph that writes two inputs: pytorch/pytorch#196570).
Both are torch.compile'd functions (Triton on CUDA, C++ from inductor on CPU), compiled with static shapes
(_kernel) and unrolled over their list of matrices, so a bucket runs as calls of at most MAX_MATRICES_PER_CALL
matrices (and one remainder call): its cold compile grew with its size (dit_15b's buckets hold 50 matrices, one a
block), and a chunk's compiled code serves every chunk of its size and shape (docs/bench_optimizer.md, "Compile
cost"); lr is a 0-d tensor, so an lr schedule never recompiles them. A
tall matrix's column sums reduce blocks of COLUMN_SUM_BLOCK rows first, as inductor's plain reduction over dim -2
walks the columns with a stride on CPU (one thread, 8 x 3072 x 512: 1.4x a fused AdamW step on the same tensors
against 0.5x blocked). The results agree with the eager path to float rounding, not bit for bit: the kernels
contract multiply-adds and sum the squares in another order (tests/unit/test_fused_rownorm.py).
"""

from __future__ import annotations

import logging
import os
import shutil
import types

import torch
from torch import Tensor

COLUMN_SUM_BLOCK = 16
log = logging.getLogger("dit_train")
# the most matrices one compiled call takes: a bucket of more runs as calls of this many plus one remainder call,
# which share two compiled variants. Each compiled function is unrolled over its list of matrices, and its cold
# compile grows with the list (dit_15b's buckets hold one matrix per block, ~50); chunks bound it per bucket shape
# (docs/bench_optimizer.md, "compile cost")
MAX_MATRICES_PER_CALL = 8


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
    """With U stored (us): M updated in place, U written, U's sums returned. Without: only the sums of the U this
    step will have, read from G and M (M is updated by _update, which rewrites the same expression)."""
    sums = []
    for j, (g, buf) in enumerate(zip(grads, bufs)):
        if us is None:
            x = _direction_input(g, torch.lerp(buf, g, keep), c, nesterov, dtype)
        else:
            buf.lerp_(g, keep)
            x = _direction_input(g, buf, c, nesterov, dtype)
            us[j].copy_(x)
        sums.append(_sumsq(x, tall))
    return torch.stack(sums)


def _update(params: list[Tensor], grads: list[Tensor], bufs: list[Tensor], us: list[Tensor] | None,
            scales: list[Tensor], lr: Tensor, wd: float, scale: float, keep: float, c: float, nesterov: bool,
            dtype: torch.dtype) -> None:
    """W <- (1 - lr wd) W - lr scale U s; without a stored U, M <- lerp(M, G, keep) here and U from G and M."""
    decay, alpha = 1.0 - lr * wd, -lr * scale
    for j, (p, s) in enumerate(zip(params, scales)):
        if us is None:
            bufs[j].lerp_(grads[j], keep)
            u = _direction_input(grads[j], bufs[j], c, nesterov, dtype)
        else:
            u = us[j]
        p.mul_(decay).add_(u * s * alpha)


_compiled: dict = {}


def _kernel(fn, *variant):
    """fn compiled for one bucket (its shape, size, orientation, whether U is stored, ...): each variant gets its
    own copy of fn's code with static shapes, so that it compiles once and dynamo's per-code recompile limit (8)
    is never reached by the buckets of a model sharing one code object. Scalars that change during a run (lr)
    are tensors: a Python float is a guarded constant, and an lr schedule would recompile every step until the
    limit, then silently run eagerly (test_compiled_step_never_recompiles). fullgraph: a graph break would
    split a pass into separate kernels and is an error instead."""
    key = (fn, *variant)
    if key not in _compiled:
        if not _compiled:  # the first RowNorm step then takes tens of seconds on a GPU (the GPU check's first run)
            log.info("compiling the RowNorm passes (optimizer.compile_rownorm): the first RowNorm step takes longer, "
                     "once per process; inductor's on-disk cache serves the next run on this machine")
        copy = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__)
        _compiled[key] = torch.compile(copy, dynamic=False, fullgraph=True)
    return _compiled[key]


def _coefficient(mu: float, nesterov: bool) -> float:
    """`bufs` hold (1 - mu) M, as in MatrixOptimizer: G + mu M = G + c buf, M = c buf."""
    return mu / (1.0 - mu) if nesterov else 1.0 / (1.0 - mu)


def _chunks(n: int) -> list[slice]:
    """A bucket of n matrices as the slices its compiled calls take: at most MAX_MATRICES_PER_CALL each (None: one
    call for the whole bucket, as before chunking)."""
    step = MAX_MATRICES_PER_CALL or n
    return [slice(i, min(i + step, n)) for i in range(0, n, step)]


def _variant(tensors: list[Tensor], U: Tensor, tall: bool, store_u: bool) -> tuple:
    return len(tensors), tuple(U.shape[1:]), tensors[0].dtype, U.dtype, tensors[0].device, tall, store_u


def momentum_pass(grads: list[Tensor], bufs: list[Tensor], U: Tensor, mu: float, nesterov: bool, tall: bool,
                  store_u: bool) -> Tensor:
    """U's row sums of squares for every matrix of a bucket, stacked ([B, m, 1] wide, [B, 1, n] tall; fp32, fp64
    for fp64 input). store_u: the momentum is updated here and U[j] = the direction input of matrix j (U's dtype);
    otherwise nothing is written, and update_pass updates the momentum. Empty shards run the same function
    uncompiled (a zero size would specialise a graph)."""
    us = list(U.unbind(0)) if store_u else None
    rest = (1.0 - mu, _coefficient(mu, nesterov), nesterov, tall, U.dtype)
    if U.numel() == 0:
        return _momentum(grads, bufs, us, *rest)
    sums = []
    for c in _chunks(len(grads)):  # a loop, not a comprehension: a stack dump names momentum_pass (gpu_check)
        sums.append(_kernel(_momentum, *_variant(grads[c], U, tall, store_u))(grads[c], bufs[c], us and us[c], *rest))
    return sums[0] if len(sums) == 1 else torch.cat(sums)


def update_pass(params: list[Tensor], grads: list[Tensor], bufs: list[Tensor], U: Tensor, stored_u: bool,
                row_scale: Tensor, lr: Tensor, wd: float, scale: float, mu: float, nesterov: bool,
                tall: bool) -> None:
    """W_j <- (1 - lr wd) W_j - lr scale U_j row_scale_j for the bucket's matrices, one pass; lr a 0-d tensor on
    W's device. Unless momentum_pass stored U, the momentum update happens here too and U_j is recomputed from G_j
    and the updated momentum."""
    us = list(U.unbind(0)) if stored_u else None
    scales = list(row_scale.unbind(0))
    rest = (lr, wd, scale, 1.0 - mu, _coefficient(mu, nesterov), nesterov, U.dtype)
    if U.numel() == 0:
        return _update(params, grads, bufs, us, scales, *rest)
    for c in _chunks(len(params)):
        _kernel(_update, *_variant(params[c], U, tall, stored_u))(params[c], grads[c], bufs[c], us and us[c],
                                                                    scales[c], *rest)
