"""Seeded initial weights that every rank can compute for its own shards alone, equal for any number of ranks.

A parameter's initial value is defined by the run seed, its name and its shape, never by the order in which
parameters are drawn or by who draws them: its rows are cut into blocks of about BLOCK_ELEMENTS values, and block
k is drawn on the CPU from its own generator, seeded by the `model_init` stream with the index "name/k". A rank
draws only the blocks that overlap the rows of its FSDP2 shard (dim 0) and copies the overlap in, so it never
holds more than one block beyond its shard, and the ranks together draw the model about once. A single process
owns every row and runs the same code. The draws are on the CPU so that the weights do not depend on the device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from dit_train import seeds

# ~256 KiB of fp32 per draw: small enough that the partly-used blocks at shard edges cost little, large enough that
# seeding a generator per block is noise (~2 us against ~0.3 ms of drawing)
BLOCK_ELEMENTS = 1 << 16

KINDS = ("zeros", "ones", "uniform", "normal")


@dataclass(frozen=True)
class Rule:
    """How one parameter starts: zeros, ones, uniform(-scale, scale) or normal(0, scale)."""
    kind: str
    scale: float = 0.0

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"init rule kind {self.kind!r} is not one of {', '.join(KINDS)}")

    @property
    def random(self) -> bool:
        return self.kind in ("uniform", "normal")


ZEROS, ONES = Rule("zeros"), Rule("ones")


def xavier_uniform(shape) -> Rule:
    """nn.init.xavier_uniform_'s distribution for a Linear weight [fan_out, fan_in]."""
    fan_out, fan_in = shape[0], math.prod(shape[1:])
    return Rule("uniform", math.sqrt(6.0 / (fan_in + fan_out)))


def rows_per_block(shape) -> int:
    row = math.prod(shape[1:]) if len(shape) > 1 else 1
    return max(1, BLOCK_ELEMENTS // row)


def draw_block(rule: Rule, shape, seed: int, name: str, k: int) -> torch.Tensor:
    """Rows [k * B, (k + 1) * B) of parameter `name`'s initial value (B = rows_per_block), fp32 on the CPU."""
    n_rows, per = shape[0], rows_per_block(shape)
    rows = min(per, n_rows - k * per)
    out = torch.empty((rows, *shape[1:]), dtype=torch.float32)
    g = seeds.generator("model_init", seed, f"{name}/{k}")
    if rule.kind == "uniform":
        return out.uniform_(-rule.scale, rule.scale, generator=g)
    return out.normal_(0.0, rule.scale, generator=g)


def owned_rows(param: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(the tensor this rank writes, the global row where it starts): an FSDP2 parameter's local shard of dim 0
    (under HSDP, (Replicate(), Shard(0)): every replica computes the same rows), or a plain parameter whole."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(param, DTensor):
        return param, 0
    shards = [p for p in param.placements if isinstance(p, Shard)]
    if len(shards) > 1 or any(p.dim != 0 for p in shards) or \
            any(not isinstance(p, (Shard, Replicate)) for p in param.placements):
        raise ValueError(f"initialising a DTensor placed {param.placements}; only FSDP2's Shard(0) (with HSDP's "
                         f"Replicate() before it) is supported")
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return param.to_local(), offset[0]


@torch.no_grad()
def fill(param: torch.Tensor, rule: Rule, seed: int, name: str) -> None:
    """Write this rank's rows of parameter `name`'s initial value."""
    mine, start = owned_rows(param)
    if not rule.random:
        mine.fill_(0.0 if rule.kind == "zeros" else 1.0)
        return
    if mine.numel() == 0:  # more ranks than rows: this rank owns none
        return
    shape = tuple(param.shape)
    if len(shape) == 0:
        raise ValueError(f"parameter {name!r} is a scalar; random init rules need at least one dimension")
    per, end = rows_per_block(shape), start + mine.shape[0]
    host = torch.empty(mine.shape, dtype=torch.float32)
    for k in range(start // per, (end - 1) // per + 1):
        block = draw_block(rule, shape, seed, name, k)
        lo, hi = max(start, k * per), min(end, (k + 1) * per)
        host[lo - start:hi - start] = block[lo - k * per:hi - k * per]
    mine.copy_(host)


@torch.no_grad()
def init_parameters(model: nn.Module, rules: dict[str, Rule], seed: int) -> None:
    """Every parameter of `model` (plain or FSDP2-sharded) from its rule; a parameter without a rule is an error,
    so a new layer cannot silently start from uninitialised memory."""
    names = [name for name, _ in model.named_parameters()]
    missing = sorted(set(names) - set(rules))
    if missing:
        raise KeyError(f"no init rule for parameter(s) {', '.join(missing)}; add them to the model's init_rules()")
    for name, param in model.named_parameters():
        fill(param, rules[name], seed, name)
