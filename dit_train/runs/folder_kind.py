"""The two folders a user holds, each given where the other is needed: a run folder (checkpoints/step_*.dcp: what
dit-sample, dit-export and dit-fd read) and a model folder written by dit-export (model_index.json + transformer/:
what DiT.from_pretrained and DiTTrainPipeline load). Each mistake is one line saying which folder to give instead."""

from __future__ import annotations

import os

from dit_train.config.override_text import shell_command
from dit_train.runs.json_file import read_json

PIPELINE_FILE = "model_index.json"  # dit_train.model.pretrained writes it last: a folder with one is an export
TRANSFORMER = "transformer"  # the pipeline's subfolder of the DiT


def export_source(folder: str) -> str | None:
    """The checkpoint a dit-export folder was written from ('' if its config.json does not say); None for any
    other folder."""
    if not os.path.isfile(os.path.join(folder, PIPELINE_FILE)):
        return None
    try:
        return str(read_json(os.path.join(folder, TRANSFORMER, "config.json"))["dit_train"]["source"])
    except (OSError, ValueError, KeyError, TypeError):  # an export from elsewhere or damaged: the folder still is one
        return ""


def no_checkpoints(path: str) -> FileNotFoundError:
    """The error for a folder without checkpoints where a run folder is needed."""
    source = export_source(path)
    if source is None:
        return FileNotFoundError(f"no checkpoints (checkpoints/step_*.dcp) under {path!r}{runs_inside(path)}")
    instead = f": {source}" if source else ""
    return FileNotFoundError(f"{path!r} is a model folder written by dit-export, not a run folder: give the run "
                             f"folder or the checkpoint it was exported from{instead}")


def runs_inside(path: str) -> str:
    """'' unless `path` holds run folders (a --multirun sweep's `0/`, `1/`, a dit-study's folders, a folder of
    runs): then which, and that one of them is what to give (the folder itself read as nothing to do)."""
    try:
        runs = sorted(d for d in os.listdir(path) if os.path.isdir(os.path.join(path, d, "checkpoints")))
    except OSError:  # not a folder, or unreadable: the line above says enough
        return ""
    if not runs:
        return ""
    names = ", ".join(runs[:5]) + (f", ... ({len(runs)} in all)" if len(runs) > 5 else "")
    return f": it holds run folders ({names}); give one of them, e.g. {os.path.join(path, runs[0])!r}"


def run_folder_hint(path: str) -> str:
    """'' unless `path` is a run folder (it has checkpoints/) given where a model folder is needed: then how to
    make one from it."""
    if not os.path.isdir(os.path.join(path, "checkpoints")):
        return ""
    command = shell_command(["dit-export", path, "OUT_DIR"])
    return f"; {path!r} is a run folder: write its model folder with `{command}` and load OUT_DIR"
