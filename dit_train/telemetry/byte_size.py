"""Byte counts as a person reads them: in the largest decimal unit that keeps the number at least 1, so that a
small model's checkpoint or traffic does not read 0.00 GB and a large one's is not a row of digits."""

from __future__ import annotations

UNITS = (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3))


def byte_unit(nbytes: float) -> tuple[str, float]:
    """The unit to show `nbytes` in and its size in bytes: ('MB', 1e6) for 3.2e6; ('B', 1) under a kilobyte."""
    for name, size in UNITS:
        if nbytes >= size:
            return name, size
    return "B", 1.0


def format_bytes(nbytes: float) -> str:
    """'3.20 MB', '1.28 GB', '512 B'."""
    name, size = byte_unit(nbytes)
    return f"{nbytes:.0f} B" if name == "B" else f"{nbytes / size:.2f} {name}"
