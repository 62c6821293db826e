"""ShardedMatrixOptimizer: the matrix optimizers on FSDP2 shards, with explicit collectives (docs/algorithms.md §6–7).

Every matrix parameter is a DTensor sharded along dim 0 over a 1-D mesh of p ranks (FSDP2's Shard(0); p need not
divide the rows, shards may be empty), or over the shard dim of a 2-D HSDP mesh (p the shard group's size; the
replicate dim holds identical copies, so every collective here runs within the shard group). Its momentum is a DTensor of the same placement, so optimizer state is
sharded like the parameters and checkpoints through DCP (dcp.py), resharding to another p. Momentum, Nesterov
input, weight decay and the update run on the local rows exactly as in MatrixOptimizer (whose step this reuses);
only the direction of a bucket of same-shape matrices depends on where the rows live:

| direction | wide (m <= n)                          | tall (m > n)                                            |
| --------- | -------------------------------------- | ------------------------------------------------------- |
| rownorm   | local rows, no communication           | column sums of squares (n fp32 per matrix) all-reduced  |
| spectral  | whole matrices: gather or owner mode   | whole matrices: gather or owner mode                    |
| mud       | whole matrices: gather or owner mode   | all-reduce of the Gram's lower triangle, column norms   |

RowNorm's column sums of every tall bucket travel in one asynchronous all-reduce, in flight while the wide
matrices are normalised (gloo's latency here is ~1.5 ms per collective); the factors are then those of
row_inv_norms(U, reduce=all-reduce, tall=True). MUD on tall shards is mud_whiten with `reduce=` a blocking
all-reduce (of n (n + 1) / 2 values per Gram: only tril(G) is used) and `tall=True`. The whole-matrix directions
are in owner_exchange.py (all-to-all to one owner per matrix and back, W matrices per exchange) and
whole_matrix_exchange.py (bucketed all-gather), computing with the single-device code on [L, m, n] batches.

Placement settings are attributes, not param-group keys, so a state_dict is the same as MatrixOptimizer's (and a
checkpoint resumes under any placement):
- distributed_mode: "owner" (default: each direction computed once, owner_exchange.py) | "gather" (every rank
  computes every direction, whole_matrix_exchange.py);
- gather_dtype: "bf16" | "fp32", the dtype in which the momentum input U travels and is stacked for the
  whole-matrix directions (bfloat16 = NS5's default compute dtype: the gathered input is then bit for bit the one
  a single process feeds NS5);
- bucket_mb: gather mode's bucket size in MB of whole matrices (in gather_dtype); owner mode's exchanges follow
  from the world size and the shape groups (W matrices each);
- overlap_exchange: the exchange starts in backward, as each matrix's gradient is reduced (backward_overlap.py;
  gather mode: bucketed all-gathers, owner mode: each exchange's inbound all-to-all once all its matrices have
  their rows); the trainer reports whether clipping scaled the gradients (`gradients_scaled`).

Accounting (through the timer the loop passes in, use_timer; see collectives.py): phases momentum / direction / comm (exposed wait only) /
update, and comm bytes per collective. `last_whole_matrices` is how many whole-matrix directions this rank
computed in the last step (gather: every matrix on every rank; owner: each matrix on one rank).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from dit_train.optim.backward_overlap import BackwardExchange, prefetched_directions
from dit_train.optim.collectives import PhaseSwitch, ShardComm, shard_rows
from dit_train.optim.directions import DTYPES, LOCAL, MUD, REDUCE, WHOLE, RowNorm, inv_norms_from_sumsq, row_sumsq, take_row_sumsq
from dit_train.optim.matrix_optimizer import MatrixOptimizer
from dit_train.optim.spectral_cap import cap_factors, spectral_cap, start_vectors
from dit_train.optim.owner_exchange import owner_directions, plan_exchanges
from dit_train.optim.whole_matrix_exchange import gather_directions, plan_buckets
from dit_train.parallel.fsdp import held_shard

def _reducer(gram_lower_triangle: bool, comm: ShardComm, phases: PhaseSwitch):
    """The `reduce=` hook for directions computed on tall shards: a blocking all-reduce of the per-shard sums.
    MUD's Gram matrices ([B, n, n]) travel as their lower triangles, n (n + 1) / 2 values each: MUD uses only
    T = tril(G) (the upper part it zeroes), and G is symmetric anyway."""

    def reduce(t: Tensor) -> Tensor:
        n = t.shape[-1]
        if not gram_lower_triangle or t.shape[-2] != n or n == 1:
            return comm.all_reduce_(t, phases)
        rows, cols = torch.tril_indices(n, n, device=t.device)
        lower = t[..., rows, cols].contiguous()
        comm.all_reduce_(lower, phases)
        t[..., rows, cols] = lower
        return t

    return reduce


def _dtensor_group(p):
    """The process group a matrix parameter's rows are split over: Shard(0) on a 1-D mesh (FSDP2), or on the
    shard dim of a 2-D (replicate, shard) mesh (HSDP; the replicas hold the same rows and the same averaged
    gradients, so every collective of the direction runs within the shard group and each replica computes the
    same update). A clear error for any other layout."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from dit_train.parallel.fsdp import shard_group

    if not isinstance(p, DTensor):
        raise TypeError(f"ShardedMatrixOptimizer: a matrix parameter of shape {tuple(p.shape)} is a "
                        f"{type(p).__name__}, not a DTensor; every matrix parameter must be an FSDP2 shard")
    if tuple(p.placements) not in ((Shard(0),), (Replicate(), Shard(0))):
        raise NotImplementedError(
            f"ShardedMatrixOptimizer supports dim-0 shards on a 1-D mesh (FSDP2) or on the shard dim of a 2-D "
            f"(replicate, shard) mesh (HSDP); got placements {p.placements} on a {p.device_mesh.ndim}-D mesh for a "
            f"parameter of shape {tuple(p.shape)}")
    return shard_group(p)


