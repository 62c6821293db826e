"""One dit-encode-latents job per --out: an exclusive lock on out/.encode.lock, held for the whole encoding.

Two encoders on one --out (a train and a val split launched in two terminals or two Slurm jobs, the same command
twice) each read latents_info.json, encoded and wrote back their own record: one split's entry, or the shard
lists, overwrote the other's. The lock is `fcntl.flock` on the file, not the file's existence: the kernel drops it
when the holder exits however it ends (SIGKILL, a node's OOM killer), so a lock file left behind blocks nothing.
The holder records its pid, host and start in the file for the refusal line, and removes the file when it is done.

Under torchrun rank 0 alone takes it (the job's ranks share one --out by design) and every rank learns the
outcome from rank 0 (`broadcast_object`), so the others are refused with it instead of waiting in a collective.

What it does not cover: a filesystem where flock does not lock across hosts. Linux NFS clients emulate flock with
whole-file POSIX locks held by the server (NFSv4, or NFSv3 with lockd), which works across hosts, unless the mount
has `nolock` or `local_lock=flock|all` (then the lock is local to each host). Lustre locks across clients only
when mounted with `-o flock`; with `localflock` the lock is local to each client, and with `noflock` flock fails
(ENOSYS): then one warning line says that nothing is locked, and the encoding proceeds. Two jobs on such a
filesystem, on different hosts, are not refused.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import stat
import time
from contextlib import contextmanager

from dit_train.config.errors import ConfigError
from dit_train.parallel.fsdp import broadcast_object

LOCK_NAME = ".encode.lock"
# flock itself unsupported where the file is (Lustre mounted with noflock, some FUSE filesystems): a warning
NO_LOCKING = (errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOLCK, errno.EINVAL)


class OutLock:
    """The held lock on `out`: its open file (the flock lives as long as it) and the folders it made."""

    def __init__(self, fd: int | None, path: str, made: list[str]):
        self.fd, self.path, self.made = fd, path, made

    def release(self) -> None:
        """Remove the lock file while holding it, then close it (which drops the flock), then the folders made
        for it, if they are still empty. A job opening the file between the removal and the close locks a file
        no longer at the path; `acquire` sees that and opens the path again."""
        if self.fd is None:
            return
        try:
            os.unlink(self.path)
        except OSError:
            pass
        os.close(self.fd)
        self.fd = None
        for folder in reversed(self.made):  # innermost first; one that holds anything stays
            try:
                os.rmdir(folder)
            except OSError:
                break


def missing_folders(folder: str) -> list[str]:
    """`folder` and its ancestors that do not exist, outermost first (what makedirs would make)."""
    made, probe = [], os.path.abspath(folder)
    while not os.path.lexists(probe):
        made.append(probe)
        probe = os.path.dirname(probe)
    return made[::-1]


def holder_text(fd: int, path: str) -> str:
    """Who holds the lock, from the file it wrote: 'pid N, started at T, host H'. The holder writes it right after
    taking the lock: a moment later if the file is still empty."""
    for _ in range(20):
        try:
            holder = json.loads(os.pread(fd, 4096, 0).decode())
            return f"pid {int(holder['pid'])}, started at {holder['started']}, host {holder['host']}"
        except (ValueError, KeyError, TypeError, UnicodeDecodeError):
            time.sleep(0.05)
    return f"its pid, start and host are not recorded in {path}"


def not_a_lock_file(out: str, what: str) -> ConfigError:
    return ConfigError(f"--out {out} holds a {LOCK_NAME} that is {what}, not the lock file dit-encode-latents "
                       f"makes (a regular file of its own): remove it, or choose another --out")


def open_lock_file(out: str, path: str) -> int:
    """The lock file at `path`, opened (made if missing) only where it is a regular file of its own: a symlink
    there is not followed (O_CREAT followed it, and the holder truncated and overwrote the file it pointed to, or
    made one where a dangling one pointed), nor is a second name of another file written (a hard link), nor a
    FIFO or device opened for writing (O_NONBLOCK: opening one does not wait)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK, 0o666)
    except IsADirectoryError:
        raise not_a_lock_file(out, "a folder") from None
    except OSError as e:
        if e.errno == errno.ELOOP and os.path.islink(path):
            raise not_a_lock_file(out, f"a symlink (to {os.readlink(path)})") from None
        raise
    st = os.fstat(fd)
    what = ("a FIFO, device or socket" if not stat.S_ISREG(st.st_mode)
            else f"another file's second name ({st.st_nlink} links)" if st.st_nlink > 1 else None)
    if what is not None:
        os.close(fd)
        raise not_a_lock_file(out, what)
    return fd


def acquire(out: str) -> OutLock:
    """Take the lock on `out` (made if missing), or raise ConfigError naming the job that holds it."""
    path = os.path.join(out, LOCK_NAME)
    made = missing_folders(out)
    while True:
        os.makedirs(out, exist_ok=True)
        try:
            fd = open_lock_file(out, path)
        except FileNotFoundError:  # --out removed by a refused job's clean-up in between: make it again
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            who = holder_text(fd, path)
            os.close(fd)
            raise ConfigError(f"--out {out} is being written by another dit-encode-latents ({who}); wait for it, "
                              f"or choose another --out") from None
        except OSError as e:
            if e.errno not in NO_LOCKING:
                os.close(fd)
                raise
            print(f"warning: --out {out} does not support file locks (flock: {os.strerror(e.errno)}): another "
                  f"dit-encode-latents on it would not be refused; run one at a time on it", flush=True)
            return OutLock(fd, path, made)
        try:  # the file locked is the one at the path (not one a finishing holder has just removed)
            same = os.path.samestat(os.fstat(fd), os.stat(path))
        except FileNotFoundError:
            same = False
        if not same:
            os.close(fd)
            continue
        holder = {"pid": os.getpid(), "host": socket.gethostname(),
                  "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(holder).encode(), 0)
        # the holder never opens this file again: NFS emulates flock with POSIX locks, which closing any of a
        # process's descriptors of the file drops
        return OutLock(fd, path, made)


@contextmanager
def encoding_lock(out: str, is_main: bool):
    """Held by rank 0 (or the single process) for the body; every rank raises rank 0's refusal, or its error
    taking the lock (an unwritable --out), at once: the other ranks do not wait for it in a later collective."""
    lock, error = None, None
    if is_main:
        try:
            lock = acquire(out)
        except (ConfigError, OSError) as e:
            error = e
    error = broadcast_object(error)
    if error is not None:
        raise error
    try:
        yield
    finally:
        if lock is not None:
            lock.release()
