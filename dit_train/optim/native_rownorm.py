"""RowNorm's fused passes on CPU as hand-written C loops (rownorm_kernels.c), called through ctypes.

compile_rownorm's CPU path: inductor's kernels for these passes read G and M twice (the row sums and the stores
are two loop nests) and walk tall matrices' columns with a stride, ~2x the time of torch's fused AdamW on the
same matrices; these loops touch every element once, in memory order (docs/bench_optimizer.md). The source is
compiled once per machine with the system C compiler (the one inductor needs too) into a cache folder, keyed by
the source's hash and the host; without a compiler, `load()` gives None and the torch.compile kernels run.
They take contiguous fp32/fp64 CPU tensors (`supports`); the momentum pass's sums come back in the input's dtype,
as fp32 and fp64 are already the accumulation dtypes of the eager path.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings

import torch
from torch import Tensor

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rownorm_kernels.c")
FLAGS = ["-O3", "-march=native", "-fopenmp-simd", "-shared", "-fPIC"]
_SUFFIX = {torch.float32: "f32", torch.float64: "f64"}
_CTYPE = {torch.float32: ctypes.c_float, torch.float64: ctypes.c_double}
_lib: list = []  # [] not tried yet; [None] unavailable; [CDLL] loaded


def _cache_dir() -> str:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "dit_train")


def _build(path: str) -> None:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc, gcc or $CC) on PATH")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".so")
    os.close(fd)
    try:  # build beside the target, then rename: ranks building at once each publish a whole library
        subprocess.run([cc, *FLAGS, "-o", tmp, SOURCE], check=True, capture_output=True, text=True)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def load():
    """The compiled library, built on first use; None where it cannot be built (warns once)."""
    if not _lib:
        with open(SOURCE, "rb") as f:
            key = hashlib.sha256(f.read() + " ".join(FLAGS).encode() + platform.node().encode()).hexdigest()[:16]
        path = os.path.join(_cache_dir(), f"rownorm_kernels_{key}.so")
        try:
            if not os.path.exists(path):
                _build(path)
            _lib.append(ctypes.CDLL(path))
        except (OSError, RuntimeError, subprocess.CalledProcessError) as e:
            detail = getattr(e, "stderr", "") or e
            warnings.warn(f"compile_rownorm: the C RowNorm kernels could not be built ({detail}); "
                          "using the torch.compile kernels on CPU")
            _lib.append(None)
    return _lib[0]


def supports(*tensors: Tensor) -> bool:
    """Whether the C loops take these tensors (one dtype, fp32/fp64, contiguous, on CPU) and the library loads."""
    dtype = tensors[0].dtype
    return (dtype in _SUFFIX and all(t.device.type == "cpu" and t.dtype == dtype and t.is_contiguous()
                                     for t in tensors) and load() is not None)


def _ptr(t: Tensor | None):
    return None if t is None else ctypes.c_void_p(t.data_ptr())


def momentum(g: Tensor, m: Tensor, u: Tensor | None, sums: Tensor, keep: float, c: float, nesterov: bool,
             tall: bool) -> None:
    """m <- lerp(m, g, keep); x = g + c m (or c m); u <- x if given; sums <- x's sums of squares over the rows
    (wide: [rows] values) or the columns (tall: [cols] values)."""
    real = _CTYPE[g.dtype]
    getattr(load(), f"rownorm_momentum_{_SUFFIX[g.dtype]}")(
        _ptr(g), _ptr(m), _ptr(u), _ptr(sums), ctypes.c_long(g.shape[0]), ctypes.c_long(g.shape[1]), real(keep),
        real(c), ctypes.c_int(nesterov), ctypes.c_int(tall))


def update(p: Tensor, g: Tensor, m: Tensor, u: Tensor | None, s: Tensor, decay: float, alpha: float, c: float,
           nesterov: bool, tall: bool) -> None:
    """p <- decay p + alpha x s, x = u or g + c m (c m without Nesterov); s per row (wide) or column (tall)."""
    real = _CTYPE[p.dtype]
    getattr(load(), f"rownorm_update_{_SUFFIX[p.dtype]}")(
        _ptr(p), _ptr(g), _ptr(m), _ptr(u), _ptr(s), ctypes.c_long(p.shape[0]), ctypes.c_long(p.shape[1]),
        real(decay), real(alpha), real(c), ctypes.c_int(nesterov), ctypes.c_int(tall))
