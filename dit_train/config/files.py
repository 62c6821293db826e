"""The yamls under dit_train/conf: which options a group offers, and one option's values with its in-group
`defaults:` (e.g. conf/optimizer/muon.yaml on top of conf/_optimizer_matrix_base.yaml on top of
conf/_optimizer_base.yaml). Library calls with a
partial config take their missing values from here, so the yamls are the one place defaults live."""

from __future__ import annotations

import os
from functools import lru_cache

from omegaconf import DictConfig, OmegaConf

CONF_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf")


def group_options(group: str) -> list[str]:
    """The options of a config group: every yaml in its folder (shared keys live outside the group folders, so
    that neither `--help` nor tab completion offers them)."""
    folder = os.path.join(CONF_DIR, group)
    return sorted(f[:-5] for f in os.listdir(folder) if f.endswith(".yaml"))


def is_group(name: str) -> bool:
    return os.path.isdir(os.path.join(CONF_DIR, name))


def option_files(group: str, option: str) -> list[str]:
    """The yaml files of conf/<group>/<option>.yaml in the order Hydra merges them: its `defaults:` entries (names
    within the group, or `/<shared file>@_here_` at the conf root, in this group's package) where they stand, the
    file itself at `_self_`. Entries that choose other groups (an experiment's `override /eval: ...`) are skipped."""
    # `/_optimizer_base@_here_`: a shared file at the conf root, merged into this group's package
    path = option[1:].removesuffix("@_here_") if option.startswith("/") else os.path.join(group, option)
    path = os.path.join(CONF_DIR, f"{path}.yaml")
    parents = list(OmegaConf.load(path).get("defaults") or [])
    if "_self_" not in parents:
        parents.append("_self_")
    return [f for parent in parents if isinstance(parent, str)
            for f in ([path] if parent == "_self_" else option_files(group, parent))]


@lru_cache(maxsize=None)
def _load_option(group: str, option: str) -> DictConfig:
    merged = OmegaConf.create()
    for path in option_files(group, option):
        raw = OmegaConf.load(path)
        raw.pop("defaults", None)
        merged = OmegaConf.merge(merged, raw)
    return merged


def load_option(group: str, option: str) -> DictConfig:
    """conf/<group>/<option>.yaml with its `defaults:` (names within the group, or `/<shared file>@_here_`) merged
    in, as Hydra composes it; `option` may itself be such a defaults entry. A fresh copy each call."""
    return OmegaConf.create(_load_option(group, option))


@lru_cache(maxsize=None)
def _primary() -> DictConfig:
    return OmegaConf.load(os.path.join(CONF_DIR, "config.yaml"))


def primary_node(key: str) -> dict:
    """A node of conf/config.yaml itself (e.g. 'parallel'), as a plain dict."""
    return OmegaConf.to_container(_primary()[key], resolve=False)
