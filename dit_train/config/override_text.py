"""Writing a value into a Hydra override, and reading one back: a path Hydra itself made can hold `=` and `,`
(a sweep's folder named by its overrides: `lr=0.004,seed=43`), a user's can hold spaces, quotes or `[`. Written
unquoted into `run_dir=...`, such a value is a syntax error or a sweep to Hydra's parser; every override the
program composes, and every command it prints for a user to rerun, goes through here."""

from __future__ import annotations

import re
import shlex

_DOUBLE_QUOTE_SAFE = re.compile(r'[^$`!\n]*')  # between double quotes a shell leaves all else alone (\\ and \" escaped)
_SPECIAL = re.compile(r"([\\()\[\]{}:=, \t])")  # what Hydra's grammar lets a backslash escape in an unquoted value


def override_value(value: str) -> str:
    """The text that Hydra's override parser reads back as the string `value`: as it is where that already holds,
    else with Hydra's backslash escapes, else single-quoted. ValueError if none does (none is known)."""
    for text in _forms(value):
        if _reads_back(text, value):
            return text
    raise ValueError(f"{value!r} cannot be written as a Hydra override value")


def override_list(key: str, values) -> str:
    """`key=[v1,v2,...]` that Hydra reads back as exactly the list of strings `values` (a trailing backslash that is
    harmless at the top level would escape the `,` or `]` in a list: each item is checked in a list)."""
    items = []
    for value in map(str, values):
        text = next((t for t in _forms(value) if _reads_back(f"[{t}]", [value])), None)
        if text is None:
            raise ValueError(f"{value!r} cannot be written as an item of a Hydra override list")
        items.append(text)
    if not _reads_back(f"[{','.join(items)}]", list(map(str, values))):
        raise ValueError(f"{list(values)!r} cannot be written as a Hydra override list")
    return f"{key}=[{','.join(items)}]"


def override(key: str, value: str) -> str:
    """`key=value` as one override that Hydra reads back with exactly `value`."""
    return f"{key}={override_value(str(value))}"


def shell_override(key: str, value: str) -> str:
    """`key=value` as a user types it into a shell: the override, shell-quoted where it must be (one holding a
    quote in double quotes where no `$`, backquote or `!` is: `"run_dir='/a/it\\\\'s'"` reads better than shlex's
    `'"'"'`)."""
    return shell_word(override(key, value))


def shell_word(text: str) -> str:
    """`text` as one word of a shell command, by shell_override's rule: as it is, or in plain single quotes, or (one
    holding a quote, with no `$`, backquote or `!`) in double quotes."""
    if "'" not in text or not _DOUBLE_QUOTE_SAFE.fullmatch(text):  # shlex: as it is, or in plain single quotes
        return shlex.quote(text)
    return '"' + re.sub(r'(["\\])', r"\\\1", text) + '"'


def shell_command(words) -> str:
    """A command (program, flags, paths, overrides already written by override()) as a user pastes it: the shell
    hands the program exactly `words`, whatever a path holds (spaces, quotes, `=`, `,`, non-ASCII)."""
    return " ".join(shell_word(str(w)) for w in words)


def parsed_value(arg: str):
    """The value Hydra reads from one `key=value` argument (quotes and escapes removed); the text after `=` where
    the parser refuses it (Hydra then says why, in its own words)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        return OverridesParser.create().parse_override(arg).value()
    except Exception:  # noqa: BLE001 - a syntax error is Hydra's to report, with its own message
        return arg.split("=", 1)[1]


def _forms(value: str) -> tuple[str, str, str]:
    # as it is, with Hydra's backslash escapes, single-quoted: the first that reads back is written
    return value, _SPECIAL.sub(r"\\\1", value), _quoted(value)


def _quoted(value: str) -> str:
    # in a quoted value a backslash is literal, except a run of them before a quote (or the closing one): doubled
    body = re.sub(r"(\\+)(?='|$)", lambda m: m.group(1) * 2, value)
    return "'" + body.replace("'", "\\'") + "'"


def _reads_back(text: str, value: str | list[str]) -> bool:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_override(f"k={text}")
    except Exception:  # noqa: BLE001 - not this form
        return False
    read = parsed.value()
    return (not parsed.is_sweep_override() and read == value
            and all(isinstance(v, str) for v in (read if isinstance(value, list) else [read])))
