"""Content checksums of a checkpoint: a bit flipped on disk or in a copy, or a shard rewritten with other bytes of
the same size, is found before a tensor is read (truncation, missing files, links and pickled code are refused
elsewhere: checkpoint_metadata.py).

`checksums.json` in the step_N.dcp folder: {"format": 1, "algorithm": "crc32", "files": {name: [[offset, length,
crc32], ...]}}, one range per item DCP stored (a tensor chunk or a pickled value: exactly what DCP's reader reads
back as one piece) and one range [0, size, crc32] for `.metadata`. At save each rank hashes the items it wrote,
reading its shard files back after DCP's writer has written them (in the background thread of an asynchronous save);
the ranges travel to the coordinator with DCP's own write results, and it writes the record after `.metadata`,
before its save returns: the COMPLETE marker follows (checkpoint.PendingSave.finish), so a crash in between leaves an
incomplete checkpoint, never a complete one without its record. At load each rank verifies the ranges its read plan
reads (an export reading only the EMA weights hashes only them, a rank of a resumed FSDP run only its shards), before
DCP reads them. crc32 (zlib): ~3x faster than sha1, ~6x than blake2b here; it finds every single-bit flip, every
burst of up to 32 bits, every two-bit flip in a range under 512 MiB, and any other change but 1 in 2^32: it is
against accidents, not forgery.

A checkpoint written before the record existed loads as before (one info line per process)."""

from __future__ import annotations

import json
import logging
import os
import stat
import zlib

from dit_train.runs import checkpoint_metadata

log = logging.getLogger("dit_train")
RECORD = "checksums.json"
ALGORITHM = "crc32"
FORMAT = 1
CHUNK = 8 << 20  # bytes hashed at a time (zlib releases the GIL on each: training goes on beside a background save)
KEY = "__dit_train_checksums__"  # the write result that carries a rank's ranges to the coordinator


class ChecksumMismatch(ValueError):
    """A range of a checkpoint file whose bytes are not those saved; the message names the file."""


class BadRecord(ValueError):
    """A checksums.json that is not JSON or not in the record's shape."""


def crc32_range(f, offset: int, length: int) -> int:
    f.seek(offset)
    crc, left = 0, length
    while left > 0:
        block = f.read(min(CHUNK, left))
        if not block:
            break  # a file that ends early: its crc differs (a truncated file is refused as such before)
        crc = zlib.crc32(block, crc)
        left -= len(block)
    return crc


