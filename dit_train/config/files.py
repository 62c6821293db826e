"""The options of the config groups: schemas registered with Hydra (store.py: optimizer=<name>, data=<name>,
eval=default, logger=default) and the preset yamls under dit_train/conf (model, experiment, launcher, eval). One
option's values with its in-group `defaults:` (e.g. conf/eval/ci.yaml on top of EvalConfig's defaults), for library
calls and tools that read an option without composing a whole run config."""

from __future__ import annotations

import os

from omegaconf import DictConfig, OmegaConf

from .fields import defaults
from .store import schema_options

CONF_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf")
GROUPS = ("data", "model", "optimizer", "eval", "logger", "launcher", "experiment")


def _preset_path(group: str, option: str) -> str:
    return os.path.join(CONF_DIR, group, f"{option}.yaml")


def group_options(group: str, user_folders: tuple[str, ...] | list[str] = ()) -> list[str]:
    """The options of a config group: its schemas and its preset yamls, with those of the user's own config folders
    (Hydra's --config-dir and hydra.searchpath: search_path.py) where given."""
    folders = [os.path.join(d, group) for d in (CONF_DIR, *user_folders)]
    presets = [f[:-5] for folder in folders if os.path.isdir(folder) for f in os.listdir(folder) if f.endswith(".yaml")]
    return sorted({*schema_options(group), *presets})


def shadowed_preset(group: str, option: str, user_folders: tuple[str, ...] | list[str] = ()) -> str | None:
    """A user's `group/option.yaml` that Hydra never reads: ours is searched first and wins (a user's
    experiment/smoke.yaml ran as the shipped smoke study, silently). Its path, else None. (A user's yaml for a
    schema option, optimizer/adamw.yaml, is read: only our preset yamls shadow.)"""
    if not os.path.isfile(_preset_path(group, option)):
        return None
    return next((p for p in (os.path.join(d, group, f"{option}.yaml") for d in user_folders) if os.path.isfile(p)),
                None)


def is_group(name: str) -> bool:
    return name in GROUPS


def load_option(group: str, option: str) -> DictConfig:
    """The option's values as Hydra composes them: a schema's defaults, or conf/<group>/<option>.yaml on top of
    its in-group `defaults:` entries (entries that choose other groups, an experiment's `override /eval: ...`,
    are skipped). A fresh copy each call."""
    schema = schema_options(group).get(option)
    if schema is not None:
        return OmegaConf.create(defaults(schema))
    raw = OmegaConf.load(_preset_path(group, option))
    parents = list(raw.pop("defaults", None) or [])
    if "_self_" not in parents:
        parents.append("_self_")
    merged = OmegaConf.create()
    for parent in parents:
        if isinstance(parent, str):
            merged = OmegaConf.merge(merged, raw if parent == "_self_" else load_option(group, parent))
    return merged
