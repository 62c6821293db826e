"""The whole-matrix exchange behind backward (gather mode; docs/algorithms.md §6, "Exchange behind backward").

Without it, a refresh step all-gathers every matrix's momentum input U = G + mu M' (M' = mu M + G) inside
optimizer.step(), after the whole backward. With it, FSDP2's post-reduce hook of each sharded matrix parameter
(`register_post_accumulate_grad_hook`, which FSDP2 calls on the sharded parameter once its gradient is reduce-
scattered, i.e. only on the backward that syncs: with gradient accumulation, the last micro-batch's) computes that
matrix's U rows and queues them; every `bucket_mb` of whole matrices one all-gather starts, in flight while the
rest of the backward runs. The last partial bucket starts when the backward ends (an autograd engine callback).
step() then only waits for the buffers, assembles each shape's whole matrices and computes their directions.

Exactness: the hook computes U from the gradient as it is after the reduce-scatter, with the same kernels as the
step (a foreach lerp, an add written straight into the gather dtype), so the gathered U is bit for bit the step's
own, provided nothing changes the gradient in between. Gradient clipping does: it scales every gradient by a
factor known only after the whole backward, and NS5(mu M + c G ...) is not a function of the unclipped U. The
exchange is therefore speculative: the trainer tells the optimizer whether clipping scaled the gradients
(`gradients_scaled`, read with the step's one host read); if it did, or if anything else makes the prefetched
set differ from the step's (a parameter without gradient, a second backward before the step), the prefetch is
dropped and the step exchanges as without overlap: the same result, the early bytes wasted. Exchanging the raw
gradient and the previous momentum separately would always be exact but sends fp32 twice (8 bytes per element
against U's 2 in bf16) and is not bit-for-bit safe either (the elementwise kernels on a shard and on a whole
matrix need not round alike). Memory: every prefetched matrix is held whole (in the gather dtype) from its hook
to the step, where the non-overlapped path holds one bucket at a time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..timing import active_timer
from .collectives import PhaseSwitch, ShardComm
from .matrix_optimizer import DTYPES


@dataclass
class _Entry:
    """One matrix's rows in a launched bucket: at `offset` in every rank's segment, `chunk` padded rows."""

    param: object
    offset: int
    chunk: int


@dataclass
class _Bucket:
    entries: list = field(default_factory=list)
    parts: list = field(default_factory=list)  # padded U rows, [chunk, n] each, until launch
    whole_bytes: int = 0
    total: int = 0  # elements per rank
    recv: Tensor | None = None
    work: object = None


class BackwardExchange:
    """The speculative early exchange of one ShardedMatrixOptimizer (see the module docstring)."""

    def __init__(self, opt):
        self.opt = opt
        self._group_of = {}
        for group in opt.param_groups:
            if group["kind"] == "matrix":
                for p in group["params"]:
                    self._group_of[p] = group
                    p.register_post_accumulate_grad_hook(self._on_gradient)  # for the optimizer's lifetime
        self._reset()

    def _reset(self) -> None:
        self._launched: list[_Bucket] = []
        self._open = _Bucket()
        self._where: dict = {}  # param -> (bucket, entry)
        self._valid = True
        self._scaled = None  # unknown until the trainer says
        self._comm = None
        self._flush_queued = False
        self.used = 0  # matrices whose prefetched U the step used

    # ---- during backward --------------------------------------------------------------------------------------
    def _on_gradient(self, p) -> None:
        opt, group = self.opt, self._group_of[p]
        from .sharded_optimizer import WHOLE, placement

        kind = opt.direction_at(group, group["step"])
        m, n = p.shape
        if opt.distributed_mode != "gather" or placement(kind, m, n) != WHOLE:
            return
        if p in self._where:  # a second synced backward before the step: the first U is stale
            self._valid = False
        if not self._valid:
            return
        if self._comm is None:
            self._comm = ShardComm(opt._group, active_timer())
        if not self._flush_queued:  # the last partial bucket starts when the backward ends (else at the step)
            try:
                torch.autograd.Variable._execution_engine.queue_callback(self._launch_open)
            except RuntimeError:  # a hook fired outside a backward pass
                pass
            self._flush_queued = True
        g = opt._local(p.grad)
        state = opt.state.get(p, {})
        buf = opt._local(state["momentum_buffer"]) if "momentum_buffer" in state else torch.zeros_like(g)
        mu = group["momentum"]
        # the step's own kernels on the same values: foreach lerp, then the add written in the gather dtype
        new_buf = torch._foreach_lerp([buf], [g], 1.0 - mu)[0]
        chunk = self._comm.rows(m)[0][1]
        U = torch.empty((chunk, n), dtype=DTYPES[opt.gather_dtype], device=g.device)
        rows = g.shape[0]
        if group["nesterov"]:
            torch.add(g, new_buf, alpha=mu / (1.0 - mu), out=U[:rows])
        else:
            torch.mul(new_buf, 1.0 / (1.0 - mu), out=U[:rows])
        U[rows:].zero_()
        b = self._open
        entry = _Entry(p, b.total, chunk)
        b.entries.append(entry)
        b.parts.append(U.reshape(-1))
        b.total += U.numel()
        b.whole_bytes += m * n * U.element_size()
        self._where[p] = (b, entry)
        if b.whole_bytes >= opt.bucket_mb * 2**20:
            self._launch_open()

    def _launch_open(self) -> None:
        b = self._open
        if not b.entries:
            return
        send = torch.cat(b.parts)
        b.parts = []
        b.recv = torch.empty(self._comm.world * b.total, dtype=send.dtype, device=send.device)
        b.work = self._comm.all_gather(b.recv, send)
        self._launched.append(b)
        self._open = _Bucket()

    # ---- at the step --------------------------------------------------------------------------------------------
    def gradients_scaled(self, scaled: bool) -> None:
        """The trainer's word, after clipping: whether the gradients were scaled since the hooks read them."""
        self._scaled = bool(scaled)

    def take(self, group: dict, keys: list, phases: PhaseSwitch) -> dict | None:
        """{key: [B, m, n] whole U} for the group's whole-matrix buckets `keys`, when every matrix of them was
        prefetched from the gradient the step uses; None (the step exchanges itself) otherwise."""
        if not self._where or not self._valid or self._scaled is not False:
            return None
        by_key: dict = {}
        for p in group["params"]:
            if p.grad is not None:
                by_key.setdefault((tuple(p.shape), p.dtype, self.opt._local(p).device), []).append(p)
        if any(key not in by_key or any(p not in self._where for p in by_key[key]) for key in keys):
            return None
        self._launch_open()
        p_world = self._comm.world
        out = {}
        for key in keys:
            m, n = key[0]
            params = by_key[key]
            whole = None
            for j, p in enumerate(params):
                b, e = self._where[p]
                if b.work is not None:
                    self._comm.wait(b.work, phases)
                    b.work = None
                rows = b.recv.view(p_world, b.total)[:, e.offset:e.offset + e.chunk * n]
                W = rows.reshape(p_world * e.chunk, n)[:m]
                if whole is None:
                    whole = torch.empty((len(params), m, n), dtype=W.dtype, device=W.device)
                whole[j].copy_(W)
            out[key] = whole
            self.used += len(params)
        return out

    def clear(self) -> None:
        """Drop the prefetch (after the step, or a skipped one): in-flight gathers are waited for first."""
        for b in self._launched:
            if b.work is not None:
                b.work.wait()
        self._reset()


def prefetched_directions(wholes: dict, compute, comm: ShardComm) -> tuple[dict, int]:
    """This rank's rows of the direction of every prefetched [B, m, n] batch; (out, whole directions computed)."""
    out, computed = {}, 0
    for key, W in wholes.items():
        D = compute(key, W)
        start, rows = comm.rows(key[0][0])[comm.rank]
        out[key] = D[:, start:start + rows]
        computed += W.shape[0]
    return out, computed
