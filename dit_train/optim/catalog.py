"""The optimizers by name, one line each in OPTIMIZERS: `optimizer=<name>` on the command line -> its Config (the
keys it takes, composed from optim/optimizer_config.py) and its builder (optim/registry.py builds it).

No torch here: the config layer (dit_train/config/optimizers.py, store.py) reads this catalog, so a bad value is
refused, and --help and tab completion answer, before torch is imported. A shipped direction is therefore named
by its `name` ("spectral", "rownorm", "mud": registry.DIRECTIONS holds the classes); a direction of your own is
passed as its class (docs/extending.md).

    matrix(name, direction, between=None) -> Entry: direction every step, or with `between` a periodic schedule
    config_class(name) -> that optimizer's Config dataclass (keys, defaults, types, rules, docs)
"""

from __future__ import annotations

from dataclasses import dataclass, fields, make_dataclass
from typing import Callable

from dit_train.config.fields import key
from dit_train.optim.optimizer_config import AdamWConfig, MatrixConfig, MudConfig, NS5Config, PeriodicConfig, RowNormConfig

# the shipped directions' Configs by their names (registry.DIRECTIONS: their classes, each naming the same Config)
DIRECTION_CONFIGS = {"spectral": NS5Config, "rownorm": RowNormConfig, "mud": MudConfig}


@dataclass(frozen=True)
class Entry:
    """A registered optimizer: the dataclass of its config keys and its builder (model, checked values) ->
    torch.optim.Optimizer."""
    config: type
    build: Callable


def direction_config(direction) -> type:
    """The Config of a direction: a shipped one's by name, or a Direction class's own."""
    return DIRECTION_CONFIGS[direction] if isinstance(direction, str) else direction.Config


def matrix(name: str, direction, between=None) -> Entry:
    """The entry of a matrix optimizer: `direction` every step, or with `between` a periodic schedule (key K).
    Each direction: a shipped one's name or a Direction class. Its Config is MatrixConfig plus the directions'
    Configs (and PeriodicConfig)."""
    parts = [direction_config(direction)] + ([direction_config(between), PeriodicConfig] if between else [])
    bases = tuple(dict.fromkeys(reversed(parts))) + (MatrixConfig,)  # a direction used twice adds its keys once
    config = make_dataclass(f"{name.title().replace('_', '')}Config",
                            [("name", str, key(default=name, doc="the optimizer"))], bases=bases, kw_only=True)

    def build(model, c: dict):
        from dit_train.optim.registry import build_matrix, direction_class

        return build_matrix(model, c, name=name, direction=direction_class(direction).from_config(c),
                            between=None if between is None else direction_class(between).from_config(c))

    return Entry(config, build)


def _build_adamw(model, c: dict):
    from dit_train.optim.registry import build_adamw

    return build_adamw(model, c)


OPTIMIZERS: dict[str, Entry] = {
    "adamw": Entry(AdamWConfig, _build_adamw),
    "muon": matrix("muon", "spectral"),
    "periodic_rowwise": matrix("periodic_rowwise", "spectral", between="rownorm"),
    "rownorm": matrix("rownorm", "rownorm"),
    "mud": matrix("mud", "mud"),
}


def placement_keys(config: type) -> tuple[str, ...]:
    """The keys of an optimizer Config declared with placement=True: the sharded implementation's keywords (a
    single process ignores them)."""
    return tuple(f.name for f in fields(config) if f.metadata.get("placement"))


def config_class(name: str) -> type:
    """The Config dataclass of the registered optimizer `name` (KeyError for an unknown one)."""
    return OPTIMIZERS[name].config
