"""What one optimizer step of the real code dispatches, operator by operator, and what each operator costs: the
counted half of benchmarks/cost_model/ (docs/cost_model.md, "Counted from the code").

Counting: the optimizer build_optimizer makes (the one the benchmarks time) steps on fake parameters and gradients of
the model's shapes under a FakeDispatchCounter (benchmarks/dispatch_counter.py), with the optimizer's own phase
marks (momentum, direction, update, adamw). Every top-level call becomes an OpRecord: the bytes it reads and writes
(from the operator's schema: a mutated argument is read and written, an out= argument only written, a functional
result written; a broadcast (stride 0) dimension is read once), its FLOPs if it is a matmul, and a category that
picks the rate it runs at:
  gemm     a matmul with both output sides > VECTOR_SIDE: FLOPs at the rate of NS5's own matmuls of its op,
           operand layout, dtype, shape and batch, interpolated between those measured (ns5_gemm_rates.py); where
           they do not cover it (not an NS5 kind, or a profile without them), at the GEMM rate of its shape class
           (square r x r x r, or the plain NS5 mix r x 4r) by its short side
  matvec   a matmul with a vector side (the power iteration's products): its bytes at the matvec rate
  reduce   writes < 1/8 of what it reads (sums, norms): its bytes at the one-array read rate
  convert  an elementwise op or copy between floating dtypes (the bf16 NS5 input, a bf16 direction added to fp32)
  stream   any other elementwise op, copy or foreach op: its bytes at the multi-array streaming rate
  adamw    torch's fused AdamW kernel: its bytes at the rate measured for it
  fused    a torch.compile'd function (see below): one kernel that reads every outside tensor once and writes
           every outside tensor once, intermediates free, at the rate measured for that compiled pass of the
           RowNorm step (optim/fused_rownorm.py: the momentum pass and the update pass, each its own rate) on
           buckets of its own size (its first argument's elements: a bucket's matrices), interpolated log-log
           between the sizes measured (measure_fused_rates)
Views and allocations (dispatch_counter's no_kernel) are free and not recorded; collectives are recorded with
their bytes and priced by the caller (benchmarks/cost_model/: gloo or NCCL).

A compiled path is counted by replacing torch.compile, for the count only, with a wrapper that runs the function
eagerly inside a fused region: what inductor would fuse is priced as one pass over the tensors the function takes
and mutates (the fusion inductor's kernels aim at), not measured from the generated kernels.

Time of a step = sum over records of max(bytes / rate of its category, FLOPs / GEMM rate) + op_s per record
(the host's dispatch cost of a small op, or a GPU's launch cost). OpRates holds the rates; measure_op_rates
measures them on this host.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from dataclasses import dataclass, field

import torch
from torch.utils._pytree import tree_flatten

from benchmarks import ns5_gemm_rates
from benchmarks.dispatch_counter import FakeDispatchCounter, kind_of

CATEGORIES = ("gemm", "matvec", "reduce", "convert", "stream", "adamw", "fused", "collective")
MATMULS = {"mm": (0, 1), "bmm": (0, 1), "addmm": (1, 2), "baddbmm": (1, 2)}  # op -> positions of its two factors
VECTOR_SIDE = 16  # a matmul output side this narrow runs at memory speed (the power iteration's [B, 1, k] vectors)
REDUCTION = 8  # an op writing under 1/REDUCTION of what it reads is a reduction
OVERWRITES = {"copy_", "zero_", "fill_"}  # in-place ops that write self without reading it


@dataclass(frozen=True)
class OpRecord:
    phase: str
    op: str
    category: str
    read: int  # bytes
    written: int
    flops: int = 0
    dims: tuple = ()  # a matmul's (m, k, n): its rate depends on them
    batch: int = 1  # a matmul's batch (bmm, baddbmm)
    dtype: str = ""  # a matmul's operand dtype ("bfloat16", "float32")
    layout: str = ""  # a matmul's factors, BLAS-style: "n" row-major, "t" a transposed view (A.mT); e.g. "nt"
    elements: int = 0  # a fused region's bucket: the elements of its first argument (0: not known)

    @property
    def bytes(self) -> int:
        return self.read + self.written


def extent(t: torch.Tensor) -> int:
    """Bytes of memory a kernel touches reading or writing `t`: its elements, a broadcast (stride 0) dimension once."""
    n = math.prod(s for s, st in zip(t.shape, t.stride()) if st != 0) if t.dim() else 1
    return n * t.element_size()


def _tensors(x) -> list[torch.Tensor]:
    return [t for t in tree_flatten(x)[0] if isinstance(t, torch.Tensor)]


def _arguments(func, args, kwargs):
    """(schema argument, value) for every argument given."""
    for i, arg in enumerate(func._schema.arguments):
        if not arg.kwarg_only and i < len(args):
            yield arg, args[i]
        elif arg.name in kwargs:
            yield arg, kwargs[arg.name]


def traffic(func, args, kwargs, out) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(tensors read, tensors written) by one call: a mutated argument both (in place) or only written (out=, a
    keyword-only argument; the self of copy_, zero_, fill_), every other tensor argument read; a call that mutates nothing writes its results."""
    read, written = [], []
    overwrites = func.__name__.split(".")[0] in OVERWRITES
    for arg, value in _arguments(func, args, kwargs):
        ts = _tensors(value)
        mutated = arg.alias_info is not None and arg.alias_info.is_write
        if mutated:
            written += ts
        if not (mutated and (arg.kwarg_only or overwrites)):
            read += ts
    if not written:
        written = _tensors(out)
    return read, written


