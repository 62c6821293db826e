"""What a direction is to MatrixOptimizer: a small object that computes Phi(U) for a stacked batch of momentum inputs
U [B, m, n] (docs/algorithms.md §3) and declares its own config keys. One module per direction (ns5.py,
rownorm.py, mud.py); a new one is one such file plus one line in optim/registry.py (docs/extending.md).

A direction's hyperparameters live in the param groups (as torch optimizers keep lr there): `group_keys()` puts
them into the optimizer's defaults, so they are saved in its state_dict and may differ per group, and `__call__`
reads them back from the group it is given.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor

from dit_train.optim.directions.linalg import Reduce

# where the direction of a matrix held as dim-0 shards is computed (optim/sharded_optimizer.py, docs/algorithms.md §6)
LOCAL, REDUCE, WHOLE = "local", "reduce", "whole"


class Direction:
    """Phi(U) of a stacked batch. Subclasses set `name` (the param group's direction/between value, and the name
    in logs and checkpoints) and `Config` (a dataclass of the config keys this direction adds: default, type, rule
    and a one-line doc each; dit_train.config.fields.key), and implement __call__."""

    name: ClassVar[str]
    Config: ClassVar[type]

    @classmethod
    def from_config(cls, values: dict[str, Any]) -> "Direction":
        """The direction a checked optimizer config asks for (values: check_optimizer's plain dict)."""
        return cls()

    def group_keys(self) -> dict[str, Any]:
        """This direction's hyperparameters as param-group keys."""
        return {}

    def __call__(self, U: Tensor, group: dict, ws: dict, *, reduce: Reduce = None,
                 tall: bool | None = None) -> tuple[Tensor, Tensor | None]:
        """(D, row_scale) with Phi(U) = D * row_scale (row_scale None: D itself); returning a per-row factor lets
        the update fold it in. `ws`: the bucket's workspace dict (results may live in it until the next step).
        reduce/tall: set for a shard (linalg.py); a direction whose placement is WHOLE only sees whole matrices."""
        raise NotImplementedError

    def input_dtype(self, group: dict, param_dtype: torch.dtype) -> torch.dtype:
        """The dtype U is stacked in for this direction (the momentum's own by default)."""
        return param_dtype

    def output_dtype(self, group: dict, gathered: torch.dtype) -> torch.dtype:
        """The dtype of a whole-matrix result sent back to the shards' owners (the gathered input's by default)."""
        return gathered

    def placement(self, m: int, n: int) -> str:
        """Where the direction of an m x n matrix held as dim-0 shards is computed: WHOLE (on gathered whole
        matrices; any direction works there), LOCAL (each rank its own rows) or REDUCE (on the shards, with
        all-reduces of the sums over rows through `reduce`)."""
        return WHOLE
