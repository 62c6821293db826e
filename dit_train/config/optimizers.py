"""Schemas of the optimizers: each dataclass is the one declaration of its keys (type, default, range, doc, resume
rule); store.py registers each as the option `optimizer=<name>`. Every reader of an optimizer's schema goes through
optimizer_schema(name) (adding an optimizer: a schema here, one entry in OPTIMIZER_SCHEMAS, a builder in
dit_train/optim/registry.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

from dit_train.config.fields import choice, int_at_least, key, number
from dit_train.config.schema import DTYPE_NAMES

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
    # all-reduced column norms). None of them changes the maths, so a resume may change them.
    distributed_mode: str = choice(
        "gather", "owner", default="owner", resume=True,
        doc="owner: all-to-all to one owner per matrix, direction once, all-to-all back (W matrices per exchange) | "
            "gather: all-gather U, direction on every rank (the paper's baseline)")
    gather_dtype: str = choice("bf16", "fp32", default="bf16",
                               doc="bf16 | fp32: dtype U travels in (bf16 = NS5's input as a single process "
                                   "computes it)")
    bucket_mb: float = number("expected > 0", lambda v: v > 0, default=16, resume=True,
                              doc="gather mode: MB of whole matrices per bucket; the next bucket's collective overlaps "
                                  "this bucket's direction")
    overlap_exchange: bool = key(
        default=False, resume=True,
        doc="start the exchange of U during backward, as each matrix's gradient is reduced (gather: bucketed "
            "all-gathers; owner: each exchange's all-to-all to the owners once its matrices have their rows; "
            "optim/backward_overlap.py; unused on steps where clipping scaled the gradients)")


# The scale of RowNorm steps, shared by the optimizers that take them (rownorm, periodic_rowwise between refreshes);
# docs/algorithms.md §4.
# frobenius: the paper's rule (||Phi||_F^2 = min(m,n), like NS5; ||Phi||_2 up to sqrt(min(m,n)) on low-rank momentum)
# spectral: the same, scaled by min(1, cap / sigma) with cap = 1 + sqrt(min(m,n)/max(m,n)) and sigma a 3-round
#   power-iteration estimate of ||R||_2 that can only come out low: ||Phi||_2 is aimed at the cap, not bounded by it
#   (measured up to 1.83x the cap on rank-1 gradient sequences, 1.38x on random low-rank input)
# The default is spectral: in the paired study optimizer_comparison_cpu (docs/results/) its final validation loss is
# 6% below frobenius's and within 2% of Muon's (+0.89% [+0.01, +1.77] on the evaluation seeds; not shown
# equivalent), and at dit_m it has no loss spike where frobenius has one (at equal lr, where its steps are also
# smaller).
# compile_rownorm: RowNorm steps' elementwise work (momentum, direction input, row norms, decay, update) as two fused
# passes instead of eager ops: same maths to float rounding; on CPU C loops built once with the system C compiler,
# which also run the spectral scale's power iteration (optim/native_rownorm.py: frobenius ~1.0x our fused AdamW
# step, eager ~2.2x; spectral ~2x, eager ~4x), elsewhere torch.compile'd kernels (Triton on CUDA; one-off compile
# seconds at the first RowNorm step). optim/fused_rownorm.py, docs/bench_optimizer.md. auto: the C loops where they
# run (fp32/fp64 parameters on CPU, a C compiler), eager elsewhere (on CUDA the step is a few ms of memory traffic
# and the Triton kernels have not run on a GPU yet); true: fused everywhere; false: eager.
@dataclass(kw_only=True)
class RowNormScaleKeys:
    rownorm_scale: str = choice("frobenius", "spectral", default="spectral", recorded_before="frobenius",
                                doc="The scale of RowNorm steps: frobenius (the paper's rule) | spectral (capped at "
                                    "1 + sqrt(min(m,n)/max(m,n)); docs/algorithms.md §4)")
    compile_rownorm: Any = choice("auto", True, False, default="auto", resume=True,
                                  valid="choose auto (the C loops on CPU where they build, eager elsewhere), "
                                        "true or false",
                                  doc="RowNorm steps as two fused passes (same maths to float rounding): auto (C loops "
                                      "on CPU where they build, eager elsewhere) | true | false")


@dataclass(kw_only=True)
class RowNormConfig(RowNormScaleKeys, MatrixConfig):
    """RowNorm on every step: every row of the min(m,n) side of U normalised to unit length."""
    name: str = key(default="rownorm", doc="the optimizer")


@dataclass(kw_only=True)
class MuonConfig(MatrixConfig):
    """Muon: NS5 spectral direction on every step for hidden 2-D weights, AdamW on the rest."""
    name: str = key(default="muon", doc="the optimizer")
    ns_steps: int = int_at_least(1, default=5, doc="Newton-Schulz iterations")
    ns_dtype: str = choice(*DTYPE_NAMES, default="bf16", doc="bf16 | fp32 | fp64: NS5 compute dtype")
    ns_gram: Optional[bool] = key("null (automatic), true or false", default=None,
                                  doc="null: Gram form where max(m,n) >= 2 min(m,n) (same map, fewer flops); "
                                      "true/false forces it")


@dataclass(kw_only=True)
class PeriodicRowwiseConfig(RowNormScaleKeys, MuonConfig):
    """Periodic Row-wise Muon: NS5 refresh when step % K == 0 (step 0-based, kept in the optimizer state), RowNorm on
    the other steps. K = 1 is Muon."""
    name: str = key(default="periodic_rowwise", doc="the optimizer")
    K: int = int_at_least(1, default=3, doc="refresh period (integer >= 1)")


@dataclass(kw_only=True)
class MudConfig(MatrixConfig):
    """MUD: triangular whitening of the momentum (p passes) instead of Newton-Schulz."""
    name: str = key(default="mud", doc="the optimizer")
    mud_passes: int = int_at_least(1, default=1, doc="whitening passes")
    mud_solve: str = choice("triangular", "inverse", default="triangular",
                            doc="triangular: solve T Y = Q (faster on CPU here) | inverse: T^-1 against I, then one "
                                "GEMM")
    # MatrixConfig's key with MUD's value: MUD computes in fp32, so U travels in fp32
    gather_dtype: str = choice("bf16", "fp32", default="fp32", doc="MUD computes in fp32, so U travels in fp32")


OPTIMIZER_SCHEMAS = {"adamw": AdamWConfig, "muon": MuonConfig, "periodic_rowwise": PeriodicRowwiseConfig,
                     "rownorm": RowNormConfig, "mud": MudConfig}


def optimizer_names() -> list[str]:
    return sorted(OPTIMIZER_SCHEMAS)


def optimizer_schema(name: str):
    """The Config dataclass of optimizer `name` (None if there is none): the one way the config layer reads them."""
    return OPTIMIZER_SCHEMAS.get(name)