def _matmul(name: str, args) -> dict:
    """The OpRecord fields of an mm/bmm/addmm/baddbmm call: flops, dims (m, k, n), batch, dtype, layout."""
    a, b = (args[i] for i in MATMULS[name])
    *batch, m, k = a.shape
    n = b.shape[-1]
    B = math.prod(batch)
    return {"flops": 2 * B * m * k * n, "dims": (m, k, n), "batch": B, "dtype": str(a.dtype).removeprefix("torch."),
            "layout": layout_of(a) + layout_of(b)}


def layout_of(t: torch.Tensor) -> str:
    """'t' for a transposed view (column-major: the last two dims' strides swapped), else 'n'."""
    return "t" if t.dim() >= 2 and t.stride(-2) == 1 and t.stride(-1) != 1 else "n"


def record_of(phase: str, func, args, kwargs, out) -> OpRecord | None:
    """The OpRecord of one dispatched call, None for a view or allocation (free)."""
    kind = kind_of(func)
    if kind in ("no_kernel", "sync"):
        return None
    name = func.__name__.split(".")[0]
    read, written = traffic(func, args, kwargs, out)
    r, w = sum(map(extent, read)), sum(map(extent, written))
    if kind == "collective":
        return OpRecord(phase, name, "collective", r, w)
    if name in MATMULS:
        mm = _matmul(name, args)
        m, _, n = mm["dims"]
        return OpRecord(phase, name, "matvec" if min(m, n) <= VECTOR_SIDE else "gemm", r, w, **mm)
    dtypes = {t.dtype for t in read + written if t.is_floating_point()}
    if name.startswith("_fused_adam"):
        category = "adamw"
    elif w * REDUCTION <= r:
        category = "reduce"
    elif len(dtypes) > 1:
        category = "convert"
    else:
        category = "stream"
    return OpRecord(phase, name, category, r, w)


class OpCounter(FakeDispatchCounter):
    """A FakeDispatchCounter that keeps an OpRecord per counted call (`records`), and inside `fused()` one record
    for the whole region."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.records: list[OpRecord] = []
        self._region: dict | None = None

    def reset(self) -> None:
        super().reset()
        self.records = []

    def _observe(self, func, args, kwargs, out) -> None:
        if self._region is not None:
            self._in_region(func, args, kwargs, out)
            return
        rec = record_of(self.current, func, args, kwargs, out)
        if rec is not None:
            self.records.append(rec)

    def _in_region(self, func, args, kwargs, out) -> None:
        """Note the outside tensors a call inside fused() reads and writes; storages its results (or an allocation)
        create are the region's own."""
        if func.is_view:
            return
        region = self._region
        read, written = traffic(func, args, kwargs, out)
        mutates = any(a.alias_info is not None and a.alias_info.is_write for a, _ in _arguments(func, args, kwargs))
        for t in read:
            if _storage(t) not in region["born"]:
                region["read"].setdefault(_view_key(t), t)
        for t in written:
            if not mutates:
                region["born"].add(_storage(t))
            elif _storage(t) not in region["born"]:
                region["written"].setdefault(_view_key(t), t)

    @contextlib.contextmanager
    def fused(self, name: str, elements: int = 0):
        """One record for everything dispatched inside: the outside tensors it reads and those it writes, once
        each (intermediates stay in registers in a fused kernel); `elements`: the size of the bucket it runs on,
        which its rate depends on."""
        outer, self._region = self._region, {"read": {}, "written": {}, "born": set()}
        try:
            yield
        finally:
            region, self._region = self._region, outer
            self.records.append(OpRecord(self.current, name, "fused", sum(map(extent, region["read"].values())),
                                         sum(map(extent, region["written"].values())), elements=elements))


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _view_key(t: torch.Tensor) -> tuple:
    return (_storage(t), t.storage_offset(), tuple(t.shape), tuple(t.stride()))


