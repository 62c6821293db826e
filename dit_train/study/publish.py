"""Copy a sweep's run records (no checkpoints, samples or logs) to a folder that can be committed, then build
the report there — so a published report sits next to the exact files its numbers come from.

    dit-publish-study sweeps/scaling_study_cpu docs/results/scaling_study_cpu

Writes DEST/runs/<run>/{config.yaml, metrics.jsonl, summary.json, run_info.json} and DEST/runs/study.json,
then DEST/report.md: dit-paired-report's for a two-phase study (study.json with an lr_selection), else
dit-report's with its plots (`--out DEST` from DEST/runs either way). Runs already in DEST/runs that
the sweep folder lacks are kept, so a study run in pieces on different machines can be published in pieces.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

from dit_train.study import paired_report, report
from dit_train.study import run as run_study
from dit_train.runs.atomic_io import atomic_write_bytes, refuse_links_on_the_way
from dit_train.config.errors import ConfigError
from dit_train.runs.json_file import DamagedJSONFile
from dit_train.study.record import read_study

RECORDS = ("config.yaml", "metrics.jsonl", "summary.json", "run_info.json")


def publish(sweep_dir: str, dest: str, finished_only: bool = False) -> int:
    runs_dir = os.path.join(dest, "runs")
    copies = []
    for root, dirs, files in os.walk(sweep_dir):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in ("checkpoints", "samples"))
        if "config.yaml" not in files or "metrics.jsonl" not in files:
            continue
        if finished_only and "summary.json" not in files:  # a run still going (or stopped before its end)
            continue
        target = os.path.join(runs_dir, os.path.relpath(root, sweep_dir))
        copies += [(os.path.join(root, name), os.path.join(target, name)) for name in RECORDS if name in files]
    study = os.path.join(sweep_dir, "study.json")
    if not copies:  # nothing to publish: the caller says so, and nothing is written
        return 0
    for source, target in copies + [(study, os.path.join(runs_dir, "study.json"))]:  # before anything is copied
        refuse_unless_regular(source)
        refuse_links_on_the_way(dest, target, "publishing")
    for source, target in copies:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.copy2(source, target)
    merge_study_record(study, os.path.join(runs_dir, "study.json"))
    return len({os.path.dirname(target) for _, target in copies})


def refuse_unless_regular(path: str) -> None:
    """A sweep from elsewhere is published only from regular files of its own: a record that is a symbolic link
    copied the file it points at (`metrics.jsonl -> ~/.ssh/id_rsa`) into the folder meant to be committed, and a
    FIFO hung the copy. A missing file is skipped by the caller."""
    if os.path.islink(path):
        raise ConfigError(f"{path} is a symbolic link (to {os.readlink(path)}): a run record is published only as a "
                          f"regular file of the sweep (a link would copy a file from elsewhere); replace it by the "
                          f"file itself or remove it")
    if os.path.exists(path) and not os.path.isfile(path):
        raise ConfigError(f"{path} is not a regular file (a FIFO, socket, device or folder): a run record is "
                          f"published only as a regular file of the sweep; remove it")


def merge_study_record(src: str, dst: str) -> None:
    """The sweep's study.json, keeping the commands already published (another piece of the same study) and the
    published banner (report.banner)."""
    if not os.path.exists(src):
        return
    record = read_study(src)
    published = read_study_record(os.path.dirname(dst))
    if published.get("banner"):
        record["banner"] = published["banner"]
    calls = run_study.previous_invocations(os.path.dirname(dst)) + run_study.previous_invocations(os.path.dirname(src))
    unique = []
    for c in calls:
        if c not in unique:
            unique.append(c)
    record["invocations"] = unique
    atomic_write_bytes(json.dumps(record, indent=2).encode(), dst)


def read_study_record(folder: str) -> dict:
    path = os.path.join(folder, "study.json")
    if not os.path.exists(path):
        return {}
    return read_study(path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="dit-publish-study", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("sweep_dir")
    p.add_argument("dest")
    p.add_argument("--finished-only", action="store_true",
                   help="only runs with a summary.json (finished with their end-of-run evaluation): a study published "
                        "in pieces, to be continued with dit-study --records DEST/runs")
    args = p.parse_args(argv)
    if not os.path.isdir(args.sweep_dir):
        print(f"error: sweep folder {args.sweep_dir!r} does not exist", file=sys.stderr)
        return 2
    try:
        n = publish(args.sweep_dir, args.dest, args.finished_only)
        if n == 0:
            print(f"error: no run folders (config.yaml + metrics.jsonl) under {args.sweep_dir!r}", file=sys.stderr)
            return 2
        runs = os.path.join(args.dest, "runs")
        if "lr_selection" in read_study_record(runs):  # a two-phase study: paired differences at the selected lrs
            paired_report.build(runs, args.dest)
        else:
            report.build_report(runs, args.dest)
    except (ConfigError, DamagedJSONFile) as e:  # a damaged record, a two-phase study whose scan is unfinished
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"copied {n} run records to {os.path.join(args.dest, 'runs')}; wrote {os.path.join(args.dest, 'report.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
