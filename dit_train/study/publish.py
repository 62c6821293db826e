"""Copy a sweep's run records (no checkpoints, samples or logs) to a folder that can be committed, then build
the report there — so a published report sits next to the exact files its numbers come from.

    dit-publish-study sweeps/scaling_study_cpu docs/results/scaling_study_cpu

Writes DEST/runs/<run>/{config.yaml, metrics.jsonl, summary.json, run_info.json} and DEST/runs/study.json,
then DEST/report.md: dit-paired-report's for a two-phase study (study.json with an lr_selection), else
dit-report's with its plots (`--out DEST` from DEST/runs either way). Runs already in DEST/runs that
the sweep folder lacks are kept, so a study run in pieces on different machines can be published in pieces; a
published run that is finished (summary.json at its train.steps) is kept, with a printed line, when the sweep's copy
of it is not. A destination holds one study: a sweep of another experiment is refused, and so is a plain
multirun folder (no study.json) into a study's destination, or a study into one of plain runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from dit_train.study import paired_report, report
from dit_train.study import run as run_study
from dit_train.runs.atomic_io import (atomic_copy, atomic_write_bytes, describe_os_error, refuse_links_on_the_way,
                                     remove_dead_temp_files)
from dit_train.config.errors import ConfigError
from dit_train.runs.json_file import DamagedJSONFile, read_json, read_yaml, refuse_unless_regular
from dit_train.study.record import (RECORD_MAX_BYTES, finished_by_summary, planned_steps, read_study,
                                    summary_step_count)
from dit_train.trainer.preemption import ctrl_c_exits
from dit_train.plain_text import print_error

RECORDS = ("config.yaml", "metrics.jsonl", "summary.json", "run_info.json")


def publish(sweep_dir: str, dest: str, finished_only: bool = False) -> int:
    """Copy the sweep's run records into DEST/runs; the number of run folders copied. Everything is checked before
    anything is written: a failure then leaves every published file whole, old or new (each is copied through a temp
    name and a rename), study.json and report.md written last."""
    runs_dir = os.path.join(dest, "runs")
    refuse_overlap(sweep_dir, runs_dir)
    study = os.path.join(sweep_dir, "study.json")
    refuse_unless_regular(study)
    refuse_another_study(study, runs_dir)
    copies, stale, kept = [], [], []
    for root, dirs, files in os.walk(sweep_dir):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in ("checkpoints", "samples"))
        if "config.yaml" not in files or "metrics.jsonl" not in files:
            continue
        if finished_only and "summary.json" not in files:  # a run still going (or stopped before its end)
            continue
        target = os.path.join(runs_dir, os.path.relpath(root, sweep_dir))
        if not run_finished(root) and run_finished(target, published=dest):
            kept.append(target)  # an unfinished copy never replaces a finished published run
            continue
        copies += [(os.path.join(root, name), os.path.join(target, name)) for name in RECORDS if name in files]
        # a summary.json of an earlier, unfinished copy would make the new records read finished
        stale += [os.path.join(target, name) for name in RECORDS if name not in files
                  and os.path.lexists(os.path.join(target, name))]
    for target in kept:
        print(f"kept {target}: it is finished there and the sweep's copy is not (no summary.json at its train.steps)")
    if not copies:  # nothing to publish: the caller says so, and nothing is written
        return 0
    check_sweep(sweep_dir, study)
    for source, target in copies + [(study, os.path.join(runs_dir, "study.json"))]:  # before anything is copied
        refuse_unless_regular(source)
        refuse_links_on_the_way(dest, target, "publishing")
        if os.path.exists(source) and os.path.getsize(source) > RECORD_MAX_BYTES:
            raise ConfigError(f"{source} is {os.path.getsize(source):,} bytes, more than any run record "
                              f"({RECORD_MAX_BYTES:,} bytes: 400,000 steps logged every step): not published; move it "
                              f"out of the sweep")
    for path in stale:
        refuse_links_on_the_way(dest, path, "publishing")
    for source, target in copies:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        remove_dead_temp_files(os.path.dirname(target), RECORDS)
        atomic_copy(source, target, RECORD_MAX_BYTES)
    for path in stale:
        os.remove(path)
    merge_study_record(study, os.path.join(runs_dir, "study.json"))
    return len({os.path.dirname(target) for _, target in copies})


def check_sweep(sweep_dir: str, study: str) -> None:
    """What the report would refuse in the sweep's own records (a run folder copied twice, a run labelled in
    study.json as another optimizer, paired runs of different lengths), refused before anything is copied rather
    than after."""
    report.find_runs(sweep_dir)
    record = read_study(study) if os.path.exists(study) else {}
    if record.get("lr_selection"):
        paired_report.checked_runs(sweep_dir, record)


def run_finished(folder: str, published: str | None = None) -> bool:
    """dit-study's rule (record.finished_by_summary): a summary.json at config.yaml's train.steps. A published run
    folder (`published`: the destination) is read only through regular files."""
    summary, config = os.path.join(folder, "summary.json"), os.path.join(folder, "config.yaml")
    for path in (summary, config):
        refuse_unless_regular(path) if published is None else refuse_links_on_the_way(published, path, "publishing")
    if not os.path.isfile(summary):
        return False
    cfg = read_yaml(config) if os.path.isfile(config) else None
    return finished_by_summary(summary_step_count(read_json(summary)), planned_steps(cfg))


def refuse_overlap(sweep_dir: str, runs_dir: str) -> None:
    """The sweep folder is not DEST/runs, nor inside it or around it (`dit-publish-study X/runs X` copied each file
    onto itself: shutil.SameFileError)."""
    a, b = os.path.realpath(sweep_dir), os.path.realpath(runs_dir)
    if a == b or a.startswith(b + os.sep) or b.startswith(a + os.sep):
        raise ConfigError(f"the sweep folder {sweep_dir!r} is {runs_dir!r} (or holds it, or lies inside it): "
                          f"dit-publish-study copies a sweep into DEST/runs; give a DEST whose runs folder is "
                          f"elsewhere")


def refuse_another_study(study: str, runs_dir: str) -> None:
    """A destination holds one study: another experiment published into it replaced its study.json and mixed the
    two studies' runs in one report; so did another design of the same experiment (study.json's `design`). A sweep
    without a study.json (a plain multirun folder) is no piece of a published study, nor a study a piece of
    published plain runs: either mix is refused before anything is copied (the experiment check below needs a
    study.json on both sides)."""
    sweep = os.path.dirname(study)
    if not os.path.exists(study):
        if os.path.exists(os.path.join(runs_dir, "study.json")):
            raise ConfigError(f"{runs_dir}/study.json is the record of "
                              f"{read_study_record(runs_dir).get('experiment', 'a study')!r} and {sweep} has no "
                              f"study.json (a plain multirun folder, not a piece of that study): publish it into its "
                              f"own folder")
        return
    if not os.path.exists(os.path.join(runs_dir, "study.json")) and holds_runs(runs_dir):
        raise ConfigError(f"{runs_dir} holds run records without a study.json (published from a plain multirun "
                          f"folder) and {study} is a study's record: one destination holds one study; publish it into "
                          f"its own folder")
    there, here = read_study_record(runs_dir), read_study(study)
    published, new = there.get("experiment"), here.get("experiment")
    if published is not None and new is not None and published != new:
        raise ConfigError(f"{runs_dir}/study.json is the record of {published!r} and {study} of {new!r}: one "
                          f"destination holds one study; publish {new!r} into its own folder (valid here: a sweep "
                          f"of {published!r})")
    change = run_study.shared_design_change(there["design"], here["design"]) if (
        isinstance(there.get("design"), dict) and isinstance(here.get("design"), dict)) else None
    if change:  # pieces of one study are of one design (dit-study refuses a changed one in one sweep)
        key, was, now = change
        raise ConfigError(f"{study}: its study's design differs from the one published in {runs_dir}/study.json: "
                          f"{key} is {now!r} here, {was!r} there; publish a changed design into its own folder")


def holds_runs(runs_dir: str) -> bool:
    """A run folder (config.yaml) anywhere under runs_dir."""
    return any("config.yaml" in files for _, _, files in os.walk(runs_dir))


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
    remove_dead_temp_files(os.path.dirname(dst), ("study.json",))
    atomic_write_bytes(json.dumps(record, indent=2).encode(), dst)


def read_study_record(folder: str) -> dict:
    path = os.path.join(folder, "study.json")
    if not os.path.exists(path):
        return {}
    return read_study(path)


@ctrl_c_exits("dit-publish-study: interrupted; each published file is whole, old or new: rerun the same command")
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
        print_error(f"sweep folder {args.sweep_dir!r} does not exist")
        return 2
    try:
        n = publish(args.sweep_dir, args.dest, args.finished_only)
        if n == 0:
            print_error(f"no run folders (config.yaml + metrics.jsonl) to publish under {args.sweep_dir!r}")
            return 2
        runs = os.path.join(args.dest, "runs")
        if "lr_selection" in read_study_record(runs):  # a two-phase study: paired differences at the selected lrs
            paired_report.build(runs, args.dest)
        else:
            report.build_report(runs, args.dest)
    except (ConfigError, DamagedJSONFile) as e:  # a damaged record, a two-phase study whose scan is unfinished
        print_error(str(e))
        return 2
    except OSError as e:  # a read-only destination, a full disk: one line; each published file is whole
        print_error(describe_os_error(e))
        return 2
    print(f"copied {n} run records to {os.path.join(args.dest, 'runs')}; wrote {os.path.join(args.dest, 'report.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
