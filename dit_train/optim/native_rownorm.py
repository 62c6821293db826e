"""RowNorm's C kernels on CPU (rownorm_kernels.c), called through ctypes: the fused momentum and update passes, and
the spectral scale's power-iteration products (spectral_cap.py), one call per shape bucket.

compile_rownorm's CPU path: inductor's kernels for these passes read G and M twice (the row sums and the stores
are two loop nests) and walk tall matrices' columns with a stride, ~2x the time of torch's fused AdamW on the
same matrices; these loops touch every element once, in memory order, and the products read U once per pair
(docs/bench_optimizer.md). Work is spread over torch.get_num_threads() threads (torch's OpenMP team; pthreads
where -fopenmp does not build) by a fixed partition into row blocks (row_blocks.h), so results do not depend on
the thread count. The sources are compiled once per machine
with the system C compiler (the one inductor needs too) into a cache folder, keyed by their hash and the host;
without a compiler, `load()` gives None and the torch.compile kernels (passes) and torch ops (products) run.
The cached library is checked against the SHA-256 recorded beside it before every load and rebuilt where they
differ: loading a truncated .so kills the process with SIGBUS, not an error.
They take contiguous fp32/fp64 CPU tensors (`supports`); the momentum pass's sums come back in the input's dtype,
as fp32 and fp64 are already the accumulation dtypes of the eager path."""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import os
import platform
import re
import shutil
import subprocess
import tempfile
import threading
import warnings

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

from dit_train.runs.atomic_io import atomic_write_bytes

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.join(HERE, "rownorm_kernels.c")
# every file the library is built from: its cache key hashes them all
PARTS = [SOURCE] + [os.path.join(HERE, f) for f in ("row_blocks.h", "rownorm_passes.inc", "power_iteration.inc")]


