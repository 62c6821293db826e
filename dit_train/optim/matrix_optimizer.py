"""MatrixOptimizer: one torch.optim.Optimizer for a whole model (docs/algorithms.md §2, §4, §5).

Param groups carry `kind`: "matrix" groups take momentum -> direction -> scaled, decoupled-weight-decay update;
"adamw" groups take AdamW (torch's own functional implementation, so the maths is torch.optim.AdamW's). Every
group has 'lr' and 'weight_decay', so one LR schedule (torch LambdaLR) drives all of them and there is one
state_dict.

Matrix step for W (m x n) with gradient G, at optimizer step t (0-based, kept in every group as group["step"], so
it is saved by state_dict and restored by load_state_dict):
    M <- mu M + G;   U <- G + mu M (nesterov) or M
          (the state keeps momentum_buffer = (1 - mu) M, updated by one foreach lerp as torch.optim.Muon keeps it;
          U is formed from it exactly: G + mu/(1-mu) * buffer, or buffer / (1 - mu))
    Phi = direction(U), the direction being group["direction"] when t % K == 0 (K = group["refresh_every"]) and
          group["between"] otherwise (periodic_rowwise: NS5 refresh, RowNorm between; K = 1 is plain Muon);
          the groups name them, the Direction objects given to the constructor compute them (directions/)
    W <- (1 - lr wd) W - lr s(W) Phi,  s = 0.2 sqrt(max(m, n)) (moonlight) | sqrt(max(1, m/n)) (keller) | 1 (none)

Single-device placement: same-shape matrices of a group are stacked into one [B, m, n] workspace (one bmm chain
per shape; every large buffer of the direction is reused across steps, as fresh tens-of-MB allocations cost page
faults on CPU) and updated with foreach ops. The maths lives in directions/; where the matrices live is in `_local` (the tensors this process updates) and
`_directions` (every bucket's direction), which the sharded subclass (optim/sharded_optimizer.py: FSDP2 shards, explicit
collectives, docs/algorithms.md §6) overrides while reusing the rest: buckets are keyed by the whole matrix's shape, the
stacked inputs take the local shape, and the direction functions take `reduce=` (an all-reduce over the ranks
holding the other columns) and `tall=` (orient a shard as its whole matrix), tested against the whole matrix in
tests/unit/test_optim_directions.py.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Iterable

import torch
from torch import Tensor
from torch.optim import Optimizer
from torch.optim.adam import adam as _adam_functional

from dit_train.optim.directions import NS5, Direction, RowNorm, dtype_name
from dit_train.optim.directions.rownorm import ROW_SUMSQ
from dit_train.optim.hooks import TrainerHooks
from dit_train.optim.fused_rownorm import momentum_pass, resolve_compile_rownorm, update_pass
from dit_train.optim.spectral_cap import cap_factors, whole_matrix_problem

SCALE_RULES = ("moonlight", "keller", "none")
KINDS = ("matrix", "adamw")


def update_scale(rule: str, m: int, n: int) -> float:
    """s(W) for an m x n weight (m = out features, n = in features), docs/algorithms.md §4."""
    if rule == "moonlight":
        return 0.2 * math.sqrt(max(m, n))
    if rule == "keller":
        return math.sqrt(max(1.0, m / n))
    if rule == "none":
        return 1.0
    raise ValueError(f"scale={rule!r} is not valid; choose one of {', '.join(SCALE_RULES)}")


class MatrixOptimizer(Optimizer, TrainerHooks):
    """Matrix groups (Muon family, RowNorm, MUD) and AdamW groups in one optimizer; see the module docstring.

    `params`: param groups, each a dict with "params" and "kind" ("matrix" or "adamw") plus any per-group
    overrides of the keyword defaults below (the directions' hyperparameters included: Direction.group_keys);
    a plain iterable of tensors is one matrix group. `direction` (default NS5()) runs on refresh steps, `between`
    (None: none) on the others, every `refresh_every` steps."""

    accepts_dtensors = False  # matrix groups of FSDP2 shards need ShardedMatrixOptimizer (optim/sharded_optimizer.py)

    def __init__(
        self,
        params: Iterable,
        *,
        lr: float,
        weight_decay: float = 0.0,
        momentum: float = 0.95,
        nesterov: bool = True,
        scale: str = "moonlight",
        direction: Direction | None = None,
        refresh_every: int = 1,
        between: Direction | None = None,
        direction_eps: float = 1e-7,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        adamw_impl: str = "fused",
    ):
        direction = NS5() if direction is None else direction
        # the directions by the names the groups (and saved states) hold; set before any group is checked
        self.directions: dict[str, Direction] = {d.name: d for d in (direction, between) if d is not None}
        defaults = dict(
            kind="matrix", lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov, scale=scale,
            direction=direction.name, refresh_every=refresh_every, between=None if between is None else between.name,
            direction_eps=direction_eps, betas=tuple(betas), eps=eps, adamw_impl=adamw_impl, step=0,
            **{k: v for d in self.directions.values() for k, v in d.group_keys().items()},
        )
        super().__init__(params, defaults)
        # RowNorm steps' elementwise passes fused (fused_rownorm.py: torch.compile'd kernels): an
        # implementation choice with the same maths, so an attribute (not a group key, not in the state_dict)
        rownorm = next((d for d in self.directions.values() if isinstance(d, RowNorm)), None)
        self.compile_rownorm = resolve_compile_rownorm(
            False if rownorm is None else rownorm.compile,
            [p for g in self.param_groups if g["kind"] == "matrix" for p in g["params"]])
        self._workspace: dict = {}
        self._last_info: dict[str, float] = {}
        self.routing_table: str = ""

    def add_param_group(self, param_group: dict) -> None:
        # a group added later joins at the current step, so periodic refreshes stay aligned across groups
        if getattr(self, "param_groups", None) and "step" not in param_group:
            param_group["step"] = max(g["step"] for g in self.param_groups)
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        _check_group(group, self.directions, self.accepts_dtensors)

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self._workspace = {}
        self._last_info = {}
        self.__dict__.setdefault("routing_table", "")
        self.__dict__.setdefault("compile_rownorm", False)
        for group in self.param_groups:  # states saved before the short dtype names say 'bfloat16'
            if "ns_dtype" in group:
                group["ns_dtype"] = dtype_name(group["ns_dtype"])

    # ---- public -------------------------------------------------------------------------------------------
    def direction_at(self, group: dict, step: int) -> str:
        """The direction a matrix group uses at optimizer step `step` (0-based)."""
        K = group["refresh_every"]
        if group["between"] is None or step % K == 0:
            return group["direction"]
        return group["between"]

    def step_info(self) -> dict[str, float]:
        """Scalars about the last step, for the logger: opt/refresh (1 = spectral refresh, 0 = between step) for
        optimizers with a periodic schedule; empty otherwise."""
        return dict(self._last_info)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        info: dict[str, float] = {}
        timer = self.timer
        for group in self.param_groups:
            t = group["step"]
            if group["kind"] == "matrix":
                kind = self.direction_at(group, t)
                if group["between"] is not None:
                    info["opt/refresh"] = float(kind == group["direction"])
                self._matrix_step(group, kind, timer)
            else:
                with timer.phase("adamw"):
                    self._adamw_step(group)
            group["step"] = t + 1
        self._last_info = info
        return loss

    # ---- matrix groups ------------------------------------------------------------------------------------
    def _matrix_step(self, group: dict, kind: str, timer) -> None:
        params, grads, bufs, shapes = self._matrix_tensors(group)
        if not params:
            return
        mu, nesterov = group["momentum"], group["nesterov"]
        lr, wd = float(group["lr"]), group["weight_decay"]
        buckets = _buckets(params, shapes)
        fused = self.compile_rownorm and isinstance(self.directions[kind], RowNorm)
        # the fused passes store U only for the spectral RowNorm scale, whose power iteration reads it; otherwise
        # the momentum pass only reads G and M (U's sums), and the update pass writes M and W, recomputing U
        store_u = not fused or self._caps(kind, group)
        with timer.phase("momentum"):
            if not fused:
                torch._foreach_lerp_(bufs, grads, 1.0 - mu)  # buffer = (1 - mu) M: M <- mu M + G
            inputs = {key: self._stack_inputs(key, idx, grads, bufs, mu, nesterov,
                                              self._input_dtype(kind, key, group, params[idx[0]].dtype), fused,
                                              store_u)
                      for key, idx in buckets.items()}
        directions = self._directions(kind, inputs, group, timer)
        with timer.phase("update"):
            if wd != 0 and not fused:
                torch._foreach_mul_(params, 1.0 - lr * wd)
            lr_on = {}  # the fused passes take lr as a 0-d tensor per device (a float would recompile them)
            for key, idx in buckets.items():
                m, n = key[0]
                scale = update_scale(group["scale"], m, n)
                bucket = [params[i] for i in idx]
                D, row_scale = directions[key]
                if fused:  # momentum (unless stored with U), weight decay and update in one pass
                    device = key[2]
                    if device not in lr_on:
                        lr_on[device] = torch.full((), lr, dtype=torch.float64, device=device)
                    update_pass(bucket, [grads[i] for i in idx], [bufs[i] for i in idx], D, store_u, row_scale,
                                lr_on[device], wd, scale, mu, nesterov, m > n)
                else:
                    self._apply_update(bucket, D, row_scale, -lr * scale)

    def _matrix_tensors(self, group: dict) -> tuple[list[Tensor], list[Tensor], list[Tensor], list[tuple]]:
        """(params, grads, momentum buffers, matrix shapes) of the group's matrices that have a gradient, creating
        the momentum state on first use. The tensors are what this process updates (`_local`: the tensors
        themselves here, the local shards in the sharded subclass); the shapes are the whole matrices' (m, n),
        which decide the bucket, the orientation and the update scale."""
        params, grads, bufs, shapes = [], [], [], []
        for p, state in self._with_grad(group):
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            params.append(self._local(p))
            grads.append(self._local(p.grad))
            bufs.append(self._local(state["momentum_buffer"]))
            shapes.append(tuple(p.shape))
        return params, grads, bufs, shapes

    def _with_grad(self, group: dict):
        """(param, its state) for the group's parameters that have a gradient this step (both sides of the
        optimizer skip the rest)."""
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError("MatrixOptimizer does not support sparse gradients")
            yield p, self.state[p]

    @staticmethod
    def _local(t: Tensor) -> Tensor:
        return t

    def _input_dtype(self, kind: str, key, group: dict, param_dtype: torch.dtype) -> torch.dtype:
        """Dtype of the stacked direction input (Direction.input_dtype)."""
        return self.directions[kind].input_dtype(group, param_dtype)

    def _caps(self, kind: str, group: dict) -> bool:
        """Whether this step's direction is RowNorm under the spectral scale (§4: spectral_cap.py)."""
        return isinstance(self.directions[kind], RowNorm) and RowNorm.capped(group)

    def _directions(self, kind: str, inputs: dict, group: dict, timer) -> dict:
        """The direction of every bucket: {key: (D, row_scale)}."""
        with timer.phase("direction"):
            out = {key: self._direction(kind, key, U, group) for key, U in inputs.items()}
            if self._caps(kind, group):
                keys = list(inputs)
                problems = [whole_matrix_problem(inputs[k], out[k][1], k[0][0] > k[0][1]) for k in keys]
                for k, f in zip(keys, cap_factors(problems)):
                    out[k] = (out[k][0], out[k][1] * f.to(out[k][1].dtype))
            return out

    def _direction(self, kind: str, key, U: Tensor, group: dict) -> tuple[Tensor, Tensor | None]:
        """Direction of one bucket; single device: the whole matrices are here, no reduce."""
        return self.directions[kind](U, group, self._bucket_workspace(key))

    def _bucket_workspace(self, key) -> dict:
        return self._workspace.setdefault(key, {})

    def _stack_inputs(self, key, idx: list[int], grads, bufs, mu: float, nesterov: bool, dtype,
                      fused: bool = False, store_u: bool = True) -> Tensor:
        """U = G + mu M (or M) for the bucket's matrices, written straight into a reused [B, m, n] workspace of the
        direction's input dtype: the Nesterov add, the cast and the stacking are one pass per matrix (torch has no
        foreach op that writes into slices of one tensor; a foreach add followed by a stack is 6x slower here).
        fused: U's row sums of squares are left in the workspace for the RowNorm direction
        (fused_rownorm.momentum_pass), with the momentum updated and U stored if store_u; without store_u, U is not
        formed at all and a zero-stride placeholder of its shape and dtype stands for it (the fused update pass
        updates the momentum and recomputes U from G and M)."""
        ws = self._bucket_workspace(key)
        shape = (len(idx), *bufs[idx[0]].shape)  # the local shape (a shard's rows in the sharded subclass)
        device = bufs[idx[0]].device
        if not store_u:
            U = torch.zeros((), dtype=dtype, device=device).expand(shape)
        else:
            U = ws.get(("u", dtype))
            if U is None or U.shape != shape:
                U = ws[("u", dtype)] = torch.empty(shape, dtype=dtype, device=device)
        if fused:
            ws[ROW_SUMSQ] = momentum_pass([grads[i] for i in idx], [bufs[i] for i in idx], U, mu, nesterov,
                                          key[0][0] > key[0][1], store_u)
            return U
        # bufs hold (1 - mu) M, so G + mu M = G + mu / (1 - mu) * buf and M = buf / (1 - mu)
        for j, i in enumerate(idx):
            if nesterov:
                torch.add(grads[i], bufs[i], alpha=mu / (1.0 - mu), out=U[j])
            else:
                torch.mul(bufs[i], 1.0 / (1.0 - mu), out=U[j])
        return U

    def _apply_update(self, params: list[Tensor], D: Tensor, row_scale: Tensor | None, alpha: float) -> None:
        """W_i += alpha * D_i (* row_scale_i) for the bucket's matrices (weight decay is already applied)."""
        if row_scale is None:
            torch._foreach_add_(params, list(D.unbind(0)), alpha=alpha)
        else:
            torch._foreach_addcmul_(params, list(D.unbind(0)), list(row_scale.unbind(0)), value=alpha)

    # ---- AdamW groups -------------------------------------------------------------------------------------
    def _adamw_step(self, group: dict) -> None:
        params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
        impl = group["adamw_impl"]
        for p, state in self._with_grad(group):
            if len(state) == 0:
                state["step"] = (torch.zeros((), dtype=torch.float32, device=p.device) if impl == "fused"
                                 else torch.tensor(0.0, dtype=torch.float32))
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            elif impl == "fused" and state["step"].device != p.device:  # a state_dict loaded onto another device
                state["step"] = state["step"].to(p.device)
            params.append(p)
            grads.append(p.grad)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        if not params:
            return
        beta1, beta2 = group["betas"]
        _adam_functional(
            params, grads, exp_avgs, exp_avg_sqs, [], steps,
            foreach=impl == "foreach", fused=True if impl == "fused" else None,
            decoupled_weight_decay=True, amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"],
            weight_decay=group["weight_decay"], eps=group["eps"], maximize=False,
        )


