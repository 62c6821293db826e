"""The config folders Hydra searches for a command line, in its order (hydra/_internal/utils.py and
config_loader_impl.py): ours (dit_train/conf), the user's --config-dir, then the entries of hydra.searchpath: the
command line's `hydra.searchpath=[...]`, else the primary config's `hydra: searchpath:` (ours has none; a user's
`--config-name mine` may). The check before Hydra (command_line.py) lists group options in the same folders and
composes with them, so that it accepts and refuses what Hydra will."""

from __future__ import annotations

import importlib.util
import json
import os

from omegaconf import OmegaConf

from dit_train.config.errors import ConfigError
from dit_train.config.files import CONF_DIR
from dit_train.runs.json_file import DamagedJSONFile, check_plain_small_file

KEY = "hydra.searchpath"
CONFIG_NAME_FLAGS = ("--config-name", "-cn")


def is_searchpath(override: str) -> bool:
    return override.split("=", 1)[0] == KEY


def config_name(argv: list[str]) -> str:
    """The primary config's name: Hydra's `--config-name NAME` (`-cn NAME`, `--config-name=NAME`), else ours."""
    name = "config"
    for i, arg in enumerate(argv):
        flag, eq, value = arg.partition("=")
        if flag in CONFIG_NAME_FLAGS:
            name = value if eq else (argv[i + 1] if i + 1 < len(argv) else name)
    return name


def searchpath_entries(overrides: list[str], config_dir: str | None, primary: str = "config") -> list[str]:
    """hydra.searchpath as Hydra reads it: the first such override of the command line, else the primary config's
    (found in our folder, then the user's)."""
    given = next((o for o in overrides if is_searchpath(o)), None)
    if given is not None:
        from hydra.core.override_parser.overrides_parser import OverridesParser

        try:
            entries = OverridesParser.create().parse_overrides([given])[0].value()
        except Exception as e:  # noqa: BLE001 - a syntax error: Hydra's first line
            raise ConfigError(f"{given}: {str(e).strip().splitlines()[0]}") from None
    else:
        files = [os.path.join(d, f"{primary}.yaml") for d in (CONF_DIR, config_dir) if d]
        file = next((f for f in files if os.path.isfile(f)), None)
        try:
            if file:
                check_plain_small_file(file)  # a user's primary config: bounded, as every config file read
        except DamagedJSONFile as e:
            raise ConfigError(str(e)) from None
        entries = OmegaConf.select(OmegaConf.load(file), KEY) if file else None
        if entries is None:
            return []
        entries = OmegaConf.to_container(entries) if OmegaConf.is_config(entries) else entries
    if not isinstance(entries, list) or not all(isinstance(e, str) for e in entries):
        raise ConfigError(f"{KEY}={entries!r} is not valid: a list of folders, e.g. "
                          f"{KEY}=[file:///home/me/conf,pkg://my_package.conf]")
    return entries


def entry_folder(entry: str) -> str | None:
    """The folder of a search path entry (`file://DIR` or a bare DIR; `pkg://module`), None if there is none."""
    scheme, sep, rest = entry.partition("://")
    if not sep:
        return entry
    if scheme == "file":
        return rest
    if scheme == "pkg":
        try:
            spec = importlib.util.find_spec(rest.replace("/", "."))
        except (ImportError, ValueError):
            return None
        return list(spec.submodule_search_locations)[0] if spec and spec.submodule_search_locations else None
    return None


def user_folders(config_dir: str | None, entries: list[str]) -> list[str]:
    """The user's config folders, after ours, in Hydra's order."""
    folders = [config_dir] if config_dir else []
    return folders + [f for f in map(entry_folder, entries) if f is not None]


def searchpath_override(config_dir: str | None, entries: list[str]) -> list[str]:
    """The one hydra.searchpath override that composes like Hydra's app: --config-dir first, then the entries (an
    override also stands for the primary config's, which it replaces, and survives into a resume's compositions)."""
    paths = (["file://" + os.path.abspath(config_dir)] if config_dir else []) + entries
    return [f"{KEY}=[{','.join(json.dumps(p, ensure_ascii=False) for p in paths)}]"] if paths else []
