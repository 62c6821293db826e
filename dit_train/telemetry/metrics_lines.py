"""metrics.jsonl read a line at a time with bounded memory: a run's file from elsewhere (a received sweep, a
copied run folder) may be a sparse terabyte with no newline, which `for line in f` or `f.read()` held whole in
memory. A file larger than any run writes is refused in one line before it is read; a line longer than any row the
logger writes is passed over in chunks, never held."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator

from dit_train.telemetry.byte_size import format_bytes

MAX_ROW_BYTES = 1 << 20  # a logged row is ~1-3 KB (train, val, FD and timing keys); 1 MiB is far beyond any
MAX_FILE_BYTES = 8 << 30  # ~1 KB per logged step: 8 GiB is millions of rows, beyond any run's metrics


def metrics_lines(path: str) -> Iterator[bytes]:
    """The lines of `path` (with their newline), each at most MAX_ROW_BYTES; longer ones are skipped. Raises
    ValueError in one line when `path` is not a regular file (a FIFO hung the reader) or exceeds MAX_FILE_BYTES;
    FileNotFoundError when there is none."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO swapped in after any check cannot block the open
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{path} is not a regular file (a FIFO, socket, device or folder)")
        if info.st_size > MAX_FILE_BYTES:
            raise ValueError(f"{path} is {format_bytes(info.st_size)}, more than any run writes (~1 KB per logged "
                             f"step; limit {format_bytes(MAX_FILE_BYTES)}): not read; move it out of the run folder")
        while line := f.readline(MAX_ROW_BYTES + 1):
            if len(line) <= MAX_ROW_BYTES:
                yield line
                continue
            while line and not line.endswith(b"\n"):  # the rest of the overlong line, a chunk at a time
                line = f.readline(MAX_ROW_BYTES)