def _buckets(params: list[Tensor], shapes: list[tuple]) -> dict[tuple, list[int]]:
    """Indices of same-(matrix shape, dtype, device) matrices, which are stacked and processed as one batch."""
    out: dict[tuple, list[int]] = defaultdict(list)
    for i, (p, shape) in enumerate(zip(params, shapes)):
        out[(shape, p.dtype, p.device)].append(i)
    return dict(out)


def _check_group(group: dict, directions: dict[str, Direction], accepts_dtensors: bool = False) -> None:
    """Reject a group the step could not run, with the offending key, value and what is valid."""
    kind = group["kind"]
    if kind not in KINDS:
        raise ValueError(f"param group kind={kind!r} is not valid; choose one of {', '.join(KINDS)}")
    if kind == "matrix":
        # DTensor, tested without importing torch.distributed
        if not accepts_dtensors and any(hasattr(p, "to_local") for p in group["params"]):
            raise TypeError(
                "a matrix param group holds FSDP2 shards (DTensor parameters): they need the sharded "
                "implementation, ShardedMatrixOptimizer (optim/sharded_optimizer.py, docs/algorithms.md §6), which build_optimizer "
                "picks for sharded models")
        for p in group["params"]:
            if p.ndim != 2:
                raise ValueError(f"a matrix param group holds a parameter of shape {tuple(p.shape)}; "
                                 f"only 2-D parameters take the matrix update (route it to AdamW)")
        for key in ("direction", "between"):
            v = group[key]
            if v is not None and v not in directions:
                raise ValueError(f"{key}={v!r} is not valid: this optimizer was given the directions "
                                 f"{', '.join(directions)}")
        if group.get("rownorm_scale", "frobenius") not in ("frobenius", "spectral"):
            raise ValueError(f"rownorm_scale={group['rownorm_scale']!r} is not valid; choose one of "
                             "frobenius, spectral")
        # momentum, K, scale and adamw_impl are config values: dit_train.config.check_optimizer checks them
        if "ns_dtype" in group:
            group["ns_dtype"] = dtype_name(group["ns_dtype"])
