"""Update directions Phi(U) of a matrix (docs/algorithms.md §3): one module each, a small class (what it computes
from U, its own config keys) beside the pure functions it runs on a (possibly batched) matrix:

- ns5.py:     NS5, newton_schulz5 (Muon's quintic Newton-Schulz map), in bf16 by default;
- rownorm.py: RowNorm, row_norm / row_inv_norms (every row of the r x c side at unit norm), with its scale rule
              (the spectral cap: ../spectral_cap.py);
- mud.py:     MUD, mud_whiten (triangular whitening), in fp32.
base.py is the interface MatrixOptimizer calls; linalg.py the shared orientation/workspace/reduce helpers.
"""

from dit_train.optim.directions.base import LOCAL, REDUCE, WHOLE, Direction
from dit_train.optim.directions.linalg import DTYPES, is_tall, oriented
from dit_train.optim.directions.mud import MUD, MudConfig, mud_whiten
from dit_train.optim.directions.ns5 import (GRAM_MIN_ASPECT, GRAM_RESTART_AFTER, NS5, NS_COEFFICIENTS, NS5Config,
                                           dtype_name, gram_flop_ratio, newton_schulz5, ns5_executed_flops, ns5_flops,
                                           uses_gram)
from dit_train.optim.directions.rownorm import (RowNorm, RowNormConfig, inv_norms_from_sumsq, row_inv_norms, row_norm,
                                               row_sumsq, take_row_sumsq)

__all__ = ["DTYPES", "Direction", "GRAM_MIN_ASPECT", "GRAM_RESTART_AFTER", "LOCAL", "MUD", "MudConfig", "NS5",
           "NS5Config", "NS_COEFFICIENTS", "REDUCE", "RowNorm", "RowNormConfig", "WHOLE", "dtype_name",
           "gram_flop_ratio", "inv_norms_from_sumsq", "is_tall", "mud_whiten", "newton_schulz5", "ns5_executed_flops",
           "ns5_flops", "oriented", "row_inv_norms", "row_norm", "row_sumsq", "take_row_sumsq", "uses_gram"]
