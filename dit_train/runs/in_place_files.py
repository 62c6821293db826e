"""The files of a run folder that a run writes in place instead of renaming a new file over them: the lock (truncated
and rewritten), metrics.jsonl (a torn last row cut off, then appended to) and Hydra's log (appended to). In a run
folder from elsewhere a symbolic link at one of these names made a resume write into the link's target
(`.lock -> ~/.bashrc` emptied it), so such a folder is refused before anything is written."""

from __future__ import annotations

import os

from dit_train.config.errors import invalid
from dit_train.runs.lock import LOCK_NAME
from dit_train.telemetry.logger import METRICS_FILE

HYDRA_LOG = "dit_train.log"  # Hydra's job log, <job name>.log; the job is named after the dit_train module
IN_PLACE = (LOCK_NAME, METRICS_FILE, HYDRA_LOG)


def refuse_links(run_dir: str) -> None:
    """Raise ConfigError (one line) if a file the run writes in place is a symbolic link."""
    for name in IN_PLACE:
        path = os.path.join(run_dir, name)
        if os.path.islink(path):
            raise invalid("run_dir", run_dir, f"{path} is a symbolic link (to {os.readlink(path)}); a run writes "
                                              f"this file in place, so it would write outside the run folder: "
                                              f"remove the link, or fork the run with train.init_from={run_dir} "
                                              f"into a new run_dir")
