"""study.json read as a record that may have been hand-edited or handed over with a sweep: a JSON object whose
`runs` is a list of objects each naming its run, model, optimizer and seed, and whose `invocations` is a list of
objects. Anything else is one line naming the file (dit-report, dit-paired-report, dit-publish-study and dit-study
stopped with a KeyError or TypeError traceback).

Also what the three study commands share about run records from elsewhere: when a run is finished (the rule
dit-study uses), the largest record file they read or copy, and Markdown escaping of the text a record puts into a
report."""

from __future__ import annotations

import math
import os
import re

from dit_train.runs.json_file import DamagedJSONFile, read_json

RESTORE = "restore it from a copy (dit-study writes it)"
RUN_KEYS = ("name", "model", "optimizer", "seed")
# The largest metrics.jsonl a study reads or publishes. The longest run any experiment plans is scaling_study's
# 400,000 steps; logged every step (the stability studies' log_every=1) at <= 1 KiB a row (the largest published row
# is 794 bytes; val and FD rows are far fewer) that is 390 MiB; 512 MiB leaves ~30% margin. A bigger file is not a
# run record (a sparse `truncate -s 1G` became a gigabyte in the published folder).
RECORD_MAX_BYTES = 512 << 20


def is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def is_number(x) -> bool:
    """A JSON number a float can hold (10**400 is an int JSON allows and no float can)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return False
    try:
        float(x)
    except OverflowError:
        return False
    return True


def read_study(path: str, keys: tuple[str, ...] = (), fix: str = RESTORE) -> dict:
    """The record in `path` (holding each of `keys`), checked; a missing file raises FileNotFoundError."""
    record = read_json(path, keys, fix=fix)
    if not isinstance(record, dict):
        raise DamagedJSONFile(f"{path} holds a JSON {type(record).__name__}, not the object dit-study writes; {fix}")
    runs, invocations = record.get("runs", []), record.get("invocations", [])
    if not isinstance(runs, list) or not all(isinstance(r, dict) and all(k in r for k in RUN_KEYS)
                                             and isinstance(r["name"], str) for r in runs):
        raise DamagedJSONFile(f"{path}: its 'runs' is not a list of runs each with {', '.join(RUN_KEYS)}; {fix}")
    for r in runs:
        check_run_entry(path, r, fix)
    if not isinstance(invocations, list) or not all(isinstance(c, dict) and isinstance(c.get("command", ""), str)
                                                    for c in invocations):
        raise DamagedJSONFile(f"{path}: its 'invocations' is not a list of commands; {fix}")
    for key in ("experiment", "banner", "notes", "command"):
        if key in record and not isinstance(record[key], str):
            raise DamagedJSONFile(f"{path}: its {key!r} is {record[key]!r}, not a string; {fix}")
    if "selection_seeds" in record and not (isinstance(record["selection_seeds"], list)
                                            and all(is_int(s) for s in record["selection_seeds"])):
        raise DamagedJSONFile(f"{path}: its 'selection_seeds' is {record['selection_seeds']!r}, not a list of "
                              f"integer seeds (e.g. [20, 21]); {fix}")
    selection = record.get("lr_selection")
    if selection is not None and not (isinstance(selection, dict) and all(
            isinstance(v, dict) and is_number(v.get("lr")) for v in selection.values())):
        raise DamagedJSONFile(f"{path}: its 'lr_selection' is not an object of variants each with a numeric lr "
                              f"(e.g. {{\"dit_s muon\": {{\"lr\": 0.016}}}}); {fix}")
    common = record.get("common_lr")
    if common is not None and not (isinstance(common, dict) and all(is_number(v) for v in common.values())):
        raise DamagedJSONFile(f"{path}: its 'common_lr' is not an object of numeric lrs; {fix}")
    return record


def selection_seeds(study: dict) -> list[int]:
    """The seeds that chose the learning rates: study.json's selection_seeds, or (records from before the runner
    wrote it) the seeds of its scan runs. dit-paired-report and dit-report keep them out of every evaluation mean."""
    if "selection_seeds" in study:
        return sorted(study["selection_seeds"])
    return sorted({r["seed"] for r in study.get("runs", []) if r.get("phase") == "scan"})


def check_run_entry(path: str, r: dict, fix: str) -> None:
    """A run of study.json names a run folder of the sweep itself: one plain path component (a name that is
    absolute, holds a separator or is `..` had the reports read, and dit-publish-study publish, run records from
    anywhere), with a model and optimizer named by strings, an integer seed, an lr that is a number or null."""
    name = r["name"]
    if name in ("", ".", "..") or "/" in name or "\\" in name or "\0" in name or os.path.isabs(name):
        raise DamagedJSONFile(f"{path}: run name {name!r} is not a folder name of the sweep (one path component, "
                              f"no '/', not '..'); {fix}")
    for key in ("model", "optimizer"):
        if not isinstance(r[key], str):
            raise DamagedJSONFile(f"{path}: run {name!r} has {key} {r[key]!r}, not a name; {fix}")
    if not is_int(r["seed"]):
        raise DamagedJSONFile(f"{path}: run {name!r} has seed {r['seed']!r}, not an integer; {fix}")
    if r.get("lr") is not None and not is_number(r["lr"]):
        raise DamagedJSONFile(f"{path}: run {name!r} has lr {r['lr']!r}, not a number or null; {fix}")
    if r.get("K") is not None and not is_int(r["K"]):
        raise DamagedJSONFile(f"{path}: run {name!r} has K {r['K']!r}, not an integer or null; {fix}")
    if r.get("scale") is not None and not isinstance(r["scale"], str):
        raise DamagedJSONFile(f"{path}: run {name!r} has scale {r['scale']!r}, not a name or null; {fix}")


def summary_step_count(summary) -> int:
    """The step count a summary.json records (written only after the end-of-run evaluation); -1 without one."""
    return summary["steps"] if isinstance(summary, dict) and is_int(summary.get("steps")) else -1


def planned_steps(cfg) -> int | None:
    """config.yaml's train.steps (None where the record has none: fabricated or very old records)."""
    train = cfg.get("train") if isinstance(cfg, dict) else None
    steps = train.get("steps") if isinstance(train, dict) else None
    return steps if is_int(steps) else None


def finished_by_summary(summary_steps: int, planned: int | None) -> bool:
    """dit-study's rule (run.finished): a summary.json at the planned train.steps; an extended run keeps its old
    summary until it is overwritten, so a summary alone does not make a run finished."""
    return summary_steps >= 0 and (planned is None or summary_steps >= planned)


_LINE_BREAKS = re.compile(r"[\r\n\u2028\u2029\x0b\x0c]+")


def md(text) -> str:
    """`text` from a record as Markdown that stays one line of text or one table cell: line breaks become spaces
    (no forged heading or table row), `|` cannot end a cell, and HTML (`<iframe>`, `<script>`) is shown, not
    rendered. Markdown emphasis, links and code in study.json's banner and notes are kept: their authors wrote them
    for the report."""
    text = _LINE_BREAKS.sub(" ", str(text))
    text = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace("|", "\\|")
    return "\\" + text if text.startswith(("#", "=", "-", "+", "*")) and not text.startswith("**") else text


def md_code(text) -> str:
    """`text` for inside a `code span` on one line: a backtick would end the span."""
    return _LINE_BREAKS.sub(" ", str(text)).replace("`", "'")


def finite_or_nan(x) -> float:
    return float(x) if is_number(x) else math.nan