# ---- counting the real step ------------------------------------------------------------------------------------
BENCH_BASE = {"lr": 1e-3, "weight_decay": 0.01}  # the hyperparameters benchmarks/bench_optimizer.py steps with


class _Phases:
    """The optimizer's timer during a count: its phase marks attribute the calls; bytes it counts are ignored."""

    def __init__(self, counter: OpCounter):
        self.phase = counter.phase

    def add_bytes(self, collective: str, nbytes: int) -> None:
        pass


def fake_parameters(model: torch.nn.Module) -> None:
    """Every parameter of a meta-built model replaced by a fake one of its shape and dtype, with a fake gradient
    (call inside the counter)."""
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            fake = torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype), requires_grad=p.requires_grad)
            fake.grad = torch.empty_like(fake)
            setattr(module, name, fake)


@contextlib.contextmanager
def compiled_as_fused(counter: OpCounter):
    """torch.compile, for the count, returns the function run eagerly inside counter.fused(its name, the elements
    of its first argument: fused_rownorm's passes take the bucket's matrices first); the optimizer's cache of
    compiled kernels (optim/fused_rownorm.py) starts empty so that it compiles through it."""
    from dit_train.optim import fused_rownorm

    real, cache = torch.compile, fused_rownorm._compiled

    def compile(fn=None, **kwargs):
        if fn is None:
            return lambda f: compile(f, **kwargs)
        name = getattr(fn, "__name__", "compiled")

        def run(*args, **kw):
            with counter.fused(name, sum(t.numel() for t in _tensors(args[0])) if args else 0):
                return fn(*args, **kw)
        return run

    torch.compile, fused_rownorm._compiled = compile, {}
    try:
        yield
    finally:
        torch.compile, fused_rownorm._compiled = real, cache


def count_steps(make_optimizer, refresh: bool | None = None) -> list[OpRecord]:
    """The records of the second step of the optimizer make_optimizer() returns (called inside the counter, so
    that its parameters and gradients can be made fake there); the first makes the state and the reused
    workspaces. refresh: for a periodic optimizer, the refresh (NS5) step or a between (RowNorm) step, set as
    bench_optimizer sets it."""
    counter = OpCounter(allow_non_fake_inputs=True)
    with counter, compiled_as_fused(counter), torch.no_grad():
        opt = make_optimizer()
        opt.use_timer(_Phases(counter))
        for _ in range(2):
            if refresh is not None:
                for group in opt.param_groups:
                    group["step"] = 0 if refresh else 1
            counter.reset()
            opt.step()
    return counter.records


def count_step(model_cfg, optimizer: dict, refresh: bool | None = None) -> list[OpRecord]:
    """count_steps of build_optimizer(model, BENCH_BASE + optimizer) on fake tensors of model_cfg's shapes."""
    from dit_train.model.dit import build_model
    from dit_train.optim.registry import build_optimizer

    model = build_model(model_cfg, device="meta")

    def make():
        fake_parameters(model)
        return build_optimizer(model, {**BENCH_BASE, **optimizer})
    return count_steps(make, refresh)