def open_plain(folder: str, name: str):
    """The file `name` of `folder` opened for reading, checked as it is opened: a symbolic link or a FIFO, socket,
    device or folder put there after the folder was checked (checkpoint_metadata.check_plain_file) is refused
    (RefusedMetadata, one line), never followed nor waited on (opening a FIFO for reading blocks until a writer
    comes: the reader hung)."""
    file = os.path.join(folder, name)
    try:
        fd = os.open(file, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as e:
        if os.path.islink(file):
            raise checkpoint_metadata.RefusedMetadata(f"its {name} is a symbolic link, which a checkpoint never "
                                                      f"holds") from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise checkpoint_metadata.RefusedMetadata(f"its {name} is not a regular file (a FIFO, socket, device or "
                                                  f"folder), which a checkpoint never holds")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def hash_ranges(folder: str, ranges: dict[str, list[tuple[int, int]]]) -> dict[str, list[list[int]]]:
    """{file: [[offset, length, crc32], ...]} for the given (offset, length) ranges of files in `folder`."""
    out = {}
    for name, spans in ranges.items():
        with open_plain(folder, name) as f:
            out[name] = [[off, length, crc32_range(f, off, length)] for off, length in sorted(set(spans))]
    return out


def whole_file(folder: str, name: str) -> dict[str, list[list[int]]]:
    return hash_ranges(folder, {name: [(0, os.path.getsize(os.path.join(folder, name)))]})


def encode(files: dict[str, list[list[int]]]) -> bytes:
    return json.dumps({"format": FORMAT, "algorithm": ALGORITHM, "files": files}, separators=(",", ":")).encode()


def read_record(folder: str) -> dict[tuple[str, int], tuple[int, int]] | None:
    """(file, offset) -> (length, crc32) from the folder's record; None for a checkpoint written before records
    (said once, as info). BadRecord (one line) for a record that is not one."""
    file = os.path.join(folder, RECORD)
    checkpoint_metadata.check_plain_file(folder, RECORD)  # a link or a FIFO: RefusedMetadata
    if not os.path.exists(file):
        if folder not in _UNRECORDED:
            _UNRECORDED.add(folder)
            log.info("checkpoint %s has no %s (it was written before dit_train recorded checksums): its shards are "
                     "read unverified", folder, RECORD)
        return None
    limit = record_limit(folder)
    if os.path.getsize(file) > limit:
        raise BadRecord(f"{file} is {os.path.getsize(file):,} bytes, larger than the record of its .metadata can be "
                        f"({limit:,} bytes): not read")
    with open_plain(folder, RECORD) as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise BadRecord(f"{file} grew past {limit:,} bytes while it was read: not read")
    try:
        record = json.loads(data)
    except (ValueError, RecursionError) as e:
        raise BadRecord(f"{file} is not valid JSON ({type(e).__name__}: {str(e)[:120]})") from None
    return _check(record, file)


_UNRECORDED: set[str] = set()
RECORD_SLACK = 64 << 10


def record_limit(folder: str) -> int:
    """The most bytes the record of the folder's `.metadata` takes: one range (~30 bytes) per storage entry, each
    of which takes 178-300 bytes of `.metadata` (checkpoint_metadata.MAX_METADATA_BYTES), and the `.metadata`'s
    own: under its size plus RECORD_SLACK. Parsed JSON takes ~10x its bytes (an 81 MiB record of 5 million ranges
    grew a reader by 836 MiB, on every rank), so a larger record is refused before it is parsed."""
    meta = os.path.join(folder, ".metadata")
    size = os.path.getsize(meta) if os.path.isfile(meta) else 0
    return min(size, checkpoint_metadata.MAX_METADATA_BYTES) + RECORD_SLACK


def _check(record, file: str) -> dict[tuple[str, int], tuple[int, int]]:
    def bad(what):
        return BadRecord(f"{file} is not a dit_train checksum record ({what})")

    if not isinstance(record, dict) or type(record.get("format")) is not int or record["format"] != FORMAT \
            or record.get("algorithm") != ALGORITHM:  # `true == 1` in Python: a bool is no format
        raise bad(f"a JSON object with format {FORMAT} and algorithm {ALGORITHM!r} expected")
    files = record.get("files")
    if not isinstance(files, dict) or ".metadata" not in files:
        raise bad("no 'files' object holding .metadata")
    out = {}
    for name, spans in files.items():
        if name != ".metadata" and not checkpoint_metadata.SHARD_FILE.fullmatch(name):  # `$` allows a final "\n"
            raise bad(f"it names {name!r}, which is not a file of a checkpoint")
        if not isinstance(spans, list):
            raise bad(f"{name!r} holds no list of ranges")
        for span in spans:
            if not (isinstance(span, list) and len(span) == 3 and all(type(v) is int and v >= 0 for v in span)
                    and span[2] < 2**32):
                raise bad(f"{name!r} holds {str(span)[:60]}, not [offset, length, crc32]")
            out[(name, span[0])] = (span[1], span[2])
    return out


def verify_whole(folder: str, record: dict, name: str) -> None:
    """ChecksumMismatch unless the file `name` is the one range recorded for it, size and bytes."""
    size, saved = os.path.getsize(os.path.join(folder, name)), record.get((name, 0))
    if saved is not None and saved[0] != size:
        raise ChecksumMismatch(f"its {name} does not hold the bytes it was saved with ({size:,} bytes, "
                               f"{saved[0]:,} at save)")
    verify(folder, record, {name: {(0, size)}})


def verify(folder: str, record: dict, ranges: dict[str, set[tuple[int, int]]]) -> None:
    """ChecksumMismatch naming the first file whose given ranges are not the bytes the record holds."""
    for name in sorted(ranges):
        with open_plain(folder, name) as f:  # a FIFO swapped in since the metadata check: refused, not waited on
            for off, length in sorted(ranges[name]):
                saved = record.get((name, off))
                if saved is None or saved[0] != length:
                    raise ChecksumMismatch(f"its {RECORD} holds no checksum of bytes {off}-{off + length} of {name} "
                                           f"(the record or the metadata was changed)")
                found = crc32_range(f, off, length)
                if found != saved[1]:
                    raise ChecksumMismatch(f"its {name} does not hold the bytes it was saved with (bytes {off}-"
                                           f"{off + length}: {ALGORITHM} {found:08x}, {saved[1]:08x} recorded at save)")


def checksumming_writer(path: str):
    """DCP's file-system writer (fsynced files) that records the checksums: each rank hashes the items it wrote,
    the coordinator writes the record once `.metadata` is in place."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.storage import WriteResult

    from dit_train.runs.atomic_io import atomic_write_bytes

    class Writer(dcp.FileSystemWriter):
        def write_data(self, plan, planner):
            written = super().write_data(plan, planner)
            written.wait()
            results = written.value()
            spans: dict[str, list[tuple[int, int]]] = {}
            for result in results:
                info = result.storage_data
                spans.setdefault(info.relative_path, []).append((info.offset, info.length))
            sums = hash_ranges(str(self.path), spans)  # this rank's files, read back as written
            mine = WriteResult(index=MetadataIndex(KEY), size_in_bytes=0, storage_data=sums)
            future = torch.futures.Future()
            future.set_result([*results, mine])
            return future

        def finish(self, metadata, results):
            files, kept = {}, []
            for rank_results in results:
                kept.append([r for r in rank_results if r.index.fqn != KEY])
                for r in rank_results:
                    if r.index.fqn == KEY:
                        files.update(r.storage_data)
            super().finish(metadata, kept)
            folder = str(self.path)
            files.update(whole_file(folder, ".metadata"))
            atomic_write_bytes(encode(files), os.path.join(folder, RECORD))

    return Writer(path, sync_files=True)
