"""Reading a JSON file that a user may have edited or a crash may have torn (train_state.json, summary.json,
wandb_run.json, fd_results.json, ...): its value, or one line that names the file and says what is wrong with it,
instead of a traceback from the JSON parser that names neither."""

from __future__ import annotations

import json
import os


class DamagedJSONFile(ValueError):
    """A JSON file that cannot be read as expected; the message names it, says what is wrong and what to do."""


def read_json(path: str, keys: tuple[str, ...] = (), fix: str = ""):
    """The value in `path`; with `keys`, a JSON object that must hold each of them. A missing file raises
    FileNotFoundError as open() does (callers decide what a missing file means); `fix` ends the message."""
    after = f"; {fix}" if fix else ""
    if os.path.exists(path) and not os.path.isfile(path):  # a FIFO hung the reader forever
        raise DamagedJSONFile(f"{path} is not a regular file (a FIFO, socket, device or folder){after}")
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except json.JSONDecodeError as e:
        raise DamagedJSONFile(f"{path} is not valid JSON ({e.msg}: line {e.lineno} column {e.colno}): the file "
                              f"is damaged (cut short by a crash or edited){after}") from None
    except UnicodeDecodeError:
        raise DamagedJSONFile(f"{path} is not valid JSON (it is not UTF-8 text): the file is damaged{after}") \
            from None
    if keys and not isinstance(value, dict):
        raise DamagedJSONFile(f"{path} holds a JSON {type(value).__name__}, not the object with "
                              f"{', '.join(keys)} it should hold: the file is damaged{after}")
    missing = [k for k in keys if k not in value]
    if missing:
        raise DamagedJSONFile(f"{path} has no {', '.join(map(repr, missing))} (it should hold "
                              f"{', '.join(keys)}): the file is damaged or was not written by dit_train{after}")
    return value