# ---- pricing ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class OpRates:
    """Bytes/s of each memory-bound category, the GEMM rate by short side, and the fixed cost of one dispatched
    op (host dispatch, or a GPU launch)."""
    stream: float
    convert: float
    reduce: float
    matvec: float
    op_s: float
    adamw: float
    fused: float
    gemm: tuple = field(default=())  # ((short side, flop/s), ...) ascending: bf16 bmm's of 8 x r x 4r (NS5's mix)
    square: tuple = field(default=())  # the same for 8 x r x r x r (the Gram form's); () = as gemm
    ns5: tuple = field(default=())  # NS5's own matmuls measured: ((op, layout, dtype, m, k, n, batch, flop/s), ...)
    fused_by_size: tuple = field(default=())  # ((bucket elements, bytes/s), ...) ascending; () = `fused` at any size
    # ((compiled function's name, ((bucket elements, bytes/s), ...) ascending), ...): each compiled RowNorm pass's
    # own rates; a fused region of another name takes fused_by_size
    fused_by_pass: tuple = field(default=())
    # ((layout, ((matrix elements, bytes/s), ...) ascending), ...): the power iteration's vector-matrix products by
    # the matrix's layout ("nn": x U, "nt": y U^T) on the RowNorm step's buckets; () = `matvec` for every one
    matvec_by_layout: tuple = field(default=())

    def matvec_rate(self, rec: OpRecord) -> float:
        """bytes/s of a counted vector-matrix product: log-log between the bucket sizes measured for its layout
        (one rate, measured at one 64 MB size for both layouts, priced the spectral scale's power iteration at
        about half its time; whether the layout or the size is what it missed is not yet measured on an idle host,
        docs/cost_model.md); `matvec` where that layout was not measured (a GPU, an older profile)."""
        by_size = dict(self.matvec_by_layout).get(rec.layout)
        if not by_size:
            return self.matvec
        m, k, n = rec.dims
        return _log_log(by_size, rec.batch * k * max(m, n))

    def gemm_rate(self, rec: OpRecord) -> float:
        """flop/s of a counted matmul: interpolated between NS5's own matmuls measured at its op, layout, dtype
        and shape class (benchmarks/ns5_gemm_rates.py) where they cover it; else the rate by side measured for
        its shape class at the nearest short side at or below its own (smaller GEMMs run slower): square where
        no side is 1.5x another."""
        measured = ns5_gemm_rates.rate(self.ns5, rec.op, rec.layout, rec.dtype, rec.dims, rec.batch)
        if measured is not None:
            return measured
        dims = rec.dims
        side = min(dims)
        table = self.square if self.square and max(dims) < 1.5 * side else self.gemm
        below = [rate for s, rate in table if s <= side]
        return below[-1] if below else table[0][1]

    def fused_rate(self, elements: int, name: str = "") -> float:
        """bytes/s of a fused region (the compiled function `name`) on a bucket of `elements`: log-log between the
        bucket sizes measured for that function where its own were measured (fused_by_pass), else for both
        RowNorm passes together (fused_by_size, a profile measured before the rates per pass), clamped at the
        smallest and the largest; `fused` where no sizes were measured (a GPU, a profile measured before them) or
        the size is not known."""
        by_size = dict(self.fused_by_pass).get(name) or self.fused_by_size
        if not by_size or elements <= 0:
            return self.fused
        return _log_log(by_size, elements)

    def shared(self, share: float) -> "OpRates":
        """The rates of a process that gets `share` of the cores it was measured on."""
        return OpRates(self.stream * share, self.convert * share, self.reduce * share, self.matvec * share,
                       self.op_s / share, self.adamw * share, self.fused * share,
                       tuple((s, r * share) for s, r in self.gemm), tuple((s, r * share) for s, r in self.square),
                       tuple((*p, r * share) for *p, r in self.ns5),
                       tuple((e, r * share) for e, r in self.fused_by_size),
                       tuple((name, tuple((e, r * share) for e, r in rates)) for name, rates in self.fused_by_pass),
                       tuple((name, tuple((e, r * share) for e, r in rates)) for name, rates in self.matvec_by_layout))


def _log_log(by_size, elements: int) -> float:
    """The rate at `elements`, log-log between the ((elements, rate), ...) measured, clamped at both ends."""
    log_rate = {math.log(e): math.log(r) for e, r in by_size}
    around = ns5_gemm_rates.bracket(sorted(log_rate), math.log(elements))
    return math.exp(sum(w * log_rate[x] for x, w in around))


def seconds(rec: OpRecord, rates: OpRates) -> float:
    """max(bytes at its category's rate, FLOPs at the GEMM rate) + the fixed cost of an op; 0 for a collective
    (its caller prices it on the link)."""
    if rec.category == "collective":
        return 0.0
    if rec.category == "fused":
        rate = rates.fused_rate(rec.elements, rec.op)
    elif rec.category == "matvec":
        rate = rates.matvec_rate(rec)
    else:
        rate = rates.stream if rec.category == "gemm" else getattr(rates, rec.category)
    t = rec.bytes / rate
    if rec.category == "gemm":
        t = max(t, rec.flops / rates.gemm_rate(rec))
    return t + rates.op_s


