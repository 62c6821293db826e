"""The places of a run folder that a run writes through instead of renaming a new file over them: the files it writes
in place (the lock, truncated and rewritten; metrics.jsonl, a torn last row cut off, then appended to; Hydra's log,
appended to), the folders it writes, moves and deletes inside (checkpoints/, where pruning deletes and leftovers of
saves are removed; samples/; abandoned/; .hydra/; wandb/; nccl_traces/) and the checkpoints themselves (a resume
rewrites a checkpoint's train_state.json). In a run folder from elsewhere a symbolic link at one of these made a
resume write or delete at the link's target (`.lock -> ~/.bashrc` emptied it; `checkpoints -> /shared/other_run/
checkpoints` had the other run's checkpoints pruned), and a FIFO in place of a file hung it (Hydra's log opened for
appending waits for a reader), so such a folder is refused before anything is written.

Where Hydra names the folder itself (`hydra.run.dir=X`, a `--multirun` sweep's `hydra.sweep.dir`), Hydra writes
there before any check of ours runs: the sweep's `multirun.yaml`, and in each job folder `.hydra/{config,hydra,
overrides}.yaml` and its log. Such a folder from elsewhere is checked whole before Hydra starts
(refuse_hydra_writes_outside)."""

from __future__ import annotations

import errno
import os
import stat

from dit_train.config.errors import invalid
from dit_train.config.override_text import shell_override
from dit_train.runs.lock import LOCK_NAME
from dit_train.telemetry.logger import METRICS_FILE

HYDRA_LOG = "dit_train.log"  # Hydra's job log, <job name>.log; the job is named after the dit_train module
IN_PLACE = (LOCK_NAME, METRICS_FILE, HYDRA_LOG)
# the folders a run writes inside (checkpoint.py, evaluation/during_training.py, timeline.py, hydra_files.py,
# wandb's dir=run_dir, backend_env.py): tests/integration/test_run_folder.py checks that a run makes no other
WRITTEN_FOLDERS = ("checkpoints", "samples", "abandoned", ".hydra", "wandb", "nccl_traces")


def refuse_writes_outside(run_dir: str) -> None:
    """Raise ConfigError (one line) if a file the run writes in place, a folder it writes inside or one of its
    checkpoints is a symbolic link, or a file it writes in place is not a regular file."""
    checkpoints = os.path.join(run_dir, "checkpoints")
    entries = sorted(os.listdir(checkpoints)) if os.path.isdir(checkpoints) and not os.path.islink(checkpoints) else []
    for path in [os.path.join(run_dir, name) for name in IN_PLACE + WRITTEN_FOLDERS] + \
            [os.path.join(checkpoints, name) for name in entries]:
        if os.path.islink(path):
            _refuse(run_dir, f"{path} is a symbolic link (to {os.readlink(path)}); a run writes there, so it would "
                             f"write or delete outside the run folder")
    for path in [os.path.join(run_dir, name) for name in IN_PLACE]:
        if os.path.exists(path) and not os.path.isfile(path):
            _refuse(run_dir, f"{path} is not a regular file (a FIFO, socket, device or folder); a run writes this "
                             f"file in place")


def open_in_place(path: str, flags: int) -> int:
    """A descriptor of the file at `path` (one of IN_PLACE, written in place), opened without following a symbolic
    link and kept only if it is a regular file: refuse_writes_outside checked the folder before the run, and this
    makes the check hold at the moment of use (on a shared file system a link or FIFO put there in between was
    followed, or hung the run). ConfigError (one line) otherwise."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)  # O_NONBLOCK: a FIFO opens, never waits
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise
        _refuse(os.path.dirname(path), f"{path} became a symbolic link (to {os.readlink(path)}) after the run "
                                       f"folder was checked; a run writes this file in place")
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        _refuse(os.path.dirname(path), f"{path} became a FIFO, socket or device after the run folder was checked; "
                                       f"a run writes this file in place")
    os.set_blocking(fd, True)
    return fd


def _refuse(run_dir: str, why: str):
    fork = shell_override("train.init_from", run_dir)
    raise invalid("run_dir", run_dir, f"{why}: remove it, or fork the run with {fork} into a new run_dir")


# folders of a run whose insides are not Hydra's: checked when each job starts (refuse_writes_outside), or wandb's own
# (its `latest-run` link)
RUN_INSIDES = tuple(name for name in WRITTEN_FOLDERS if name != ".hydra")


def refuse_hydra_writes_outside(folder: str, key: str) -> None:
    """Raise ConfigError (one line, naming `key`=`folder`) if anything in the folder Hydra will write into, outside
    its runs' RUN_INSIDES, is a symbolic link, or a file there is a FIFO, socket or device: Hydra's files were
    written through a link (`multirun.yaml -> ~/.bashrc` overwrote it; a job folder linked elsewhere got Hydra's
    record and the run) and a FIFO hung the command. A sweep or run folder holds no link of its own there. The
    folder itself may be a link: the user named it."""
    for parent, folders, files in os.walk(folder):
        for name in sorted(folders + files):
            path = os.path.join(parent, name)
            if os.path.islink(path):
                why = f"{path} is a symbolic link (to {os.readlink(path)})"
            elif name in files and not os.path.isfile(path):
                why = f"{path} is not a regular file (a FIFO, socket or device)"
            else:
                continue
            raise invalid(key, folder, f"{why}; Hydra writes its record of the command and its log in this folder "
                                       f"before a run starts, so it would write outside it or hang: remove it")
        folders[:] = [name for name in folders if name not in RUN_INSIDES]
