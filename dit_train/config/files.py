"""The yamls under dit_train/conf: which options a group offers, and one option's values with its in-group
`defaults:` (e.g. conf/optimizer/muon.yaml on top of _matrix_base.yaml on top of _base.yaml). Library calls with a
partial config take their missing values from here, so the yamls are the one place defaults live."""

from __future__ import annotations

import os
from functools import lru_cache

from omegaconf import DictConfig, OmegaConf

CONF_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf")


def group_options(group: str) -> list[str]:
    """The options of a config group; files starting with '_' hold shared keys and are not options."""
    folder = os.path.join(CONF_DIR, group)
    return sorted(f[:-5] for f in os.listdir(folder) if f.endswith(".yaml") and not f.startswith("_"))


def is_group(name: str) -> bool:
    return os.path.isdir(os.path.join(CONF_DIR, name))


@lru_cache(maxsize=None)
def _load_option(group: str, option: str) -> DictConfig:
    raw = OmegaConf.load(os.path.join(CONF_DIR, group, f"{option}.yaml"))
    merged = OmegaConf.create()
    parents = list(raw.pop("defaults", None) or [])
    if "_self_" not in parents:
        parents.append("_self_")
    for parent in parents:
        merged = OmegaConf.merge(merged, raw if parent == "_self_" else _load_option(group, str(parent)))
    return merged


def load_option(group: str, option: str) -> DictConfig:
    """conf/<group>/<option>.yaml with its `defaults:` (names within the group) merged in, as Hydra composes it.
    A fresh copy each call."""
    return OmegaConf.create(_load_option(group, option))


@lru_cache(maxsize=None)
def _primary() -> DictConfig:
    return OmegaConf.load(os.path.join(CONF_DIR, "config.yaml"))


def primary_node(key: str) -> dict:
    """A node of conf/config.yaml itself (e.g. 'parallel'), as a plain dict."""
    return OmegaConf.to_container(_primary()[key], resolve=False)