def phase_seconds(records: list[OpRecord], rates: OpRates) -> dict[str, float]:
    out: dict[str, float] = {}
    for rec in records:
        out[rec.phase] = out.get(rec.phase, 0.0) + seconds(rec, rates)
    return out


# ---- this host's rates -----------------------------------------------------------------------------------------
STREAM_NUMEL = 16 << 20  # 64 MB per fp32 array: far beyond the caches
SQUARE_SIDES = (128, 256, 512, 1024)


_CLOCK = [time.perf_counter]  # what median_seconds reads: wall time, or thread CPU time inside thread_clock()


@contextlib.contextmanager
def thread_clock():
    """median_seconds reads the calling thread's CPU time instead of wall time: on a loaded host, the time of
    one-thread work without the waits for a core (not the rate an idle host reaches: caches are shared)."""
    _CLOCK.append(time.thread_time)
    try:
        yield
    finally:
        _CLOCK.pop()


def median_seconds(fn, repeats: int = 5) -> float:
    """fn's median time (wall, or thread CPU time inside thread_clock()) over `repeats` calls after one warm-up
    call."""
    clock = _CLOCK[-1]
    fn()
    times = []
    for _ in range(repeats):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return statistics.median(times)


def _rate(cases) -> float:
    """Bytes/s over a set of (bytes, callable) run in turn: total bytes over the total of their median times."""
    return sum(b for b, _ in cases) / sum(median_seconds(fn) for _, fn in cases)


def measure_op_rates(threads: int) -> dict:
    """Each category's rate with `threads` threads, from the ops the optimizer's steps run most (a few seconds):
    stream: add out=, lerp_, addcmul_, mul_ on fp32; convert: add into bf16 and a bf16 list added to fp32;
    reduce: sum and row norms; matvec: [B, 1, r] x [B, r, c] and x [B, c, r]^T on fp32; op_s: the time of a small
    (8-element) add, i.e. dispatch and Python, per call; square: bf16 8 x r x r x r bmm's by r."""
    torch.set_num_threads(threads)
    n = STREAM_NUMEL
    a, b, c = torch.randn(n), torch.randn(n), torch.randn(n)
    h = torch.empty(n, dtype=torch.bfloat16)
    rows = a.view(-1, 2048)
    U = torch.randn(8, 1024, 2048)
    x, y = torch.randn(8, 1, 1024), torch.randn(8, 1, 2048)
    small, other = torch.ones(8), torch.ones(8)
    calls = 2000
    return {
        "stream": _rate([(12 * n, lambda: torch.add(a, b, alpha=0.5, out=c)), (12 * n, lambda: a.lerp_(b, 0.1)),
                         (16 * n, lambda: a.addcmul_(b, c, value=1e-3)), (8 * n, lambda: a.mul_(0.999))]),
        "convert": _rate([(10 * n, lambda: torch.add(a, b, alpha=0.5, out=h)),
                          (10 * n, lambda: torch._foreach_add_([a], [h], alpha=1e-3))]),
        "reduce": _rate([(4 * n, lambda: a.sum()),
                         (4 * n, lambda: torch.linalg.vector_norm(rows, dim=-1, keepdim=True))]),
        "matvec": _rate([(4 * U.numel(), lambda: torch.bmm(x, U)), (4 * U.numel(), lambda: torch.bmm(y, U.mT))]),
        "op_s": median_seconds(lambda: [small.add(other) for _ in range(calls)]) / calls,
        "square": [[r, 8 * 2 * r ** 3 / median_seconds(lambda A=torch.randn(8, r, r).bfloat16(): torch.bmm(A, A))]
                   for r in SQUARE_SIDES],
    }


def fused_passes():
    """{the compiled function's name (the op of its counted fused record): bytes it moves per fp32 element} of the
    RowNorm step's two compiled passes without U stored (the frobenius scale): the momentum pass reads G and M
    (8 B), the update pass reads W, G, M and writes W, M (20 B)."""
    from dit_train.optim import fused_rownorm

    return {fused_rownorm._momentum.__name__: 8, fused_rownorm._update.__name__: 20}


