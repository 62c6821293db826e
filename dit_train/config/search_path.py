"""The config folders Hydra searches for a command line, in its order (hydra/_internal/utils.py and
config_loader_impl.py): ours (dit_train/conf), or the user's `--config-path` in its place, the user's --config-dir,
then the entries of hydra.searchpath: the command line's `hydra.searchpath=[...]`, else the primary config's
`hydra: searchpath:` (ours has none; a user's `--config-name mine` may). The check before Hydra (command_line.py)
lists group options in the same folders and composes with them, so that it accepts and refuses what Hydra will."""

from __future__ import annotations

import importlib.util
import os

from omegaconf import OmegaConf

from dit_train.config.errors import ConfigError
from dit_train.config.files import CONF_DIR
from dit_train.config.override_text import override_list
from dit_train.runs.json_file import DamagedJSONFile, check_plain_small_file

KEY = "hydra.searchpath"
CONFIG_NAME_FLAGS = ("--config-name", "-cn")
CONFIG_PATH_FLAGS = ("--config-path", "-cp")
# Hydra reads a relative --config-path from the folder of the file declaring @hydra.main (dit_train/__main__.py)
MAIN_DIR = os.path.dirname(CONF_DIR)


def is_searchpath(override: str) -> bool:
    return override.split("=", 1)[0] == KEY


def flag_value(argv: list[str], flags: tuple[str, ...]) -> str | None:
    """The value of Hydra's flag (`--flag VALUE` or `--flag=VALUE`; the last one counts), None without it."""
    found = None
    for i, arg in enumerate(argv):
        flag, eq, value = arg.partition("=")
        if flag in flags:
            found = value if eq else (argv[i + 1] if i + 1 < len(argv) else found)
    return found


def config_name(argv: list[str]) -> str:
    """The primary config's name: Hydra's `--config-name NAME` (`-cn NAME`, `--config-name=NAME`), else ours."""
    return flag_value(argv, CONFIG_NAME_FLAGS) or "config"


def primary_folder(argv: list[str]) -> str:
    """The folder Hydra takes the primary config from: Hydra's `--config-path DIR` (`-cp`) in place of ours. One
    line if it is no folder: Hydra's own message does not say that a relative path is read from dit_train's package
    folder, not the working directory."""
    given = flag_value(argv, CONFIG_PATH_FLAGS)
    if given is None:
        return CONF_DIR
    folder = entry_folder(given) if given.startswith("pkg://") else os.path.join(MAIN_DIR, given)
    if folder is None or not os.path.isdir(folder):
        hint = ("; a relative --config-path is read from the dit_train package folder, not the working directory: "
                f"give an absolute path (--config-path {os.path.abspath(given)})") \
            if "://" not in given and not os.path.isabs(given) else ""
        raise ConfigError(f"--config-path {given}: no such folder ({folder or given}){hint}")
    return folder


def searchpath_entries(overrides: list[str], config_dir: str | None, primary: str = "config",
                       primary_dir: str = CONF_DIR) -> list[str]:
    """hydra.searchpath as Hydra reads it: the first such override of the command line, else the primary config's
    (found in the primary folder, ours or the user's --config-path, then in the user's --config-dir)."""
    given = next((o for o in overrides if is_searchpath(o)), None)
    if given is not None:
        from hydra.core.override_parser.overrides_parser import OverridesParser

        try:
            entries = OverridesParser.create().parse_overrides([given])[0].value()
        except Exception as e:  # noqa: BLE001 - a syntax error: Hydra's first line
            raise ConfigError(f"{given}: {str(e).strip().splitlines()[0]}") from None
    else:
        files = [os.path.join(d, f"{primary}.yaml") for d in (primary_dir, config_dir) if d]
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


def user_folders(config_dir: str | None, entries: list[str], primary_dir: str = CONF_DIR) -> list[str]:
    """The user's config folders, after ours, in Hydra's order (their --config-path first, in place of ours)."""
    folders = ([primary_dir] if primary_dir != CONF_DIR else []) + ([config_dir] if config_dir else [])
    return folders + [f for f in map(entry_folder, entries) if f is not None]


def searchpath_override(config_dir: str | None, entries: list[str]) -> list[str]:
    """The one hydra.searchpath override that composes like Hydra's app: --config-dir first, then the entries (an
    override also stands for the primary config's, which it replaces, and survives into a resume's compositions)."""
    paths = (["file://" + os.path.abspath(config_dir)] if config_dir else []) + entries
    return [override_list(KEY, paths)] if paths else []  # a folder of any name (json.dumps doubled a backslash)
