"""Schemas of the optimizers (conf/optimizer/<name>.yaml). The keys shared by all optimizers are in
conf/_optimizer_base.yaml, those shared by the matrix optimizers in conf/_optimizer_matrix_base.yaml; the
inheritance here mirrors those files. Adding an optimizer: a schema here, a builder in dit_train/optim/registry.py, a yaml."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

from .fields import choice, int_at_least, key, number
from .schema import DTYPE_NAMES

_PATTERNS = "a list of dotted name patterns, e.g. ['final_layer.linear', 'blocks.*.attn.qkv']"


@dataclass
class AdamWConfig:
    name: str = key()
    lr: float = number("expected a learning rate > 0", lambda v: v > 0)
    weight_decay: float = number("expected >= 0", lambda v: v >= 0)
    betas: Tuple[float, float] = key("expected two numbers in [0, 1), e.g. [0.9, 0.999]",
                                     lambda v: all(0 <= b < 1 for b in v))
    eps: float = number("expected > 0", lambda v: v > 0)
    adamw_impl: str = choice("fused", "foreach", "single")


@dataclass
class MatrixConfig(AdamWConfig):
    momentum: float = number("expected a value in [0, 1)", lambda v: 0 <= v < 1)
    nesterov: bool = key()
    scale: str = choice("moonlight", "keller", "none")
    direction_eps: float = number("expected > 0", lambda v: v > 0)
    adamw_lr: Optional[float] = key("null (same as lr) or > 0", lambda v: v > 0)
    adamw_weight_decay: Optional[float] = key("null (same as weight_decay) or >= 0", lambda v: v >= 0)
    matrix_patterns: Optional[List[str]] = key(f"null or {_PATTERNS}", lambda v: all(p.strip(".") for p in v))
    adamw_patterns: Optional[List[str]] = key(f"null or {_PATTERNS}", lambda v: all(p.strip(".") for p in v))
    # placement on FSDP2 shards (optim/sharded_optimizer.py); a single process ignores them
    distributed_mode: str = choice("gather", "owner")
    gather_dtype: str = choice("bf16", "fp32")
    bucket_mb: float = number("expected > 0", lambda v: v > 0)
    overlap_exchange: bool = key()


def _rownorm_scale():
    # conf/_optimizer_rownorm_scale.yaml: RowNorm's scale rule (docs/algorithms.md §4)
    return choice("frobenius", "spectral")


def _compile_rownorm():
    # conf/_optimizer_rownorm_scale.yaml: RowNorm steps as fused kernels (optim/fused_rownorm.py)
    return choice("auto", True, False, valid="choose auto (compiled on CUDA, eager on CPU), true or false")


@dataclass
class RowNormConfig(MatrixConfig):
    rownorm_scale: str = _rownorm_scale()
    compile_rownorm: Any = _compile_rownorm()


@dataclass
class MuonConfig(MatrixConfig):
    ns_steps: int = int_at_least(1)
    ns_dtype: str = choice(*DTYPE_NAMES)
    ns_gram: Optional[bool] = key("null (automatic), true or false")


@dataclass
class PeriodicRowwiseConfig(MuonConfig):
    K: int = int_at_least(1)
    rownorm_scale: str = _rownorm_scale()
    compile_rownorm: Any = _compile_rownorm()


@dataclass
class MudConfig(MatrixConfig):
    mud_passes: int = int_at_least(1)
    mud_solve: str = choice("triangular", "inverse")


OPTIMIZER_SCHEMAS = {"adamw": AdamWConfig, "muon": MuonConfig, "periodic_rowwise": PeriodicRowwiseConfig,
                     "rownorm": RowNormConfig, "mud": MudConfig}
