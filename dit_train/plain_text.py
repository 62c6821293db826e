"""Names from files and folders (a run's folder, its saved model.name / optimizer.name, a checkpoint path) as the
commands print and tabulate them: a name may come from a sweep made elsewhere, and holds what its maker wrote."""

from __future__ import annotations

import sys

FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")  # what a spreadsheet reads as a formula (OWASP's list)


def printable(text: str) -> str:
    """`text` with every character a terminal would act on written as its escape (\\x1b, \\r, \\n, \\u202e): an ESC
    in a run's folder name drew escape codes, a \\r or \\n in a saved optimizer.name printed fake "[fd]" lines."""
    text = str(text)
    if text.isprintable():
        return text  # the usual case, at C speed
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


def spreadsheet_cell(value):
    """A CSV cell that a spreadsheet shows as text: a string starting with = + - @ tab or CR (`=HYPERLINK(...)` in a
    run's name) gets a leading ', as OWASP advises; numbers stay numbers (a negative FD delta is not text)."""
    if isinstance(value, str) and value.startswith(FORMULA_STARTS):
        return "'" + value
    return value


def print_error(text: str) -> None:
    """A command's one-line refusal on stderr: its text may quote a name from a file (a run folder, an image, a
    saved config value), so it is printed as `printable` writes it, and stays one line. The line and its newline go
    out in one write: print() writes them apart, which unbuffered (PYTHONUNBUFFERED) are two writes, and the ranks
    of a torchrun job refusing at once merged their lines in the shared log ("...--outerror: ...")."""
    sys.stderr.write(f"error: {printable(text)}\n")
    sys.stderr.flush()
