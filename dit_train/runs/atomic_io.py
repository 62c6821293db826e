"""Files that are either complete or absent: written to a temp name, fsynced, renamed, the folder fsynced.

A crash (kill -9, power loss) leaves the old file or the new one, never a torn one; the temp name carries the
writer's pid, so a leftover is recognisable (`*.tmp-<pid>`) and never mistaken for the real file."""

from __future__ import annotations

import contextlib
import os
import re


def fsync_dir(path: str) -> None:
    fd = os.open(path or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_synced(data: bytes, path: str) -> None:
    """Write a new file and fsync it (for files inside a folder that is itself renamed into place when complete).
    The name must be free, and a symbolic link there is never written through (O_EXCL, O_NOFOLLOW): a temp name
    planted as a link in a folder from elsewhere would otherwise overwrite the link's target."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def temp_name(path: str) -> str:
    """The temp name of `path` for this process, free: a leftover of a dead writer with the same pid, or a link
    planted there in a folder from elsewhere, is removed (never written through)."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with contextlib.suppress(FileNotFoundError):
        os.remove(tmp)
    return tmp


def replace_through_temp(path: str, write) -> None:
    """write(tmp) to a temp name beside `path`, then rename it over `path`: readers see the old file or the new one,
    never part of one. A failure removes the temp file (a full disk must not keep the partial file) and an OSError
    names `path`."""
    tmp = temp_name(path)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        if isinstance(e, OSError):
            raise naming(e, path) from None
        raise
    fsync_dir(os.path.dirname(path))


def atomic_write_bytes(data: bytes, path: str) -> None:
    replace_through_temp(path, lambda tmp: write_synced(data, tmp))


def current_umask() -> int:
    mask = os.umask(0o022)  # the only portable way to read it is to set it; restored at once
    os.umask(mask)
    return mask


def atomic_save_tensors(tensors: dict, path: str, metadata: dict | None = None) -> None:
    """safetensors' save_file through a temp name, with the mode of any other new file (0644 under umask 022):
    save_file itself creates its file 0600, which would hide exported weights and latent shards from other users."""
    from safetensors.torch import save_file

    tmp = temp_name(path)
    try:
        try:
            save_file(tensors, tmp, metadata=metadata)
        except Exception as e:  # safetensors reports a full disk as its own error, "... (os error 28)"
            code = re.search(r"os error (\d+)", str(e))
            if code is None or isinstance(e, OSError):
                raise
            raise OSError(int(code.group(1)), os.strerror(int(code.group(1))), path) from None
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


def naming(e: OSError, path: str) -> OSError:
    """`e` with a file name: a failed write() or close() (ENOSPC on a full disk) names none, open() does."""
    if e.filename or e.errno is None:
        return e
    named = type(e)(e.errno, e.strerror, path)
    named.__traceback__ = e.__traceback__
    return named


def describe_os_error(e: OSError) -> str:
    """One line: what failed, its errno name, the path, and the function it happened in."""
    import errno
    import traceback

    where = traceback.extract_tb(e.__traceback__)[-1].name if e.__traceback__ else "?"
    code = errno.errorcode.get(e.errno, "") if e.errno else ""
    path = f" {e.filename!r}" if e.filename else ""
    return f"{e.strerror or e}{f' ({code})' if code else ''}:{path} (in {where})"


def check_folder_can_be_made(folder: str) -> None:
    """Raise OSError naming the path unless `folder` is, or could be made as, a writable folder; writes nothing
    (a command checks its output places this way before minutes of work, and makes them only once it has results)."""
    import errno

    probe = os.path.abspath(folder)
    while not os.path.lexists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), probe)
    if not os.access(probe, os.W_OK | os.X_OK):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), probe)


def refuse_links_on_the_way(dest: str, target: str, writer: str, folder: bool = False) -> None:
    """Raise ConfigError (one line) unless `target`, a file (`folder`: a folder) to be written inside `dest` (a
    folder the user named, that may come from elsewhere), is reached without a symbolic link and is absent or a
    regular file (a folder): a link at the file's name (`runs/a/metrics.jsonl -> ~/.bashrc`) or at a folder on its
    way (`runs/a -> ~/project`) had the write land at the link's target, and a FIFO there hung it. `writer` names
    who writes, for the message."""
    from dit_train.config.errors import ConfigError

    path = dest
    for part in os.path.relpath(target, dest).split(os.sep):
        path = os.path.join(path, part)
        if os.path.islink(path):
            raise ConfigError(f"{path} is a symbolic link (to {os.readlink(path)}): {writer} writes there, so it "
                              f"would write outside {dest}; remove it")
    if folder and os.path.lexists(target) and not os.path.isdir(target):
        raise ConfigError(f"{target} is not a folder: {writer} writes files inside it; remove it")
    if not folder and os.path.lexists(target) and not os.path.isfile(target):
        raise ConfigError(f"{target} is not a regular file (a FIFO, socket, device or folder): {writer} replaces "
                          f"it; remove it")


def remove_stale_temp_files(folder: str) -> list[str]:
    """Leftovers of writers that died mid-write (`*.tmp-<pid>`) in `folder`; call only while holding the folder."""
    stale = [os.path.join(folder, f) for f in os.listdir(folder) if ".tmp-" in f] if os.path.isdir(folder) else []
    for path in stale:
        with contextlib.suppress(OSError):
            os.remove(path)
    return stale


def atomic_copy(source: str, path: str, max_bytes: int) -> None:
    """Copy `source` (a regular file, never a link) to `path` through replace_through_temp, fsynced, with the
    source's mode and times (as shutil.copy2). A kill, a full disk or a file-size limit mid-copy leaves the old `path`
    whole and no temp file (shutil.copy2 straight onto `path` left it torn). ValueError when the source grows past
    `max_bytes` while it is copied."""
    import shutil
    import stat

    def copy(tmp: str) -> None:
        src_fd = os.open(source, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        with os.fdopen(src_fd, "rb") as src:
            if not stat.S_ISREG(os.fstat(src_fd).st_mode):
                raise ValueError(f"{source} is not a regular file: not copied")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666)
            with os.fdopen(fd, "wb") as out:
                copied = 0
                while chunk := src.read(1 << 20):
                    copied += len(chunk)
                    if copied > max_bytes:
                        raise ValueError(f"{source} grew past {max_bytes:,} bytes while it was copied: not copied")
                    out.write(chunk)
                out.flush()
                os.fsync(out.fileno())
        shutil.copystat(source, tmp, follow_symlinks=False)

    replace_through_temp(path, copy)


def remove_dead_temp_files(folder: str, names) -> list[str]:
    """Temp files `<name>.tmp-<pid>` of `names` in `folder` left by a writer that was killed (its pid is no longer
    running): a report.md.tmp-PID of a report killed at its fsync stayed next to report.md for good. A live writer's
    temp file is left alone, so two reports into one folder do not remove each other's."""
    removed = []
    if not os.path.isdir(folder):
        return removed
    for entry in os.listdir(folder):
        m = re.fullmatch(r"(.+)\.tmp-(\d+)", entry)
        if not m or m.group(1) not in names or int(m.group(2)) == os.getpid() or pid_alive(int(m.group(2))):
            continue
        with contextlib.suppress(OSError):
            os.remove(os.path.join(folder, entry))
            removed.append(os.path.join(folder, entry))
    return removed


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):  # another user's process (alive); a pid no kernel gives (never ours)
        return True
    return True
