"""MUD: triangular whitening of U (docs/algorithms.md §3), in fp32 (fp64 for fp64 input)."""

from __future__ import annotations


import torch
from torch import Tensor

from dit_train.optim.optimizer_config import MudConfig
from dit_train.parallel.matmul_precision import ieee_fp32_matmuls
from dit_train.optim.directions.base import REDUCE, WHOLE, Direction
from dit_train.optim.directions.linalg import Reduce, batched, buffer, check_matrix, gram, is_tall, left, reduced, row_sumsq_of


class MUD(Direction):
    """mud_whiten of U, `mud_passes` passes, solved per `mud_solve`."""

    name = "mud"
    Config = MudConfig

    def __init__(self, passes: int = 1, solve: str = "triangular"):
        self.passes, self.solve = passes, solve

    @classmethod
    def from_config(cls, values: dict) -> "MUD":
        return cls(values["mud_passes"], values["mud_solve"])

    def group_keys(self) -> dict:
        return {"mud_passes": self.passes, "mud_solve": self.solve}

    def __call__(self, U, group, ws, **placement):
        D = mud_whiten(U, group["mud_passes"], group["direction_eps"], solve=group["mud_solve"], workspace=ws,
                       **placement)
        return D, None

    def placement(self, m, n):
        # tall shards: the Gram matrix's lower triangle all-reduced (optim/sharded_optimizer.py)
        return REDUCE if m > n else WHOLE


@ieee_fp32_matmuls()
def mud_whiten(
    X: Tensor,
    passes: int = 1,
    eps: float = 1e-7,
    *,
    solve: str = "triangular",
    out_dtype: torch.dtype | None = None,
    reduce: Reduce = None,
    tall: bool | None = None,
    workspace: dict | None = None,
) -> Tensor:
    """MUD triangular whitening (docs/algorithms.md §3) of the oriented r x c matrix Q, in fp32 (fp64 for fp64 input):
    repeat `passes` times: Q <- D^-1 Q (unit rows); G = Q Q^T; T = tril(G) with diagonal >= eps; Q <- T^-1 Q;
    Q <- D^-1 Q. The leading normalisation is skipped from the second pass on (rows are already unit).
    Row-orthonormal matrices are fixed points. solve='triangular' (default, faster here: docs/bench_optimizer.md)
    solves T Y = Q directly; solve='inverse' forms T^-1 by a triangular solve against I and applies it by one GEMM."""
    check_matrix(X, "mud_whiten")
    if passes < 1:
        raise ValueError(f"mud_whiten passes={passes} must be >= 1")
    if solve not in ("inverse", "triangular"):
        raise ValueError(f"mud_whiten solve={solve!r} must be 'inverse' or 'triangular'")
    out_dtype = X.dtype if out_dtype is None else out_dtype
    tall = is_tall(X) if tall is None else tall
    work = torch.promote_types(X.dtype, torch.float32)
    lead = X.shape[:-2]
    Xb = batched(X)
    Bn, m, n = Xb.shape
    r = n if tall else m
    bufs = [buffer(workspace, "mud_q0", Xb.shape, work, Xb.device), buffer(workspace, "mud_q1", Xb.shape, work, Xb.device)]
    Q = torch.mul(Xb, row_sumsq_of(Xb, tall, reduce).sqrt_().clamp_min_(eps).reciprocal_(), out=bufs[0])
    G = buffer(workspace, "mud_g", (Bn, r, r), work, Xb.device)
    eye = None
    for p in range(passes):
        gram(Q, tall, out=G)
        T = reduced(G, reduce).tril_()
        T.diagonal(dim1=-2, dim2=-1).clamp_min_(eps)
        nxt = bufs[(p + 1) % 2]
        if solve == "triangular":
            # T^-1 O(Q); for a tall Q (= O(Q)^T) that is Q T^-T, a solve from the right with the upper T^T
            if tall:
                torch.linalg.solve_triangular(T.mT, Q, upper=True, left=False, out=nxt)
            else:
                torch.linalg.solve_triangular(T, Q, upper=False, out=nxt)
        else:
            if eye is None:
                eye = torch.eye(r, dtype=work, device=Xb.device).expand(Bn, r, r)
            left(torch.linalg.solve_triangular(T, eye, upper=False), Q, tall, out=nxt)
        Q = nxt
        Q.mul_(row_sumsq_of(Q, tall, reduce).sqrt_().clamp_min_(eps).reciprocal_())
    Q = Q.reshape(*lead, m, n)
    return Q if Q.dtype == out_dtype else Q.to(out_dtype)
