"""Validate `group=option` overrides against the config folders before Hydra composes anything, so an unknown
option is one line listing the valid ones (Hydra's own message spans several lines and a stack hint)."""

from __future__ import annotations

import os
import sys

CONF_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "conf")


def group_options(group: str) -> list[str]:
    folder = os.path.join(CONF_DIR, group)
    return sorted(f[:-5] for f in os.listdir(folder) if f.endswith(".yaml"))


def check_group_overrides(argv: list[str]) -> None:
    for arg in argv:
        if arg.startswith("-") or "=" not in arg:
            continue
        key, value = arg.split("=", 1)
        key = key.lstrip("+~")
        if "." in key or "/" in key or not os.path.isdir(os.path.join(CONF_DIR, key)):
            continue
        valid = group_options(key)
        for option in value.split(","):  # --multirun lists
            if option not in valid:
                print(f"error: {key}={option!r} is not a known {key}; valid: {', '.join(valid)}", file=sys.stderr)
                sys.exit(2)
