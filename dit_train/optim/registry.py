"""Building the optimizer a config names: `optimizer=<name>` on the command line -> its entry in OPTIMIZERS
(optim/catalog.py, one line per optimizer: its Config and builder; torch-free, so the command line is checked
before torch loads) -> build_optimizer, with the builders and the shipped directions' classes here.

    build_optimizer(model, cfg) -> optimizer with `.routing_table: str` (the summary printed at start) and
    `.routing` (a Routing: `.routing.table()` lists every parameter, its shape, its group and why)
    config_class(name) -> that optimizer's Config dataclass (keys, defaults, types, rules, docs)

Adding a matrix optimizer with a new direction: a Direction subclass with its Config (docs/extending.md) and
`OPTIMIZERS["<name>"] = matrix("<name>", <Direction>)`; the command line knows it from that line.
Any torch.optim.Optimizer can be registered with Entry(<Config>, <builder(model, values)>). Nothing in the
training loop changes.

The config is checked by dit_train.config.check_optimizer (the validator `python -m dit_train` uses): an unknown
key, or a value out of range, is a one-line ConfigError naming the key, the value seen and what is valid; missing
keys take the Config's defaults. Builders receive that checked plain dict.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn

from dit_train.config import check_optimizer
# the catalog's names, here too: a command of your own adds its entry to OPTIMIZERS (docs/extending.md)
from dit_train.optim.catalog import OPTIMIZERS, Entry, config_class, matrix, placement_keys  # noqa: F401
from dit_train.optim.directions import MUD, NS5, Direction, RowNorm
from dit_train.optim.matrix_optimizer import MatrixOptimizer
from dit_train.optim.routing import Routing, format_routing_table, route_parameters
from dit_train.optim.sharded_optimizer import ShardedMatrixOptimizer


# the shipped directions by their names, as optim/catalog.py names them
DIRECTIONS: dict[str, type[Direction]] = {d.name: d for d in (NS5, RowNorm, MUD)}


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


def build_matrix(model: nn.Module, c: dict, *, name: str, direction: Direction,
                 between: Direction | None = None) -> MatrixOptimizer:
    """A matrix optimizer: `direction` on hidden 2-D weights (with `between` on non-refresh steps, every c["K"]
    steps), AdamW on the rest; one optimizer, one state_dict. `c`: checked values (check_optimizer)."""
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
    K = c["K"] if between is not None else 1
    # FSDP2 shards (DTensor parameters) take the sharded implementation, with its placement keys
    sharded = any(hasattr(p, "to_local") for _, p in routing.matrix)
    cls = ShardedMatrixOptimizer if sharded else MatrixOptimizer
    kwargs = {k: c[k] for k in placement_keys(config_class(name))} if sharded else {}
    opt = cls(
        groups, lr=lr, weight_decay=wd, momentum=c["momentum"], nesterov=c["nesterov"], scale=c["scale"],
        direction=direction, refresh_every=K, between=between, direction_eps=c["direction_eps"],
        betas=tuple(c["betas"]), eps=c["eps"], adamw_impl=c["adamw_impl"], **kwargs,
    )
    sched = (f"{direction.name} when step % {K} == 0, {between.name} otherwise" if between
             else f"{direction.name} every step")
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


def direction_class(direction: str | type[Direction]) -> type[Direction]:
    """A shipped direction's class by its name (catalog lines name them), or a Direction class as given."""
    return DIRECTIONS[direction] if isinstance(direction, str) else direction


def build_optimizer(model: nn.Module, cfg: Mapping | Any) -> torch.optim.Optimizer:
    """Build the optimizer named by cfg['name'] (the resolved Hydra `optimizer` node, or a dict) for `model`.
    The result has `.routing_table` (printed at start); its trainer hooks are optim.hooks.hooks_of(result)."""
    values = check_optimizer(cfg)
    name = values["name"]
    opt = OPTIMIZERS[name].build(model, values)
    if not isinstance(getattr(opt, "routing_table", None), str):
        opt.routing_table = f"{name}: {type(opt).__name__} over all {sum(len(g['params']) for g in opt.param_groups)} tensors"
    return opt
