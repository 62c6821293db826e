"""Reading a JSON or YAML file that a user may have edited, received or a crash may have torn (train_state.json,
summary.json, fd_results.json, a VAE's or an export's config.json, a run's config.yaml, study records, ...): its
value, or one line that names the file and says what is wrong with it, instead of a traceback from the parser that
names neither. A file larger than any such file dit_train writes is refused before it is read (a config.json from
elsewhere could be gigabytes that the parser would hold in memory whole)."""

from __future__ import annotations

import json
import os

MAX_BYTES = 16 << 20  # the largest records here (fd_results.json of a big sweep, study.json) are well under 1 MiB


class DamagedJSONFile(ValueError):
    """A JSON file that cannot be read as expected; the message names it, says what is wrong and what to do."""


def check_plain_small_file(path: str, fix: str = "") -> None:
    """DamagedJSONFile unless `path` (if it exists) is a regular file of at most MAX_BYTES: a FIFO would hang the
    reader forever, a huge file fill the memory. A missing file is left to the reader (FileNotFoundError)."""
    after = f"; {fix}" if fix else ""
    if os.path.exists(path) and not os.path.isfile(path):
        raise DamagedJSONFile(f"{path} is not a regular file (a FIFO, socket, device or folder){after}")
    size = os.path.getsize(path) if os.path.isfile(path) else 0
    if size > MAX_BYTES:
        raise DamagedJSONFile(f"{path} is {size:,} bytes, more than the {MAX_BYTES:,}-byte limit of a config or "
                              f"record file: not read{after}")


def refuse_unless_regular(path: str, reader: str = "published") -> None:
    """ConfigError (one line) when a run record at `path` is a symbolic link or not a regular file: a sweep from
    elsewhere is read and published only from regular files of its own. A link copied or read the file it points at
    (`metrics.jsonl -> ~/.ssh/id_rsa`) into the published folder or the report, and a FIFO hung the reader. A
    missing file is left to the caller. `reader` says what is done with the record ("published", "read")."""
    from dit_train.config.errors import ConfigError

    if os.path.islink(path):
        raise ConfigError(f"{path} is a symbolic link (to {os.readlink(path)}): a run record is {reader} only as a "
                          f"regular file of the sweep (a link would bring in a file from elsewhere); replace it by "
                          f"the file itself or remove it")
    if os.path.exists(path) and not os.path.isfile(path):
        raise ConfigError(f"{path} is not a regular file (a FIFO, socket, device or folder): a run record is "
                          f"{reader} only as a regular file of the sweep; remove it")


def read_json(path: str, keys: tuple[str, ...] = (), fix: str = ""):
    """The value in `path`; with `keys`, a JSON object that must hold each of them. A missing file raises
    FileNotFoundError as open() does (callers decide what a missing file means); `fix` ends the message."""
    after = f"; {fix}" if fix else ""
    check_plain_small_file(path, fix)
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except json.JSONDecodeError as e:
        raise DamagedJSONFile(f"{path} is not valid JSON ({e.msg}: line {e.lineno} column {e.colno}): the file "
                              f"is damaged (cut short by a crash or edited){after}") from None
    except UnicodeDecodeError:
        raise DamagedJSONFile(f"{path} is not valid JSON (it is not UTF-8 text): the file is damaged{after}") \
            from None
    except (ValueError, RecursionError) as e:  # an integer of > 4300 digits; arrays nested 10^5 deep
        raise DamagedJSONFile(f"{path} is not JSON dit_train reads ({beyond_parser(e)}): the file is damaged or "
                              f"crafted{after}") from None
    if keys and not isinstance(value, dict):
        raise DamagedJSONFile(f"{path} holds a JSON {type(value).__name__}, not the object with "
                              f"{', '.join(keys)} it should hold: the file is damaged{after}")
    missing = [k for k in keys if k not in value]
    if missing:
        raise DamagedJSONFile(f"{path} has no {', '.join(map(repr, missing))} (it should hold "
                              f"{', '.join(keys)}): the file is damaged or was not written by dit_train{after}")
    return value


def read_yaml(path: str, fix: str = ""):
    """The value in the YAML file `path` (a run's config.yaml), bounded and refused in one line as read_json."""
    import yaml

    check_plain_small_file(path, fix)
    after = f"; {fix}" if fix else ""
    try:
        with open(path, encoding="utf-8") as f:
            return yaml.load(f, Loader=no_alias_loader())
    except AliasInRecord:
        raise DamagedJSONFile(f"{path} uses a YAML anchor or alias (& or *), which no config or record dit_train "
                              f"writes has (an alias bomb of 3 KB expands to gigabytes): not read; write the values "
                              f"out in full{after}") from None
    except yaml.YAMLError as e:
        raise DamagedJSONFile(f"{path} is not valid YAML ({str(e).splitlines()[0]}): the file is damaged{after}") \
            from None
    except UnicodeDecodeError:
        raise DamagedJSONFile(f"{path} is not valid YAML (it is not UTF-8 text): the file is damaged{after}") from None
    except (ValueError, RecursionError) as e:
        raise DamagedJSONFile(f"{path} is not YAML dit_train reads ({beyond_parser(e)}): the file is damaged or "
                              f"crafted{after}") from None


class AliasInRecord(Exception):
    """A YAML anchor or alias in a record: refused before any node is built from it."""


_NO_ALIAS_LOADER = None


def no_alias_loader():
    """yaml.SafeLoader refusing anchors and aliases: safe_load expands `*a` by reference, so nine nested lists of
    nine aliases (2.8 KB) build 9^9 nodes once anything walks them. dit_train writes configs with yaml.safe_dump of
    plain dicts, which has none."""
    global _NO_ALIAS_LOADER
    if _NO_ALIAS_LOADER is None:
        import yaml

        class NoAliasLoader(yaml.SafeLoader):
            def compose_node(self, parent, index):
                event = self.peek_event()
                if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
                    raise AliasInRecord()
                return super().compose_node(parent, index)

        _NO_ALIAS_LOADER = NoAliasLoader
    return _NO_ALIAS_LOADER


def beyond_parser(e: Exception) -> str:
    """What a parser's limit says, in a few words: Python's integer-digit limit (a ValueError) or its recursion
    limit (a RecursionError, which every `except ValueError` let through as a traceback)."""
    if isinstance(e, RecursionError):
        return "nested deeper than the parser's recursion limit"
    return str(e).split(":")[0].split(";")[0]