def vector_width(cpuinfo: str | None = None) -> int:
    """The vector width the C loops are built for (-mprefer-vector-width): 256 bits on AMD Zen 4 (family 25 with
    AVX-512), whose cores execute a 512-bit operation as two 256-bit halves: there the 256-bit build's spectral
    RowNorm step takes 0.87x the 512-bit build's time (the power iteration's dot products are latency-bound chains;
    docs/bench_optimizer.md); 512 elsewhere (chosen on an Intel host, where the wider vectors kept more reads in
    flight). cpuinfo: the text of /proc/cpuinfo (read here when None; 512 where it cannot be read)."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            return 512
    zen4 = ("AuthenticAMD" in cpuinfo and re.search(r"^cpu family\s*:\s*25\s*$", cpuinfo, re.M) is not None
            and re.search(r"^flags\s*:.*\bavx512f\b", cpuinfo, re.M) is not None)
    return 256 if zen4 else 512


FLAGS = ["-O3", "-march=native", f"-mprefer-vector-width={vector_width()}", "-fopenmp-simd", "-pthread", "-shared",
         "-fPIC"]
# first choice: the threads of torch's OpenMP runtime (row_blocks.h); FLAGS alone where -fopenmp does not build
OPENMP = ["-fopenmp"]
_SUFFIX = {torch.float32: "f32", torch.float64: "f64"}
_CTYPE = {torch.float32: ctypes.c_float, torch.float64: ctypes.c_double}
BLOCK_ROWS = 128  # as in row_blocks.h
_lib: list = []  # [] not tried yet; [None] unavailable; [CDLL] loaded


def _cache_dir() -> str:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "dit_train")


def _sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _checksum_path(path: str) -> str:
    return path + ".sha256"


def _intact(path: str) -> bool:
    """Whether the library at path is the whole file its build recorded (a missing record counts as damaged)."""
    try:
        with open(_checksum_path(path)) as f:
            return f.read().strip() == _sha256(path)
    except OSError:
        return False


def _build(path: str) -> None:
    """Compile into a temp file beside path, fsync it, rename it over path, then record its SHA-256 (after the
    library, so a crash in between leaves a record that does not match and the next load rebuilds)."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc, gcc or $CC) on PATH")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".so")
    os.close(fd)
    try:  # a process killed mid-build leaves the old library or none, never part of one
        try:
            subprocess.run([cc, *FLAGS, *OPENMP, "-o", tmp, SOURCE], check=True, capture_output=True, text=True)
        except subprocess.CalledProcessError:
            subprocess.run([cc, *FLAGS, "-o", tmp, SOURCE], check=True, capture_output=True, text=True)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        digest = _sha256(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    atomic_write_bytes(digest.encode(), _checksum_path(path))  # fsyncs the folder: both renames are durable


@contextlib.contextmanager
def _build_lock(path: str):
    """One process at a time builds the library at path: the other ranks of the host wait, then load its build."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def load():
    """The compiled library, built on first use and rebuilt where it does not match its recorded checksum; None
    where it cannot be built (warns once)."""
    if not _lib:
        digest = hashlib.sha256(" ".join(FLAGS + OPENMP).encode() + platform.node().encode())
        for part in PARTS:
            with open(part, "rb") as f:
                digest.update(f.read())
        key = digest.hexdigest()[:16]
        path = os.path.join(_cache_dir(), f"rownorm_kernels_{key}.so")
        try:
            if not _intact(path):
                with _build_lock(path):
                    if not _intact(path):  # else another process built it while this one waited
                        if os.path.exists(path) and os.path.exists(_checksum_path(path)):
                            warnings.warn(f"compile_rownorm: the cached C RowNorm kernels {path} do not match "
                                          "their recorded checksum (truncated or altered); rebuilding them")
                        _build(path)
            _lib.append(ctypes.CDLL(path))
        except (OSError, RuntimeError, subprocess.CalledProcessError) as e:
            detail = getattr(e, "stderr", "") or e
            warnings.warn(f"compile_rownorm: the C RowNorm kernels could not be built ({detail}); RowNorm steps on "
                          "CPU run eagerly (compile_rownorm=auto) or as torch.compile kernels (true)")
            _lib.append(None)
    return _lib[0]


def check_buildable(setting, device) -> None:
    """optimizer.compile_rownorm=true on CPU runs these kernels, or else torch.compile's, which need a C++ compiler
    as well: where the library neither loads nor builds, refused in one line before the run folder is written
    (instead of an InductorError traceback at the first step)."""
    if setting is not True or torch.device(device).type != "cpu":
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the reason is said below, in the error
        if load() is not None:
            return
    from dit_train.config.errors import ConfigError

    raise ConfigError("optimizer.compile_rownorm=true needs a C compiler on CPU to build its RowNorm kernels, and "
                      "none works here (cc, gcc or $CC on PATH): install one, or use optimizer.compile_rownorm=auto "
                      "(eager steps without one)")


def supports(*tensors: Tensor) -> bool:
    """Whether the C loops take these tensors (one dtype, fp32/fp64, contiguous, on CPU, with memory: not fake) and
    the library loads."""
    dtype = tensors[0].dtype
    return (dtype in _SUFFIX and all(t.device.type == "cpu" and t.dtype == dtype and t.is_contiguous()
                                     and not is_fake(t) for t in tensors) and load() is not None)


def _ptr(t: Tensor | None):
    return None if t is None else ctypes.c_void_p(t.data_ptr())


def _ptrs(ts: list[Tensor]):
    return (ctypes.c_void_p * len(ts))(*[t.data_ptr() for t in ts])


_scratch: dict = {}


def scratch(numel: int, dtype: torch.dtype) -> Tensor:
    """A reused buffer of at least numel elements, one per (calling thread, dtype): fresh allocations of this size
    page-fault on every call."""
    key = (threading.get_ident(), dtype)
    buf = _scratch.get(key)
    if buf is None or buf.numel() < numel:
        buf = _scratch[key] = torch.empty(max(numel, 1), dtype=dtype)
    return buf


def blocks(rows: int) -> int:
    """Blocks of rows per matrix (row_blocks.h's BLOCK_ROWS), for sizing the partial sums' scratch."""
    return -(-rows // BLOCK_ROWS)


def momentum(grads: list[Tensor], bufs: list[Tensor], U: Tensor | None, sums: Tensor, keep: float, c: float,
             nesterov: bool, tall: bool, x0: Tensor | None = None, eps: float = 0.0) -> Tensor | None:
    """For each matrix j of a bucket: m_j <- lerp(m_j, g_j, keep); x = g_j + c m_j (or c m_j); U[j] <- x if U is
    given; sums[j] <- x's sums of squares over the rows (wide: [rows]) or the columns (tall: [cols]). With x0
    ([B, rows], wide and U given): also returns R^T x0 ([B, cols]) for R = x / max(sqrt(sums), eps), the first
    product of the spectral scale's power iteration, added up while each row is in cache."""
    B, (rows, cols) = len(grads), grads[0].shape
    real, dtype = _CTYPE[grads[0].dtype], grads[0].dtype
    fold = x0 is not None and not tall and U is not None
    y0 = torch.empty(B, cols, dtype=dtype) if fold else None
    # per block of rows: its part of R^T x0 (fold) or of the column sums (tall)
    partial = scratch(B * blocks(rows) * cols, dtype) if fold or tall else None
    getattr(load(), f"rownorm_momentum_{_SUFFIX[dtype]}")(
        _ptrs(grads), _ptrs(bufs), _ptr(U), _ptr(sums), _ptr(x0 if fold else None), _ptr(y0), _ptr(partial),
        ctypes.c_long(B), ctypes.c_long(rows), ctypes.c_long(cols), real(keep), real(c), ctypes.c_int(nesterov),
        ctypes.c_int(tall), real(eps), ctypes.c_int(torch.get_num_threads()))
    return y0


def update(params: list[Tensor], grads: list[Tensor], bufs: list[Tensor], U: Tensor | None, scales: Tensor,
           decay: float, alpha: float, c: float, nesterov: bool, tall: bool) -> None:
    """p_j <- decay p_j + alpha x s_j, x = U[j] or g_j + c m_j (c m_j without Nesterov); scales: the bucket's
    row factors, [B, rows, 1] (wide) or [B, 1, cols] (tall)."""
    real, (rows, cols) = _CTYPE[params[0].dtype], params[0].shape
    getattr(load(), f"rownorm_update_{_SUFFIX[params[0].dtype]}")(
        _ptrs(params), _ptrs(grads), _ptrs(bufs), _ptr(U), _ptr(scales), ctypes.c_long(len(params)),
        ctypes.c_long(rows), ctypes.c_long(cols), real(decay), real(alpha), real(c), ctypes.c_int(nesterov),
        ctypes.c_int(tall), ctypes.c_int(torch.get_num_threads()))


_sqrt: dict = {}


def _torch_sqrt(dtype: torch.dtype):
    """The function torch's CPU sqrt runs for this dtype where it is not the correctly rounded one: MKL's vmsSqrt_64 /
    vmdSqrt_64 (high-accuracy mode, not always correctly rounded) in builds with MKL, found in libtorch_cpu; None
    (the C loops' own sqrt, as torch's vectorised one) without MKL."""
    if dtype not in _sqrt:
        fn = None
        if torch.backends.mkl.is_available():
            try:
                lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
                fn = ctypes.cast(getattr(lib, "vmsSqrt_64" if dtype == torch.float32 else "vmdSqrt_64"),
                                 ctypes.c_void_p)
            except (OSError, AttributeError):
                fn = None
        _sqrt[dtype] = fn
    return _sqrt[dtype]


def step(params: list[Tensor], grads: list[Tensor], bufs: list[Tensor], keep: float, c: float, nesterov: bool,
         tall: bool, eps: float, decay: float, alpha: float) -> None:
    """momentum, then the row factors 1 / max(|row|, eps), then update, for a bucket whose factors need no other
    rank's sums, in one call that reads each item's G and M back while they are in cache (rownorm_step); the
    factors bit for bit as directions.inv_norms_from_sumsq computes them (torch's own sqrt)."""
    B, (rows, cols) = len(params), params[0].shape
    real, dtype = _CTYPE[params[0].dtype], params[0].dtype
    sums = scratch(B * ((blocks(rows) + 1) * cols if tall else blocks(rows) * BLOCK_ROWS), dtype)
    getattr(load(), f"rownorm_step_{_SUFFIX[dtype]}")(
        _ptrs(params), _ptrs(grads), _ptrs(bufs), _ptr(sums), ctypes.c_long(B), ctypes.c_long(rows),
        ctypes.c_long(cols), real(keep), real(c), ctypes.c_int(nesterov), ctypes.c_int(tall), real(eps),
        real(decay), real(alpha), _torch_sqrt(dtype), ctypes.c_int(torch.get_num_threads()))


# power_iteration.inc's products, numbered as its enum
WIDE_FIRST, WIDE_PAIR, TALL_PAIR, TALL_LAST = range(4)


def power_iteration_round(kind: int, U: Tensor, s: Tensor, x: Tensor) -> tuple[Tensor | None, Tensor | None]:
    """One round's products on a bucket U [B, rows, cols] with row factors s ([B, rows] wide, [B, cols] tall),
    as (vector over the columns [B, cols] or None, vector over the rows [B, rows] or None):
    WIDE_FIRST (U^T (s x), None), WIDE_PAIR (y' = R^T x', x' = s (U x)), TALL_PAIR (s U^T (U (s x)), None),
    TALL_LAST (None, U (s x))."""
    B, rows, cols = U.shape
    dtype = U.dtype
    y = None if kind == TALL_LAST else torch.empty(B, cols, dtype=dtype)
    r = torch.empty(B, rows, dtype=dtype) if kind in (WIDE_PAIR, TALL_LAST) else None
    buf = scratch(B * (blocks(rows) + 1) * cols, dtype)
    getattr(load(), f"power_iteration_round_{_SUFFIX[dtype]}")(
        ctypes.c_int(kind), _ptr(U), _ptr(s), _ptr(x), _ptr(y), _ptr(r), _ptr(buf), ctypes.c_long(B),
        ctypes.c_long(rows), ctypes.c_long(cols), ctypes.c_int(torch.get_num_threads()))
    return y, r