class ShardedMatrixOptimizer(MatrixOptimizer):
    """MatrixOptimizer for FSDP2-sharded models; see the module docstring. Takes MatrixOptimizer's arguments plus
    distributed_mode, gather_dtype and bucket_mb."""

    accepts_dtensors = True
    # Whether whole-matrix directions keep their per-(shape, count) workspaces between steps. None: on CPU only
    # (see _whole_directions). The memory estimate (dit-estimate-memory) runs on fake CPU tensors and sets
    # False to account for what a CUDA run keeps.
    keep_whole_matrix_workspaces: bool | None = None

    def __init__(self, params, *, distributed_mode: str = "owner", gather_dtype: str = "bf16",
                 bucket_mb: float = 16.0, overlap_exchange: bool = False, **kwargs):
        # the values are checked where the config is (dit_train.config.check_optimizer)
        self.distributed_mode, self.gather_dtype, self.bucket_mb = distributed_mode, gather_dtype, float(bucket_mb)
        self.last_whole_matrices = 0
        self._group = None
        super().__init__(params, **kwargs)
        self._overlap = BackwardExchange(self) if overlap_exchange else None

    # ---- the exchange behind backward (backward_overlap.py) ----------------------------------------------------
    def gradients_scaled(self, scaled: bool) -> None:
        """Whether the gradients were scaled (clipped) after backward: a prefetched exchange is then not used."""
        if self._overlap is not None:
            self._overlap.gradients_scaled(scaled)

    def backward_is_final(self, final: bool) -> None:
        """Gradient accumulation: whether the coming backward is the step's last. FSDP2 reduce-scatters after every
        micro-batch, so the hooks see partial gradients on the others and must not exchange them."""
        if self._overlap is not None:
            self._overlap.armed = bool(final)

    def step(self, closure=None):
        try:
            loss = super().step(closure)
            if self._overlap is not None:  # logged: how many matrices' exchange ran behind backward
                self._last_info["opt/exchanged_in_backward"] = float(self._overlap.used)
            return loss
        finally:
            if self._overlap is not None:
                self._overlap.clear()

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._overlap is not None:  # a skipped step leaves its prefetch behind
            self._overlap.clear()
        super().zero_grad(set_to_none)

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        if group["kind"] != "matrix":
            return
        for p in group["params"]:
            pg = _dtensor_group(p)
            if self._group is None:
                self._group = pg
            elif pg != self._group:
                raise ValueError("ShardedMatrixOptimizer: matrix parameters are sharded over different process "
                                 "groups; all must share FSDP2's one mesh")

    @staticmethod
    def _local(t: Tensor) -> Tensor:
        # the shard as held: to_local() dispatches a view per parameter and step (fsdp.held_shard)
        return held_shard(t)

    def describe_placement(self) -> str:
        behind = ", exchanged behind backward" if self._overlap is not None else ""
        owner = self.distributed_mode == "owner"
        ranks = dist.get_world_size(self._group) if self._group is not None else 1  # W: the shard group's ranks
        exchange = (f"up to {ranks} matrices per exchange (one per rank)" if owner
                    else f"buckets of {self.bucket_mb:g} MB")
        return (f"sharded: whole-matrix directions in {self.distributed_mode} mode, U sent in {self.gather_dtype}, "
                f"{exchange}{behind}")

    # ---- the direction stage ----------------------------------------------------------------------------------
    def placement(self, kind: str, m: int, n: int) -> str:
        """Where the direction `kind` of an m x n matrix held as dim-0 shards is computed (Direction.placement)."""
        return self.directions[kind].placement(m, n)

    def _input_dtype(self, kind: str, key, group: dict, param_dtype: torch.dtype) -> torch.dtype:
        if self.placement(kind, *key[0]) == WHOLE:
            return DTYPES[self.gather_dtype]
        return param_dtype

    def _directions(self, kind: str, inputs: dict, group: dict, timer) -> dict:
        comm = ShardComm(self._group, timer)
        phases = PhaseSwitch(timer, "direction")
        try:
            where = {}
            for key, U in inputs.items():
                self._check_rows(key, U, comm)
                where[key] = self.placement(kind, *key[0])
            out, self.last_whole_matrices = {}, 0
            # RowNorm on tall shards: every bucket's column sums of squares in one all-reduce, in flight while the
            # rest is computed
            direction = self.directions[kind]
            sums = [key for key in inputs if where[key] == REDUCE and isinstance(direction, RowNorm)]
            pending = self._start_column_sums(sums, inputs, comm) if sums else None
            for key, U in inputs.items():
                if where[key] == LOCAL or (where[key] == REDUCE and key not in sums):
                    reduce = (_reducer(isinstance(direction, MUD), comm, phases) if where[key] == REDUCE
                              else None)
                    out[key] = direction(U, group, self._bucket_workspace(key), reduce=reduce,
                                         tall=key[0][0] > key[0][1])
            whole = {key: U for key, U in inputs.items() if where[key] == WHOLE}
            if whole:
                out.update(self._whole_directions(kind, whole, group, comm, phases))
            if pending is not None:
                flat, parts, work = pending
                comm.wait(work, phases)
                for key, part in zip(sums, flat.split(parts)):
                    out[key] = (inputs[key], inv_norms_from_sumsq(part.view(inputs[key].shape[0], 1, -1),
                                                                  group["direction_eps"]))
            if self._caps(kind, group):
                self._cap_row_scales(inputs, out, where, comm, phases)
            return out
        finally:
            phases.close()

    def _cap_row_scales(self, inputs: dict, out: dict, where: dict, comm: ShardComm, phases: PhaseSwitch) -> None:
        """The spectral RowNorm scale on shards (spectral_cap.py): wide shards hold rows of R, tall shards columns;
        every bucket's power iteration advances together, one counted fp32 all-reduce per round (ROUNDS in all)."""
        problems = []
        for key, U in inputs.items():
            m, n = key[0]
            tall = where[key] == REDUCE
            r, c = (n, m) if tall else (m, n)
            if tall:
                x0 = start_vectors(U.shape[0], r, U.device, torch.promote_types(U.dtype, torch.float32))
            else:  # this rank's rows of R are its rows of the matrix
                x0 = self._start_vectors(key, U)
            problems.append((U, out[key][1], tall, x0, "cols" if tall else "rows", spectral_cap(r, c)))
        factors = cap_factors(problems, lambda t: comm.all_reduce_(t, phases))
        for key, f in zip(inputs, factors):
            out[key] = (out[key][0], out[key][1] * f.to(out[key][1].dtype))

    def _start_vectors(self, key, U: Tensor) -> Tensor:
        """This rank's rows of a wide bucket's start vectors."""
        start, rows = shard_rows(key[0][0], dist.get_world_size(self._group))[dist.get_rank(self._group)]
        whole = start_vectors(U.shape[0], key[0][0], U.device, torch.promote_types(U.dtype, torch.float32))
        return whole[:, start:start + rows].contiguous()

    def _start_column_sums(self, keys: list, inputs: dict, comm: ShardComm):
        """Partial column sums of squares of the tall buckets (each [B, 1, n], fp32; those a fused momentum pass
        left in the workspace, else computed here), flattened into one buffer and all-reduced asynchronously:
        (buffer, sizes, handle)."""
        partial = []
        for key in keys:
            ws = self._bucket_workspace(key)
            sums = take_row_sumsq(ws)
            partial.append((row_sumsq(inputs[key], tall=True, workspace=ws) if sums is None else sums).reshape(-1))
        flat = torch.cat(partial)
        return flat, [t.numel() for t in partial], comm.all_reduce(flat)

    def _whole_directions(self, kind: str, inputs: dict, group: dict, comm: ShardComm, phases: PhaseSwitch) -> dict:
        keep = self.keep_whole_matrix_workspaces
        if keep is None:
            keep = next(iter(inputs.values())).device.type == "cpu"

        def compute(key, X: Tensor) -> Tensor:
            # CPU: per-(shape, count) workspaces, reused every step (fresh tens-of-MB buffers page-fault there);
            # GPU: fresh buffers from the caching allocator, so whole matrices are not kept between buckets
            ws = self._workspace.setdefault(("whole", key, X.shape[0]), {}) if keep else None
            D, row_scale = self.directions[kind](X, group, {} if ws is None else ws)
            return D if row_scale is None else D * row_scale  # a registered direction that returns a row scale

        if self.distributed_mode == "owner":
            out_dtype = self.directions[kind].output_dtype(group, DTYPES[self.gather_dtype])
            exchanges = self._exchanges({key: U.shape[0] for key, U in inputs.items()}, comm.world)
            launched = {}
            if self._overlap is not None:  # inbound all-to-alls started in backward, if they hold
                with_grad = {}
                for p, _ in self._with_grad(group):
                    local = self._local(p)
                    with_grad.setdefault((tuple(p.shape), local.dtype, local.device), []).append(p)
                launched = self._overlap.inbound(group, exchanges, {key: with_grad[key] for key in inputs})
            out, self.last_whole_matrices = owner_directions(inputs, exchanges, compute, out_dtype, comm, phases,
                                                             launched)
            return {key: (D, None) for key, D in out.items()}
        prefetched = self._overlap.take(group, list(inputs), phases) if self._overlap is not None else None
        if prefetched is not None:
            out, self.last_whole_matrices = prefetched_directions(prefetched, compute, comm)
        else:
            elem = DTYPES[self.gather_dtype].itemsize
            buckets = plan_buckets({key: U.shape[0] for key, U in inputs.items()}, elem, self.bucket_mb * 2**20)
            out, self.last_whole_matrices = gather_directions(inputs, buckets, compute, comm, phases)
        return {key: (D, None) for key, D in out.items()}

    def _exchanges(self, counts: dict, world: int) -> list:
        """The owner mode's exchanges and owners (owner_exchange.plan_exchanges) for shape groups {key: matrices},
        kept while the groups and the world size stay the same (the hooks of backward_overlap.py plan with it too)."""
        groups = {key: (key[0], count) for key, count in counts.items()}
        sig = (tuple(groups.items()), world)
        cached = self.__dict__.get("_exchange_cache")
        if cached is None or cached[0] != sig:
            self._exchange_cache = (sig, plan_exchanges(groups, world))
        return self._exchange_cache[1]

    @staticmethod
    def _check_rows(key, U: Tensor, comm: ShardComm) -> None:
        m = key[0][0]
        rows = comm.rows(m)[comm.rank][1]
        if U.shape[1] != rows:
            raise RuntimeError(f"local shard of a {key[0]} matrix has {U.shape[1]} rows on rank {comm.rank} of "
                               f"{comm.world}; dim-0 sharding as torch.chunk gives {rows}")
