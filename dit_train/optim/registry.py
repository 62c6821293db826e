"""The optimizer registry: `optimizer=<name>` on the command line -> conf/optimizer/<name>.yaml -> build_optimizer.

    OPTIMIZERS: name -> builder(model, cfg: dict) -> torch.optim.Optimizer
    build_optimizer(model, cfg) -> optimizer with `.routing_table: str` and `.step_info() -> dict[str, float]`

Adding an optimizer: write `dit_train/optim/<name>.py` with a `build(model, cfg)` (usually `build_matrix(model,
cfg, direction=..., ...)` from here, or any torch.optim.Optimizer), add `"<name>": <name>.build` to OPTIMIZERS and
a conf/optimizer/<name>.yaml. Nothing in the training loop changes.

Every key of the config is validated: an unknown key, or a value out of range, is a one-line ValueError naming the
key, the value seen and what is valid.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping

import torch
from torch import nn

from .matrix import ADAMW_IMPLS, SCALE_RULES, MatrixOptimizer
from .routing import Routing, format_routing_table, route_parameters
from .sharded import DISTRIBUTED_MODES, GATHER_DTYPES, ShardedMatrixOptimizer

Builder = Callable[[nn.Module, dict], torch.optim.Optimizer]

NS_DTYPES = ("bfloat16", "float32", "float64")
MUD_SOLVES = ("triangular", "inverse")


# ---- config validation ------------------------------------------------------------------------------------------
def _bad(key: str, value: Any, valid: str) -> ValueError:
    return ValueError(f"optimizer.{key}={value!r} is invalid: {valid}")


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _positive(key, v):
    if not _is_number(v) or not math.isfinite(v) or v <= 0:
        raise _bad(key, v, "must be a finite number > 0")
    return float(v)


def _non_negative(key, v):
    if not _is_number(v) or not math.isfinite(v) or v < 0:
        raise _bad(key, v, "must be a finite number >= 0")
    return float(v)


def _unit_interval(key, v):
    if not _is_number(v) or not 0 <= v < 1:
        raise _bad(key, v, "must be a number in [0, 1)")
    return float(v)


def _pos_int(key, v):
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise _bad(key, v, "must be an integer >= 1")
    return v


def _bool(key, v):
    if not isinstance(v, bool):
        raise _bad(key, v, "must be true or false")
    return v


def _betas(key, v):
    if not isinstance(v, (list, tuple)) or len(v) != 2 or not all(_is_number(b) and 0 <= b < 1 for b in v):
        raise _bad(key, v, "must be two numbers in [0, 1), e.g. [0.9, 0.999]")
    return (float(v[0]), float(v[1]))


def _choice(options):
    def check(key, v):
        if v not in options:
            raise _bad(key, v, f"choose one of {', '.join(map(str, options))}")
        return v
    return check


def _ns_dtype(key, v):
    if v not in NS_DTYPES:
        raise _bad(key, v, f"choose one of {', '.join(NS_DTYPES)}")
    return v


def _optional_bool(key, v):
    if v is not None and not isinstance(v, bool):
        raise _bad(key, v, "must be null (automatic), true or false")
    return v


def _optional_positive(key, v):
    return None if v is None else _positive(key, v)


def _optional_non_negative(key, v):
    return None if v is None else _non_negative(key, v)


def _patterns(key, v):
    if v is None:
        return None
    if not isinstance(v, (list, tuple)) or not all(isinstance(p, str) and p.strip(".") for p in v):
        raise _bad(key, v, "must be a list of dotted name patterns, e.g. ['final_layer.linear', 'blocks.*.attn.qkv']")
    return list(v)


# key -> (validator, default). The defaults match conf/optimizer/*.yaml.
COMMON_KEYS = {
    "lr": (_positive, 1e-3),
    "weight_decay": (_non_negative, 0.01),
    "betas": (_betas, (0.9, 0.999)),
    "eps": (_positive, 1e-8),
    "adamw_impl": (_choice(ADAMW_IMPLS), "fused"),
}
MATRIX_KEYS = {
    "momentum": (_unit_interval, 0.95),
    "nesterov": (_bool, True),
    "scale": (_choice(SCALE_RULES), "moonlight"),
    "direction_eps": (_positive, 1e-7),
    "adamw_lr": (_optional_positive, None),
    "adamw_weight_decay": (_optional_non_negative, None),
    "matrix_patterns": (_patterns, None),
    "adamw_patterns": (_patterns, None),
}
NS_KEYS = {
    "ns_steps": (_pos_int, 5),
    "ns_dtype": (_ns_dtype, "bfloat16"),
    "ns_gram": (_optional_bool, None),
}
PERIODIC_KEYS = {"K": (_pos_int, 3)}
MUD_KEYS = {"mud_passes": (_pos_int, 1), "mud_solve": (_choice(MUD_SOLVES), "triangular")}
# Placement on FSDP2 shards (optim/sharded.py); ignored by a single process. The gather dtype defaults to NS5's
# compute dtype for the Muon family and to MUD's fp32 for MUD.
DIST_KEYS = {
    "distributed_mode": (_choice(DISTRIBUTED_MODES), "gather"),
    "gather_dtype": (_choice(GATHER_DTYPES), "bfloat16"),
    "bucket_mb": (_positive, 16.0),
}
MUD_DIST_KEYS = {**DIST_KEYS, "gather_dtype": (_choice(GATHER_DTYPES), "float32")}


def resolve_config(cfg: Mapping | Any, keys: dict) -> dict:
    """Plain dict of validated values (defaults filled in) from a DictConfig or dict; `name` is dropped."""
    if not isinstance(cfg, Mapping):
        try:
            from omegaconf import OmegaConf
            cfg = OmegaConf.to_container(cfg, resolve=True)
        except Exception as e:  # pragma: no cover - only for foreign config objects
            raise TypeError(f"optimizer config must be a mapping or an OmegaConf node, got {type(cfg).__name__}") from e
    elif type(cfg).__module__.startswith("omegaconf"):
        from omegaconf import OmegaConf
        cfg = OmegaConf.to_container(cfg, resolve=True)
    cfg = dict(cfg)
    name = cfg.pop("name", None)
    unknown = sorted(set(cfg) - set(keys))
    if unknown:
        raise ValueError(f"optimizer.{unknown[0]} is not a key of optimizer {name!r}; valid keys: "
                         f"{', '.join(sorted(keys))}")
    return {k: check(k, cfg[k]) if k in cfg else (check(k, default) if default is not None else None)
            for k, (check, default) in keys.items()}


# ---- builders ---------------------------------------------------------------------------------------------------
def _describe(name: str, routing: Routing, detail: str) -> str:
    return f"{name}: {detail}\n{format_routing_table(routing)}"


def build_adamw(model: nn.Module, cfg: Mapping) -> MatrixOptimizer:
    """AdamW on every parameter (the baseline)."""
    c = resolve_config(cfg, COMMON_KEYS)
    routing = route_parameters(model, matrix_update=False)
    groups = [{"params": [p for _, p in routing.adamw], "kind": "adamw"}]
    opt = MatrixOptimizer(groups, lr=c["lr"], weight_decay=c["weight_decay"], betas=c["betas"], eps=c["eps"],
                          adamw_impl=c["adamw_impl"])
    opt.routing_table = _describe("adamw", routing, f"AdamW on every parameter, lr {c['lr']:g}, "
                                                    f"weight_decay {c['weight_decay']:g}, betas {c['betas']}")
    return opt


def build_matrix(model: nn.Module, cfg: Mapping, *, name: str, direction: str, between: str | None = None,
                 extra_keys: dict | None = None) -> MatrixOptimizer:
    """A matrix optimizer: `direction` on hidden 2-D weights (with `between` on non-refresh steps when the config
    has K), AdamW on the rest; one optimizer, one state_dict."""
    keys = {**COMMON_KEYS, **MATRIX_KEYS, **(extra_keys or {})}
    c = resolve_config(cfg, keys)
    routing = route_parameters(model, c["matrix_patterns"], c["adamw_patterns"])
    lr, wd = c["lr"], c["weight_decay"]
    adamw_lr = lr if c["adamw_lr"] is None else c["adamw_lr"]
    adamw_wd = wd if c["adamw_weight_decay"] is None else c["adamw_weight_decay"]
    groups = []
    if routing.matrix:
        groups.append({"params": [p for _, p in routing.matrix], "kind": "matrix"})
    if routing.adamw:
        groups.append({"params": [p for _, p in routing.adamw], "kind": "adamw", "lr": adamw_lr,
                       "weight_decay": adamw_wd})
    K = c.get("K") or 1
    kwargs = {k: c[k] for k in ("ns_steps", "ns_dtype", "ns_gram", "mud_passes", "mud_solve") if k in c}
    # FSDP2 shards (DTensor parameters) take the sharded implementation, with its placement keys
    sharded = any(hasattr(p, "to_local") for _, p in routing.matrix)
    cls = ShardedMatrixOptimizer if sharded else MatrixOptimizer
    if sharded:
        kwargs.update({k: c[k] for k in DIST_KEYS if k in c})
    opt = cls(
        groups, lr=lr, weight_decay=wd, momentum=c["momentum"], nesterov=c["nesterov"], scale=c["scale"],
        direction=direction, refresh_every=K, between=between, direction_eps=c["direction_eps"],
        betas=c["betas"], eps=c["eps"], adamw_impl=c["adamw_impl"], **kwargs,
    )
    sched = f"{direction} when step % {K} == 0, {between} otherwise" if between else f"{direction} every step"
    dtype = f", NS5 in {c['ns_dtype']}" if "ns_dtype" in c else ""
    where = f"; {opt.describe_placement()}" if sharded else ""
    opt.routing_table = _describe(
        name, routing,
        f"matrix direction {sched}{dtype}; momentum {c['momentum']:g} (nesterov {c['nesterov']}), scale "
        f"{c['scale']}; lr {lr:g}, weight_decay {wd:g}; AdamW lr {adamw_lr:g}, weight_decay {adamw_wd:g}, "
        f"betas {c['betas']}{where}")
    return opt


def build_muon(model, cfg):
    return build_matrix(model, cfg, name="muon", direction="spectral", extra_keys={**NS_KEYS, **DIST_KEYS})


def build_periodic_rowwise(model, cfg):
    return build_matrix(model, cfg, name="periodic_rowwise", direction="spectral", between="rownorm",
                        extra_keys={**NS_KEYS, **PERIODIC_KEYS, **DIST_KEYS})


def build_rownorm(model, cfg):
    return build_matrix(model, cfg, name="rownorm", direction="rownorm")


def build_mud(model, cfg):
    return build_matrix(model, cfg, name="mud", direction="mud", extra_keys={**MUD_KEYS, **MUD_DIST_KEYS})


OPTIMIZERS: dict[str, Builder] = {
    "adamw": build_adamw,
    "muon": build_muon,
    "periodic_rowwise": build_periodic_rowwise,
    "rownorm": build_rownorm,
    "mud": build_mud,
}


def build_optimizer(model: nn.Module, cfg: Mapping | Any) -> torch.optim.Optimizer:
    """Build the optimizer named by cfg['name'] (the resolved Hydra `optimizer` node, or a dict) for `model`.
    The result has `.routing_table` (printed at start) and `.step_info()` (scalars for the last step)."""
    name = cfg.get("name") if hasattr(cfg, "get") else None
    if name not in OPTIMIZERS:
        raise ValueError(f"optimizer.name={name!r} is not registered; registered optimizers: "
                         f"{', '.join(sorted(OPTIMIZERS))}")
    opt = OPTIMIZERS[name](model, cfg)
    if not isinstance(getattr(opt, "routing_table", None), str):
        opt.routing_table = f"{name}: {type(opt).__name__} over all {sum(len(g['params']) for g in opt.param_groups)} tensors"
    if not callable(getattr(opt, "step_info", None)):
        opt.step_info = dict
    return opt
