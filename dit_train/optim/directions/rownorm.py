"""RowNorm: every row of the r x c side of U scaled to unit norm (docs/algorithms.md §3), with its scale rule
(rownorm_scale: frobenius, or spectral: toward a cap on the operator norm, optim/spectral_cap.py, §4) and the
choice of running its elementwise passes as torch.compile'd kernels (compile_rownorm, optim/fused_rownorm.py)."""

from __future__ import annotations


import torch
from torch import Tensor

from dit_train.optim.optimizer_config import RowNormConfig
from dit_train.optim.directions.base import LOCAL, REDUCE, Direction
from dit_train.optim.directions.linalg import Reduce, check_matrix, is_tall, row_sumsq_of

# The bucket-workspace key under which a fused momentum pass (fused_rownorm.py) leaves U's unreduced row sums of
# squares for this step's RowNorm direction, which takes them instead of reading U again.
ROW_SUMSQ = "row_sumsq"


def take_row_sumsq(ws: dict) -> Tensor | None:
    return ws.pop(ROW_SUMSQ, None)


class RowNorm(Direction):
    """U with row factors 1 / max(||row||, eps) (returned as the row scale, folded into the update), times
    min(1, cap / sigma) under the spectral scale (applied by the optimizer across buckets: spectral_cap.py)."""

    name = "rownorm"
    Config = RowNormConfig

    def __init__(self, scale: str = "spectral", compile: bool | str = "auto"):
        if scale not in ("frobenius", "spectral"):
            raise ValueError(f"rownorm_scale={scale!r} is not valid; choose one of frobenius, spectral")
        self.scale, self.compile = scale, compile

    @classmethod
    def from_config(cls, values: dict) -> "RowNorm":
        return cls(values["rownorm_scale"], values["compile_rownorm"])

    def group_keys(self) -> dict:
        return {"rownorm_scale": self.scale}

    @staticmethod
    def capped(group: dict) -> bool:
        """Whether this group's RowNorm steps take the spectral cap. Groups saved before the key existed are
        frobenius."""
        return group.get("rownorm_scale", "frobenius") == "spectral"

    def __call__(self, U, group, ws, *, reduce=None, tall=None):
        sumsq = take_row_sumsq(ws)
        if sumsq is None:
            return U, row_inv_norms(U, group["direction_eps"], reduce=reduce, tall=tall, workspace=ws)
        return U, inv_norms_from_sumsq(sumsq if reduce is None else reduce(sumsq), group["direction_eps"])

    def placement(self, m, n):
        return REDUCE if m > n else LOCAL  # a tall matrix's rows of O(U) are its columns, split over the ranks


def row_inv_norms(X: Tensor, eps: float = 1e-7, reduce: Reduce = None, tall: bool | None = None,
                  workspace: dict | None = None) -> Tensor:
    """1 / max(||row||, eps) for every row of O(X), shaped to broadcast against X itself: [..., m, 1] for wide X,
    [..., 1, n] for tall X. row_norm(X) == X * row_inv_norms(X); the optimizer applies the factor inside its
    parameter update instead of materialising the normalised matrix."""
    tall = is_tall(X) if tall is None else tall
    return inv_norms_from_sumsq(row_sumsq_of(X, tall, reduce, workspace), eps)


def row_sumsq(X: Tensor, tall: bool | None = None, workspace: dict | None = None) -> Tensor:
    """The sums of squares row_inv_norms passes to `reduce`, unreduced. A sharded caller that reduces the shards of
    many matrices in one collective takes these, reduces them together, then finishes with inv_norms_from_sumsq:
    the same result as row_inv_norms(X, eps, reduce, tall)."""
    return row_sumsq_of(X, is_tall(X) if tall is None else tall, None, workspace)


def inv_norms_from_sumsq(sumsq: Tensor, eps: float = 1e-7) -> Tensor:
    """1 / max(sqrt(sumsq), eps), in place."""
    return sumsq.sqrt_().clamp_min_(eps).reciprocal_()


def row_norm(X: Tensor, eps: float = 1e-7, *, out_dtype: torch.dtype | None = None, reduce: Reduce = None,
             tall: bool | None = None) -> Tensor:
    """RowNorm (docs/algorithms.md §3): R(X)_i = X_i / max(||X_i||_2, eps) over the rows of the r x c side (the columns of a
    tall X). ||R||_F^2 = r for a matrix with no zero rows; zero rows stay zero. Norms accumulate in fp32."""
    check_matrix(X, "row_norm")
    out = X * row_inv_norms(X, eps, reduce, tall)
    return out.to(X.dtype if out_dtype is None else out_dtype)
