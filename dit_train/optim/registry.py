"""The optimizer registry: `optimizer=<name>` on the command line -> conf/optimizer/<name>.yaml -> build_optimizer.

    OPTIMIZERS: name -> builder(model, cfg: dict) -> torch.optim.Optimizer
    build_optimizer(model, cfg) -> optimizer with `.routing_table: str` (the summary printed at start), `.routing`
    (a Routing: `.routing.table()` lists every parameter, its shape, its group and why) and `.step_info()`

Adding an optimizer: write `dit_train/optim/<name>.py` with a `build(model, values)` (usually `build_matrix(model,
values, direction=..., ...)` from here, or any torch.optim.Optimizer), add `"<name>": <name>.build` to OPTIMIZERS,
its schema to dit_train/config/optimizers.py and a conf/optimizer/<name>.yaml. Nothing in the training loop changes.

The config is checked by dit_train.config.check_optimizer (the validator `python -m dit_train` uses): an unknown
key, or a value out of range, is a one-line ConfigError naming the key, the value seen and what is valid; missing
keys take conf/optimizer/<name>.yaml's values. Builders receive that checked plain dict.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch
from torch import nn

from dit_train.config import check_optimizer
from dit_train.optim.matrix_optimizer import MatrixOptimizer
from dit_train.optim.routing import Routing, format_routing_table, route_parameters
from dit_train.optim.sharded_optimizer import ShardedMatrixOptimizer

# keys of the sharded implementation only (a single process ignores them)
PLACEMENT_KEYS = ("distributed_mode", "gather_dtype", "bucket_mb", "overlap_exchange")

Builder = Callable[[nn.Module, dict], torch.optim.Optimizer]


# ---- builders ---------------------------------------------------------------------------------------------------
def _describe(name: str, routing: Routing, detail: str) -> str:
    return f"{name}: {detail}\n{format_routing_table(routing)}"


def build_adamw(model: nn.Module, c: dict) -> MatrixOptimizer:
    """AdamW on every parameter (the baseline)."""
    routing = route_parameters(model, matrix_update=False)
    groups = [{"params": [p for _, p in routing.adamw], "kind": "adamw"}]
    opt = MatrixOptimizer(groups, lr=c["lr"], weight_decay=c["weight_decay"], betas=tuple(c["betas"]), eps=c["eps"],
                          adamw_impl=c["adamw_impl"])
    opt.routing = routing
    opt.routing_table = _describe("adamw", routing, f"AdamW on every parameter, lr {c['lr']:g}, "
                                                    f"weight_decay {c['weight_decay']:g}, betas {c['betas']}")
    return opt


def build_matrix(model: nn.Module, c: dict, *, name: str, direction: str,
                 between: str | None = None) -> MatrixOptimizer:
    """A matrix optimizer: `direction` on hidden 2-D weights (with `between` on non-refresh steps when the config
    has K), AdamW on the rest; one optimizer, one state_dict. `c`: checked values (check_optimizer)."""
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
    kwargs = {k: c[k] for k in ("ns_steps", "ns_dtype", "ns_gram", "mud_passes", "mud_solve", "rownorm_scale",
                                "compile_rownorm") if k in c}
    # FSDP2 shards (DTensor parameters) take the sharded implementation, with its placement keys
    sharded = any(hasattr(p, "to_local") for _, p in routing.matrix)
    cls = ShardedMatrixOptimizer if sharded else MatrixOptimizer
    if sharded:
        kwargs.update({k: c[k] for k in PLACEMENT_KEYS})
    opt = cls(
        groups, lr=lr, weight_decay=wd, momentum=c["momentum"], nesterov=c["nesterov"], scale=c["scale"],
        direction=direction, refresh_every=K, between=between, direction_eps=c["direction_eps"],
        betas=tuple(c["betas"]), eps=c["eps"], adamw_impl=c["adamw_impl"], **kwargs,
    )
    sched = f"{direction} when step % {K} == 0, {between} otherwise" if between else f"{direction} every step"
    dtype = f", NS5 in {c['ns_dtype']}" if "ns_dtype" in c else ""
    dtype += f", RowNorm scale {c['rownorm_scale']}" if "rownorm_scale" in c else ""
    if "compile_rownorm" in c:  # what compile_rownorm (auto by default) resolved to on these parameters
        dtype += f", RowNorm passes {'fused' if opt.compile_rownorm else 'eager'} " \
                 f"(compile_rownorm {c['compile_rownorm']})"
    where = f"; {opt.describe_placement()}" if sharded else ""
    opt.routing = routing
    opt.routing_table = _describe(
        name, routing,
        f"matrix direction {sched}{dtype}; momentum {c['momentum']:g} (nesterov {c['nesterov']}), scale "
        f"{c['scale']}; lr {lr:g}, weight_decay {wd:g}; AdamW lr {adamw_lr:g}, weight_decay {adamw_wd:g}, "
        f"betas {c['betas']}{where}")
    return opt


def build_muon(model, c):
    return build_matrix(model, c, name="muon", direction="spectral")


def build_periodic_rowwise(model, c):
    return build_matrix(model, c, name="periodic_rowwise", direction="spectral", between="rownorm")


def build_rownorm(model, c):
    return build_matrix(model, c, name="rownorm", direction="rownorm")


def build_mud(model, c):
    return build_matrix(model, c, name="mud", direction="mud")


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
    values = check_optimizer(cfg)
    name = values["name"]
    opt = OPTIMIZERS[name](model, values)
    if not isinstance(getattr(opt, "routing_table", None), str):
        opt.routing_table = f"{name}: {type(opt).__name__} over all {sum(len(g['params']) for g in opt.param_groups)} tensors"
    if not callable(getattr(opt, "step_info", None)):
        opt.step_info = dict
    return opt
