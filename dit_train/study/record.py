"""study.json read as a record that may have been hand-edited or handed over with a sweep: a JSON object whose
`runs` is a list of objects each naming its run, model, optimizer and seed, and whose `invocations` is a list of
objects. Anything else is one line naming the file (dit-report, dit-paired-report, dit-publish-study and dit-study
stopped with a KeyError or TypeError traceback)."""

from __future__ import annotations

from dit_train.runs.json_file import DamagedJSONFile, read_json

RESTORE = "restore it from a copy (dit-study writes it)"
RUN_KEYS = ("name", "model", "optimizer", "seed")


def read_study(path: str, keys: tuple[str, ...] = (), fix: str = RESTORE) -> dict:
    """The record in `path` (holding each of `keys`), checked; a missing file raises FileNotFoundError."""
    record = read_json(path, keys, fix=fix)
    if not isinstance(record, dict):
        raise DamagedJSONFile(f"{path} holds a JSON {type(record).__name__}, not the object dit-study writes; {fix}")
    runs, invocations = record.get("runs", []), record.get("invocations", [])
    if not isinstance(runs, list) or not all(isinstance(r, dict) and all(k in r for k in RUN_KEYS)
                                             and isinstance(r["name"], str) for r in runs):
        raise DamagedJSONFile(f"{path}: its 'runs' is not a list of runs each with {', '.join(RUN_KEYS)}; {fix}")
    if not isinstance(invocations, list) or not all(isinstance(c, dict) for c in invocations):
        raise DamagedJSONFile(f"{path}: its 'invocations' is not a list of commands; {fix}")
    return record
