"""The config keys every optimizer has (AdamWConfig: conf/_optimizer_base.yaml), those of every matrix optimizer
(MatrixConfig: conf/_optimizer_matrix_base.yaml) and of a periodic schedule (PeriodicConfig). A matrix optimizer's
Config adds its directions' Configs (directions/); optim/registry.py composes them, one line per optimizer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

from dit_train.config.fields import choice, int_at_least, key, number

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


@dataclass
class PeriodicConfig:
    K: int = int_at_least(1, default=3, doc="refresh period: the first direction when step % K == 0 (step 0-based, "
                                            "kept in the optimizer state), the second otherwise; K = 1 is the first "
                                            "alone")
