"""The whole-matrix exchange behind backward (docs/algorithms.md §6, "Exchange behind backward"), in both modes.

Without it, a refresh step exchanges every matrix's momentum input U = G + mu M' (M' = mu M + G) inside
optimizer.step(), after the whole backward. With it, FSDP2's post-reduce hook of each sharded matrix parameter
(`register_post_accumulate_grad_hook`, which FSDP2 calls on the sharded parameter once its gradient is reduce-
scattered; with gradient accumulation the trainer arms it for the last micro-batch's backward only) computes that
matrix's U rows, and the exchange starts while the rest of the backward runs:
- gather mode: the rows are queued; every `bucket_mb` of whole matrices one all-gather starts, and the last partial
  bucket starts when the backward ends (an autograd engine callback). step() waits for the buffers, assembles each
  shape's whole matrices and computes their directions.
- owner mode (owner_exchange.py): the hooks follow the step's own plan (plan_exchanges on the group's shapes, every
  matrix of the group assumed to get a gradient) and write each matrix's rows into its slot of its exchange's send
  buffer; when every matrix of an exchange has its rows, that exchange's inbound all-to-all (to the owners)
  starts. step() runs owner_directions from these already-started inbounds: it waits, computes the owned
  directions and returns the rows as without overlap.
Collective order: FSDP2 calls the hooks inside its per-group reduce (foreach_reduce), in its parameter order, and
reduces the groups in the same order on every rank (its own reduce-scatters on this process group need that), so
every rank launches the same collectives in the same order, interleaved with FSDP2's at the same points; whether a
prefetch is used is decided from values equal on every rank (the clip flag comes from an all-reduced norm).

Exactness: the hook computes U from the gradient as it is after the reduce-scatter, with the same kernels as the
step (a foreach lerp, an add written straight into the gather dtype), so the exchanged U is bit for bit the step's
own, provided nothing changes the gradient in between. Gradient clipping does: it scales every gradient by a
factor known only after the whole backward, and NS5(mu M + c G ...) is not a function of the unclipped U. The
exchange is therefore speculative: the trainer tells the optimizer whether clipping scaled the gradients
(`gradients_scaled`, read with the step's one host read); if it did, or if anything else makes the prefetched
set differ from the step's (a parameter without gradient, a second backward before the step), the prefetch is
dropped and the step exchanges as without overlap: the same result, the early bytes wasted. Exchanging the raw
gradient and the previous momentum separately would always be exact but sends fp32 twice (8 bytes per element
against U's 2 in bf16) and is not bit-for-bit safe either (the elementwise kernels on a shard and on a whole
matrix need not round alike).

Memory, from the hooks to the step (in the gather dtype): gather mode holds every prefetched matrix whole (the
non-overlapped path holds one bucket at a time); owner mode holds this rank's rows of every matrix (the send
buffers, about 1/W of the matrices' bytes) and the whole matrices it owns (the receive buffers, about 1/W too),
where the non-overlapped path holds IN_FLIGHT exchanges (W matrices each). Each exchange's buffers go once the
step has assembled its owned matrices.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from dit_train.optim.collectives import PhaseSwitch, ShardComm
from dit_train.optim.directions import DTYPES, WHOLE
from dit_train.optim.owner_exchange import send_to_owners


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


@dataclass
class _OwnerPlan:
    """Owner mode, one matrix group: the step's exchanges, each matrix's slot in them, the send buffers being
    filled and the inbound all-to-alls started."""

    exchanges: list
    params: dict  # key -> the group's matrices of that key, in batch order
    slot: dict  # param -> (exchange index, position in it)
    sends: dict = field(default_factory=dict)  # exchange index -> [size, rows_here, n] U rows
    filled: dict = field(default_factory=dict)  # exchange index -> matrices written
    launched: dict = field(default_factory=dict)  # exchange index -> owner_exchange._Inbound


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
        self._where: dict = {}  # param -> where its U rows are: (bucket, entry) | owner mode (exchange, position)
        self._valid = True
        self._scaled = None  # unknown until the trainer says
        self._plans: dict = {}  # owner mode: id(group) -> _OwnerPlan
        self._comm = None
        self._flush_queued = False
        self.used = 0  # matrices whose prefetched U the step used
        self.armed = True  # False during the backwards of all but a step's last micro-batch (partial gradients)

    # ---- during backward --------------------------------------------------------------------------------------
    def _on_gradient(self, p) -> None:
        if not self.armed:
            return
        opt, group = self.opt, self._group_of[p]
        kind = opt.direction_at(group, group["step"])
        m, n = p.shape
        if opt.placement(kind, m, n) != WHOLE:
            return
        if p in self._where:  # a second synced backward before the step: the first U is stale
            self._valid = False
        if not self._valid:
            return
        if self._comm is None:
            self._comm = ShardComm(opt._group, opt.timer)
        if opt.distributed_mode == "owner":
            self._owner_rows(p, group, kind)
        else:
            self._gather_rows(p, group)

    def _write_u(self, p, group: dict, out: Tensor) -> None:
        """This rank's rows of p's U into `out` ([rows_here, n], the gather dtype), with the step's own kernels on
        the same values: a foreach lerp, then the add written in the gather dtype (MatrixOptimizer._stack_inputs)."""
        opt = self.opt
        g = opt._local(p.grad)
        state = opt.state.get(p, {})
        buf = opt._local(state["momentum_buffer"]) if "momentum_buffer" in state else torch.zeros_like(g)
        mu = group["momentum"]
        new_buf = torch._foreach_lerp([buf], [g], 1.0 - mu)[0]
        if group["nesterov"]:
            torch.add(g, new_buf, alpha=mu / (1.0 - mu), out=out)
        else:
            torch.mul(new_buf, 1.0 / (1.0 - mu), out=out)

    def _gather_rows(self, p, group: dict) -> None:
        m, n = p.shape
        if not self._flush_queued:  # the last partial bucket starts when the backward ends (else at the step)
            try:
                torch.autograd.Variable._execution_engine.queue_callback(self._launch_open)
            except RuntimeError:  # a hook fired outside a backward pass
                pass
            self._flush_queued = True
        local = self.opt._local(p)
        chunk = self._comm.rows(m)[0][1]
        U = torch.empty((chunk, n), dtype=DTYPES[self.opt.gather_dtype], device=local.device)
        rows = local.shape[0]
        self._write_u(p, group, U[:rows])
        U[rows:].zero_()
        b = self._open
        entry = _Entry(p, b.total, chunk)
        b.entries.append(entry)
        b.parts.append(U.reshape(-1))
        b.total += U.numel()
        b.whole_bytes += m * n * U.element_size()
        self._where[p] = (b, entry)
        if b.whole_bytes >= self.opt.bucket_mb * 2**20:
            self._launch_open()

    def _owner_rows(self, p, group: dict, kind: str) -> None:
        plan = self._plans.get(id(group))
        if plan is None:
            plan = self._plans[id(group)] = self._owner_plan(group, kind)
        i, j = plan.slot[p]
        ex = plan.exchanges[i]
        send = plan.sends.get(i)
        if send is None:
            local = self.opt._local(p)
            send = plan.sends[i] = torch.empty((ex.size, *local.shape), dtype=DTYPES[self.opt.gather_dtype],
                                               device=local.device)
        self._write_u(p, group, send[j])
        self._where[p] = (i, j)
        plan.filled[i] = plan.filled.get(i, 0) + 1
        if plan.filled[i] == ex.size:  # every matrix of the exchange has its rows: off to the owners
            plan.launched[i] = send_to_owners(ex, plan.sends.pop(i), self._comm)

    def _owner_plan(self, group: dict, kind: str) -> _OwnerPlan:
        """The step's exchanges for the group, on the assumption that every matrix gets a gradient: its whole-matrix
        shape groups keyed and ordered as the step stacks them (MatrixOptimizer._buckets)."""
        params: dict = {}
        for q in group["params"]:
            if self.opt.placement(kind, *q.shape) == WHOLE:
                local = self.opt._local(q)
                params.setdefault((tuple(q.shape), local.dtype, local.device), []).append(q)
        exchanges = self.opt._exchanges({key: len(ps) for key, ps in params.items()}, self._comm.world)
        slot = {params[ex.key][ex.start + j]: (i, j) for i, ex in enumerate(exchanges) for j in range(ex.size)}
        return _OwnerPlan(exchanges, params, slot)

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
                    _used_on_current_stream(b.recv)
                rows = b.recv.view(p_world, b.total)[:, e.offset:e.offset + e.chunk * n]
                W = rows.reshape(p_world * e.chunk, n)[:m]
                if whole is None:
                    whole = torch.empty((len(params), m, n), dtype=W.dtype, device=W.device)
                whole[j].copy_(W)
            out[key] = whole
            self.used += len(params)
        return out

    def inbound(self, group: dict, exchanges: list, params: dict) -> dict:
        """Owner mode: {exchange index: inbound all-to-all started in backward} for the group, when the hooks
        planned the step's own `exchanges` over the same matrices (`params`, key -> the step's matrices with a
        gradient, in batch order) from the gradients the step uses; {} (the step exchanges itself) otherwise."""
        plan = self._plans.get(id(group))
        if plan is None or not self._valid or self._scaled is not False:
            return {}
        ids = lambda by_key: {key: [id(q) for q in ps] for key, ps in by_key.items()}  # noqa: E731 (no tensor ==)
        if plan.exchanges != exchanges or ids(plan.params) != ids(params):
            return {}
        launched, plan.launched = plan.launched, {}  # owner_directions waits for them now
        for inb in launched.values():
            _used_on_current_stream(inb.recv, inb.send)
        self.used += sum(exchanges[i].size for i in launched)
        return launched

    def clear(self) -> None:
        """Drop the prefetch (after the step, or a skipped one): in-flight exchanges are waited for first."""
        for b in self._launched:
            if b.work is not None:
                b.work.wait()
        for plan in self._plans.values():
            for inb in plan.launched.values():
                inb.work.wait()
        self._reset()


def _used_on_current_stream(*tensors: Tensor) -> None:
    """The hooks run on FSDP2's post-reduce stream, where these buffers were allocated; the step reads them on the
    current stream: tell CUDA's caching allocator, so that their blocks are not reused before that stream is done."""
    for t in tensors:
        if t.is_cuda:
            t.record_stream(torch.cuda.current_stream(t.device))


def prefetched_directions(wholes: dict, compute, comm: ShardComm) -> tuple[dict, int]:
    """This rank's rows of the direction of every prefetched [B, m, n] batch; (out, whole directions computed)."""
    out, computed = {}, 0
    for key, W in wholes.items():
        D = compute(key, W)
        start, rows = comm.rows(key[0][0])[comm.rank]
        out[key] = D[:, start:start + rows]
        computed += W.shape[0]
    return out, computed
