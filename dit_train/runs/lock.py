"""One writer per run folder: an exclusive lock on `<run_dir>/.lock` for the life of the run (rank 0 holds it for
the whole job). The kernel releases an flock when its process dies, so a crashed run leaves no stale lock; the
file names the holder (host, pid, start time) so that a refused second writer can say who has the folder."""

from __future__ import annotations

import fcntl
import os
import socket
import time

LOCK_NAME = ".lock"
# the trainer's exit status when another process holds the run folder: not a bad command (exit 2), which the same
# command repeats, nor a preemption (75, checkpointed): the same command succeeds once the holder has ended.
# 73 is EX_CANTCREAT (sysexits.h: the output cannot be created), 75 being taken by preemption.
EXIT_RUN_FOLDER_BUSY = 73


class RunFolderBusy(FileExistsError):
    """Another process is writing this run folder."""


class RunLock:
    def __init__(self, run_dir: str):
        self.path = os.path.join(run_dir, LOCK_NAME)
        self.fd: int | None = None

    def acquire(self) -> "RunLock":
        from dit_train.runs.in_place_files import open_in_place  # it names LOCK_NAME

        fd = open_in_place(self.path, os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 512, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise RunFolderBusy(f"run folder {os.path.dirname(self.path)} is in use by {holder} (one writer per run "
                                f"folder): wait for it to end, or choose another run_dir") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{socket.gethostname()} pid {os.getpid()} since {time.strftime('%Y-%m-%dT%H:%M:%S')}\n"
                  .encode(), 0)
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None


def held_by_a_writer(run_dir: str) -> bool:
    """Whether a live process holds `run_dir`'s lock (read only: the lock file is neither made nor followed as a
    link). A reader (a fork reading its parent) then says a partial checkpoint there is being written, not that
    its save was interrupted."""
    try:
        fd = os.open(os.path.join(run_dir, LOCK_NAME), os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
