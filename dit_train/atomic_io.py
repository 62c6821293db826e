"""Files that are either complete or absent: written to a temp name, fsynced, renamed, the folder fsynced.

A crash (kill -9, power loss) leaves the old file or the new one, never a torn one; the temp name carries the
writer's pid, so a leftover is recognisable (`*.tmp-<pid>`) and never mistaken for the real file."""

from __future__ import annotations

import contextlib
import os


def fsync_dir(path: str) -> None:
    fd = os.open(path or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_synced(data: bytes, path: str) -> None:
    """Write and fsync (for files inside a folder that is itself renamed into place when complete)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def atomic_write_bytes(data: bytes, path: str) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        write_synced(data, tmp)
        os.replace(tmp, path)
    except BaseException:  # a full disk must not keep the partial file
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    fsync_dir(os.path.dirname(path))


def current_umask() -> int:
    mask = os.umask(0o022)  # the only portable way to read it is to set it; restored at once
    os.umask(mask)
    return mask


def atomic_save_tensors(tensors: dict, path: str, metadata: dict | None = None) -> None:
    """safetensors' save_file through a temp name, with the mode of any other new file (0644 under umask 022):
    save_file itself creates its file 0600, which would hide exported weights and latent shards from other users."""
    from safetensors.torch import save_file

    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        save_file(tensors, tmp, metadata=metadata)
        make_readable(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:  # a full disk must not keep the partial file
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    fsync_dir(os.path.dirname(path))


def make_readable(path: str) -> None:
    """The mode open() gives a new file (0666 less the umask), for files made by libraries that create them 0600."""
    os.chmod(path, 0o666 & ~current_umask())


def remove_stale_temp_files(folder: str) -> list[str]:
    """Leftovers of writers that died mid-write (`*.tmp-<pid>`) in `folder`; call only while holding the folder."""
    stale = [os.path.join(folder, f) for f in os.listdir(folder) if ".tmp-" in f] if os.path.isdir(folder) else []
    for path in stale:
        with contextlib.suppress(OSError):
            os.remove(path)
    return stale