def measure_fused_rates(threads: int, buckets) -> dict[str, list[list]] | None:
    """{pass: [[B, m, n, bytes/s], ...]} (pass: fused_passes' names): each of the RowNorm step's compiled passes
    (fused_rownorm.momentum_pass and update_pass, U not stored, as the optimizer calls them) timed alone on a bucket
    of B fp32 m x n matrices, for each (B, m, n) in `buckets`: the momentum pass streams at its own rate (a
    reduction over the rows of O(U); a tall bucket's are its columns), not the update pass's. None without a C++
    compiler. A bucket's first run compiles its two kernels (seconds; inductor caches them on disk for the next);
    each pass runs as often as the two together did before (median_seconds' warm-up + 5), so timing them apart
    costs no more."""
    from dit_train.optim import fused_rownorm

    if fused_rownorm.cpp_compiler() is None:
        return None
    torch.set_num_threads(threads)
    lr = torch.tensor(1e-3)  # a 0-d tensor, as the optimizer passes it (a float would recompile per value)
    per_element = fused_passes()
    momentum, update = per_element  # the two names, in the order the optimizer calls them
    rows = {name: [] for name in per_element}
    for B, m, n in buckets:
        W, G, M = (list(torch.randn(B, m, n).unbind(0)) for _ in range(3))
        U = torch.zeros((), dtype=torch.float32).expand(B, m, n)
        s = torch.ones(B, 1, n) if m > n else torch.ones(B, m, 1)
        tall = m > n
        seconds = {
            momentum: median_seconds(lambda: fused_rownorm.momentum_pass(G, M, U, 0.95, True, tall, False)),
            update: median_seconds(lambda: fused_rownorm.update_pass(W, G, M, U, False, s, lr, 1.0, 1.0, 0.95, True,
                                                                     tall))}
        for name, sec in seconds.items():
            rows[name].append([B, m, n, per_element[name] * B * m * n / sec])
    return rows


def measure_matvec_rates(threads: int, buckets) -> dict[str, list[list]]:
    """{layout: [[B, m, n, bytes/s], ...]}: the power iteration's two vector-matrix products (spectral_cap's
    _Products) on a bucket of B fp32 m x n matrices U, for each (B, m, n) in `buckets`: "nn" x U (x: [B, 1, m])
    and "nt" y U^T (y: [B, 1, n]), each reading U once (4 B per element). The rate differs by layout and by size
    on CPU (BLAS's gemv paths); op_cost.measure_op_rates' one `matvec` rate averaged the two at one size."""
    torch.set_num_threads(threads)
    rows = {"nn": [], "nt": []}
    for B, m, n in buckets:
        U = torch.randn(B, m, n)
        x, y = torch.randn(B, 1, m), torch.randn(B, 1, n)
        rows["nn"].append([B, m, n, 4 * U.numel() / median_seconds(lambda: torch.bmm(x, U))])
        rows["nt"].append([B, m, n, 4 * U.numel() / median_seconds(lambda: torch.bmm(y, U.mT))])
    return rows


def host_op_rates(measured: dict, gemm: tuple, adamw: float, ns5: list = ()) -> OpRates:
    """OpRates from measure_op_rates' dict (with each compiled RowNorm pass's rates by bucket, "fused_passes":
    measure_fused_rates), the GEMM rates by side, fused AdamW's rate and NS5's measured matmuls
    (ns5_gemm_rates.measure_ns5_gemms; a profile measured before them has none: matmuls at the rates by side).
    Older profiles price as they did: one rate by bucket for both passes ("fused_buckets", [B, m, n, bytes/s] of
    the two passes run together), or before that one rate at any size ("fused", on two 8M-element buckets); where
    none was measured (no C++ compiler) the passes run at the streaming rate. The power iteration's products take
    their layout's rates by bucket ("matvec_by_layout": measure_matvec_rates) where measured, else one `matvec`.
    """
    def by_size(rows):
        return tuple(sorted({B * m * n: rate for B, m, n, rate in rows or ()}.items()))
    by_pass = tuple((name, by_size(rows)) for name, rows in sorted((measured.get("fused_passes") or {}).items()))
    by_layout = tuple((lay, by_size(rows)) for lay, rows in sorted((measured.get("matvec_by_layout") or {}).items()))
    return OpRates(measured["stream"], measured["convert"], measured["reduce"], measured["matvec"],
                   measured["op_s"], adamw, measured.get("fused") or measured["stream"], tuple(tuple(x) for x in gemm),
                   tuple(tuple(x) for x in measured["square"]), tuple(tuple(x) for x in ns5),
                   by_size(measured.get("fused_buckets")), by_pass, by_layout)
