"""Every optimizer config key, each declared once: default, type, rule, one-line doc and whether a resume may
change it. The keys every optimizer has (AdamWConfig), those of every matrix optimizer (MatrixConfig), of a periodic
schedule (PeriodicConfig) and of each direction (NS5Config, RowNormConfig, MudConfig: the direction's class in
directions/ names its Config). optim/catalog.py composes them, one line per optimizer, and dit_train.config reads
them there. No torch here or in the catalog: the command line is checked before torch is imported."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

from dit_train.config.fields import choice, int_at_least, key, number
from dit_train.dtypes import dtype_choices

DIRECTION_DTYPES = dtype_choices("bf16", "fp32", "fp64")  # what the directions compute in
_PATTERNS = "a list of dotted name patterns, e.g. ['final_layer.linear', 'blocks.*.attn.qkv']"


# Keys of every optimizer: the AdamW update, and for the matrix optimizers their AdamW side (biases, norms,
# embedders, final projection, embedding tables).
@dataclass(kw_only=True)  # keyword-only: a subclass may add keys without defaults
class AdamWConfig:
    """AdamW on every parameter: the baseline (torch's AdamW maths, decoupled weight decay)."""
    name: str = key(default="adamw", doc="the optimizer")
    lr: float = number("expected a learning rate > 0", lambda v: v > 0, default=2.0e-3,
                       doc="shared by the matrix update and AdamW: the moonlight scale matches AdamW's update RMS")
    weight_decay: float = number("expected >= 0", lambda v: v >= 0, default=0.01,
                                 doc="decoupled: W <- (1 - lr*wd) W - lr*update")
    betas: Tuple[float, float] = key("expected two numbers in [0, 1), e.g. [0.9, 0.999]",
                                     lambda v: all(0 <= b < 1 for b in v), default=[0.9, 0.999],
                                     doc="AdamW's moment decays")
    eps: float = number("expected > 0", lambda v: v > 0, default=1.0e-8, doc="AdamW's denominator eps")
    adamw_impl: str = choice("fused", "foreach", "single", default="fused",
                             doc="fused | foreach | single: torch's AdamW kernels, same maths (fused is ~6x faster "
                                 "on CPU)")


# Hidden 2-D weights take the matrix update W <- (1 - lr*wd) W - lr*s(W)*Phi(U), everything else AdamW.
@dataclass(kw_only=True)
class MatrixConfig(AdamWConfig):
    momentum: float = number("expected a value in [0, 1)", lambda v: 0 <= v < 1, default=0.95, doc="M <- mu*M + G")
    nesterov: bool = key(default=True, doc="U = G + mu*M (false: U = M)")
    scale: str = choice("moonlight", "keller", "none", default="moonlight",
                        doc="moonlight: 0.2*sqrt(max(m,n)) | keller: sqrt(max(1,m/n)) | none: 1")
    direction_eps: float = number("expected > 0", lambda v: v > 0, default=1.0e-7,
                                  doc="NS5 normalisation eps / RowNorm and MUD row-norm floor")
    adamw_lr: Optional[float] = key("null (same as lr) or > 0", lambda v: v > 0, default=None,
                                    doc="null: same as lr")
    adamw_weight_decay: Optional[float] = key("null (same as weight_decay) or >= 0", lambda v: v >= 0, default=None,
                                              doc="null: same as weight_decay")
    # Routing (dit_train/optim/routing.py): 2-D weights (nn.Linear, and other 2-D parameters by shape; not embedding
    # tables, not convolutions) take the matrix update unless they match adamw_patterns; null keeps the built-in
    # input/output-layer list. Patterns are dotted name fragments matched on whole components, each an fnmatch glob.
    matrix_patterns: Optional[List[str]] = key(f"null or {_PATTERNS}", lambda v: all(p.strip(".") for p in v),
                                               default=None,
                                               doc="forced to the matrix update (2-D only), checked first")
    adamw_patterns: Optional[List[str]] = key(f"null or {_PATTERNS}", lambda v: all(p.strip(".") for p in v),
                                              default=None,
                                              doc="forced to AdamW; replaces the built-in list when given")
    # Placement on FSDP2 shards (optim/sharded_optimizer.py; a single process ignores them): how whole-matrix
    # directions (NS5, MUD) bring whole matrices together. RowNorm never needs whole matrices (local rows, or
    # all-reduced column norms). None of them changes the maths, so a resume may change them. placement=True: the
    # registry passes exactly the keys so marked to ShardedMatrixOptimizer.
    distributed_mode: str = choice(
        "gather", "owner", default="owner", resume=True, placement=True,
        doc="owner: all-to-all to one owner per matrix, direction once, all-to-all back (W matrices per exchange) | "
            "gather: all-gather U, direction on every rank (the paper's baseline)")
    gather_dtype: str = choice(*dtype_choices("bf16", "fp32"), default="bf16", placement=True,
                               doc="bf16 | fp32: dtype U travels in (bf16 = NS5's input as a single process "
                                   "computes it)")
    bucket_mb: float = number("expected > 0", lambda v: v > 0, default=16, resume=True, placement=True,
                              doc="gather mode: MB of whole matrices per bucket; the next bucket's collective overlaps "
                                  "this bucket's direction")
    overlap_exchange: bool = key(
        default=False, resume=True, placement=True,
        doc="start the exchange of U during backward, as each matrix's gradient is reduced (gather: bucketed "
            "all-gathers; owner: each exchange's all-to-all to the owners once its matrices have their rows; "
            "optim/backward_overlap.py; unused on steps where clipping scaled the gradients)")


@dataclass(kw_only=True)
class PeriodicConfig:
    K: int = int_at_least(1, default=3, doc="refresh period: the first direction when step % K == 0 (step 0-based, "
                                            "kept in the optimizer state), the second otherwise; K = 1 is the first "
                                            "alone")


# The directions' keys (directions/ns5.py, rownorm.py, mud.py)
@dataclass(kw_only=True)
class NS5Config:
    ns_steps: int = int_at_least(1, default=5, doc="Newton-Schulz iterations")
    ns_dtype: str = choice(*DIRECTION_DTYPES, default="bf16", doc="NS5 compute dtype")
    ns_gram: Optional[bool] = key("null (automatic), true or false", default=None,
                                  doc="null: Gram form where max(m,n) >= 2 min(m,n) (same map, fewer flops); "
                                      "true/false forces it")


@dataclass(kw_only=True)
class RowNormConfig:
    rownorm_scale: str = choice("frobenius", "spectral", default="spectral", recorded_before="frobenius",
                                doc="frobenius: the paper's rule; spectral: scaled toward a cap on ||Phi||_2 by a "
                                    "3-round power-iteration estimate (docs/algorithms.md §4)")
    compile_rownorm: Any = choice("auto", True, False, valid="choose auto (compiled on CUDA, eager on CPU), true or "
                                  "false", default="auto", resume=True,
                                  doc="RowNorm's elementwise passes torch.compile'd: auto compiles on CUDA and runs "
                                      "eagerly on CPU; true (needs a C++ compiler on CPU) / false")


@dataclass(kw_only=True)
class MudConfig:
    mud_passes: int = int_at_least(1, default=1, doc="whitening passes")
    mud_solve: str = choice("triangular", "inverse", default="triangular",
                            doc="triangular: solve T Y = Q (faster on CPU here) | inverse: T^-1 against I, then one "
                                "GEMM")
    # MatrixConfig's key with MUD's value: MUD computes in fp32, so U travels in fp32
    gather_dtype: str = choice(*dtype_choices("bf16", "fp32"), default="fp32", doc="MUD computes in fp32, so U travels in fp32")
