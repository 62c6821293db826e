"""Run a study grid (conf/experiment/<name>.yaml, its `study:` node) as Hydra multiruns, skipping finished runs.

    dit-study scaling_study_cpu                    # the CPU study, on this machine
    dit-study scaling_study launcher=slurm data.root=/data/latents eval.encoder_path=/w/dinov2
    dit-study scaling_study_cpu --dry-run          # print the commands only
    dit-study scaling_study_cpu --models dit_xs    # one size now, the rest later
    dit-study mine --config-dir DIR                # DIR/experiment/mine.yaml, a study of your own

The grid is models x optimizers x seeds, with periodic_rowwise expanded over study.K, the RowNorm optimizers over
study.rownorm_scale when given, every variant over study.axes when given (a mapping of any other config key to its
values, e.g. {model.qk_norm: [true, false]}: each combination is its own variant), and every optimizer over study.lr
where a study scans learning rates, or each at its own study.lr.<optimizer> where a study tunes them. A study with study.lr_scan runs in two phases: its selection seeds
at each value of the optimizer's scan (grown beyond an end where the best value lies by the grid's own spacing at
that end, up to study.lr_scan_extend times per end), then its evaluation seeds at the value with the lowest final
validation loss, averaged over the selection seeds (the choice, every scanned loss, any growth and the selection
seeds are recorded in study.json). The selection seeds are study.selection_seeds, never among study.seeds, which are
all evaluated; without study.selection_seeds (the older protocol) the first of study.seeds selects and the rest
are evaluated. study.common_lr adds a third phase ("common"): the evaluation seeds of every variant at one learning
rate shared by the variants of the same model and axes, so that a comparison at equal lr sits beside the one at each
variant's own lr: a number (stated in advance), or `lowest_selected` (the lowest of those variants' selected values,
once all of them are selected). A run of this phase that is also a "seeds" run (the same overrides) runs once.
Each run's folder is <sweep_dir>/<sorted overrides> (Hydra's override_dirname), so rerunning finds finished runs
(a checkpoint at the run's train.steps; a summary alone proves nothing) and skips them, and continues interrupted
ones from their last checkpoint (the experiments set train.resume=auto): a study can be completed in pieces. One
`python -m dit_train --multirun` per (model, optimizer[, K, scale, lr]) with the pending seeds, so a Slurm job's shape
follows its model. A trainer stopped by a signal (scancel, Ctrl-C, `kill` of this runner: passed on) checkpoints
and the study stops with its exit code (75, 130) instead of starting the next group; rerun to continue.
Then: dit-report <sweep_dir>.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import signal
import subprocess
import sys
import time

from omegaconf import OmegaConf

from dit_train.config import override_text
from dit_train.config.files import CONF_DIR, group_options
from dit_train.config.errors import ConfigError
from dit_train.runs.absent import ABSENT
from dit_train.runs.atomic_io import atomic_write_bytes
from dit_train.runs.checkpoint import newest_step
from dit_train.runs.in_place_files import refuse_hydra_writes_outside
from dit_train.runs.json_file import read_json
from dit_train.study.keys import COMMON_RULES, check_study
from dit_train.study.record import is_int, read_study, summary_step_count
from dit_train.runs.provenance import CHECKOUT, git_commit
from dit_train.study.report import read_run_metrics
from dit_train.runs.lock import EXIT_RUN_FOLDER_BUSY
from dit_train.trainer.preemption import EXIT_INTERRUPTED, EXIT_PREEMPTED, SIGNALS, UNDER_STUDY_ENV, ctrl_c_exits
from dit_train.plain_text import print_error


class StudyStopped(Exception):
    """A group's trainer stopped on a signal (it checkpointed): the study stops too, with the trainer's code."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code



def run_name(overrides: list[str], exclude_keys: list[str]) -> str:
    """Hydra's override_dirname: the task overrides minus excluded keys, sorted, joined by commas."""
    keep = [o for o in overrides if o.split("=", 1)[0].lstrip("+~") not in exclude_keys
            and not o.startswith("hydra.")]
    return ",".join(sorted(keep))


def learning_rates(study, opt: str, K) -> list:
    """study.lr: absent (the experiment's optimizer.lr for all), a list (a scan: every optimizer at each value) or a
    mapping (one tuned value per optimizer; periodic_rowwise's may itself map K to a value)."""
    lr = study.get("lr")
    if lr is None:
        return [None]
    if not OmegaConf.is_dict(lr):
        return list(lr)
    if opt not in lr:
        raise ValueError(f"study.lr has no value for optimizer {opt!r}; it names {sorted(lr)}")
    value = lr[opt]
    if OmegaConf.is_dict(value):
        if K not in value:
            raise ValueError(f"study.lr.{opt} has no value for K={K}; it names K={sorted(value)}")
        value = value[K]
    return [value]


ROWNORM_OPTIMIZERS = ("periodic_rowwise", "rownorm")  # the optimizers that take optimizer.rownorm_scale
GRID_KEYS = ("model", "optimizer", "seed", "optimizer.K", "optimizer.rownorm_scale", "optimizer.lr")  # not axes
# not an axis either: the paired reports compare runs of one length (dit-paired-report and dit-publish-study refused
# such a sweep once all of its runs had run)
ONE_LENGTH = "train.steps"


def axis_combinations(study) -> list[dict]:
    """study.axes ({config key: [values]}) as every combination of its values, in the order given ([{}] without)."""
    axes = study.get("axes")
    if axes is None:
        return [{}]
    if not OmegaConf.is_dict(axes) or not all(OmegaConf.is_list(v) and len(v) for v in axes.values()):
        shown = OmegaConf.to_container(axes) if OmegaConf.is_config(axes) else axes
        raise ValueError(f"study.axes must map config keys to non-empty lists of values, e.g. "
                         f"{{model.qk_norm: [true, false]}}; got {shown!r}")
    taken = sorted({k.lstrip("+~") for k in axes} & set(GRID_KEYS))
    if taken:
        raise ValueError(f"study.axes may not name {taken}: the study's own keys set them (models, optimizers, K, "
                         f"rownorm_scale, seeds, lr_scan)")
    if ONE_LENGTH in {k.lstrip("+~") for k in axes}:
        raise ValueError(f"study.axes may not name {ONE_LENGTH}: a study's runs are of one length (its reports "
                         f"compare runs of one length, and refuse a sweep of several); run one study per horizon, "
                         f"each in its own --sweep-dir (train.steps=N on the command line)")
    combos = [{}]
    for key, values in axes.items():
        combos = [{**c, key: v} for c in combos for v in values]
    return combos


def override_value(v) -> str:
    """A value as Hydra's override_dirname writes it, so the run folder is found again: a yaml true is `True` there
    (Hydra reads `True` back as a boolean); a string as override_text writes it, so that one holding `,`, `=`, a
    space or a quote (a path) is one value to Hydra, not a sweep or a syntax error."""
    return override_text.override_value(v) if isinstance(v, str) else str(v)


def variants(study) -> list[dict]:
    """models x optimizers, periodic_rowwise x study.K, the RowNorm optimizers x study.rownorm_scale (when given), and
    every one of them x the combinations of study.axes (when given; then the variant has "axes")."""
    out = []
    for model in study.models:
        for opt in study.optimizers:
            for K in (list(study.K) if opt == "periodic_rowwise" else [None]):
                scales = list(study.get("rownorm_scale") or [None]) if opt in ROWNORM_OPTIMIZERS else [None]
                for scale in scales:
                    for axes in axis_combinations(study):
                        v = {"model": model, "optimizer": opt, "K": K, "scale": scale}
                        out.append({**v, "axes": axes} if axes else v)
    return out


def axes_label(v: dict) -> str:
    """'model.qk_norm=False' for a variant of study.axes ('' without)."""
    return " ".join(f"{k}={override_value(x)}" for k, x in (v.get("axes") or {}).items())


def variant_label(v: dict) -> str:
    return " ".join([v["model"], v["optimizer"], *([f"K={v['K']}"] if v["K"] is not None else []),
                     *([f"rownorm_scale={v['scale']}"] if v["scale"] is not None else []),
                     *([axes_label(v)] if v.get("axes") else [])])


def make_run(v: dict, lr, seed, extra: list[str], exclude_keys: list[str], phase: str = "") -> dict:
    overrides = [f"model={v['model']}", f"optimizer={v['optimizer']}", f"seed={seed}"]
    if v["K"] is not None:
        overrides.append(f"optimizer.K={v['K']}")
    if v["scale"] is not None:
        overrides.append(f"optimizer.rownorm_scale={v['scale']}")
    if lr is not None:
        overrides.append(f"optimizer.lr={lr}")
    overrides += [f"{k}={override_value(x)}" for k, x in (v.get("axes") or {}).items()]
    run = {"name": run_name(overrides + extra, exclude_keys), **v, "lr": lr, "seed": seed, "overrides": overrides}
    return {**run, "phase": phase} if phase else run


def scan_values(study, opt: str) -> list:
    values = study.lr_scan.get(opt)
    if values is None:
        raise ValueError(f"study.lr_scan has no values for optimizer {opt!r}; it names {sorted(study.lr_scan)}")
    return list(values)


def scan_seeds(study) -> tuple[list, list]:
    """(selection seeds, evaluation seeds) of a two-phase study."""
    if study.get("selection_seeds") is None:
        return [study.seeds[0]], list(study.seeds[1:])
    chooser, evaluated = list(study.selection_seeds), list(study.seeds)
    shared = sorted(set(chooser) & set(evaluated))
    if shared or not chooser:
        raise ValueError(f"study.selection_seeds {chooser} must be non-empty and share no seed with study.seeds "
                         f"{evaluated} (shared: {shared}): a seed that chose the lr is never evaluated")
    return chooser, evaluated


def expand(study, extra: list[str], exclude_keys: list[str], selected: dict | None = None,
           extended: dict | None = None, common: dict | None = None) -> list[dict]:
    """Every run of the study. With study.lr_scan (a per-optimizer list of values) the study has two phases: the
    selection seeds at every value of the optimizer's scan ("scan"; `extended` maps a variant label to the values its
    scan grew by, see select_learning_rates), then the evaluation seeds at the value the scan selected ("seeds";
    `selected` maps a variant label to that value, and a variant not yet selected has no seed runs); and with
    study.common_lr the evaluation seeds at the shared value (`common`, see common_learning_rates) too ("common")."""
    runs = []
    for v in variants(study):
        if study.get("lr_scan") is not None:
            chooser, rest = scan_seeds(study)
            values = scan_values(study, v["optimizer"]) + list((extended or {}).get(variant_label(v), []))
            runs += [make_run(v, lr, s, extra, exclude_keys, "scan") for lr in sorted(values) for s in chooser]
            chosen = (selected or {}).get(variant_label(v))
            if chosen is not None:
                runs += [make_run(v, chosen, s, extra, exclude_keys, "seeds") for s in rest]
            shared = (common or {}).get(variant_label(v))
            if shared is not None:
                runs += [make_run(v, shared, s, extra, exclude_keys, "common") for s in rest]
            continue
        for lr in learning_rates(study, v["optimizer"], v["K"]):
            runs += [make_run(v, lr, seed, extra, exclude_keys) for seed in study.seeds]
    return runs


def final_val_loss(run_dir: str, steps: int) -> float | None:
    """The validation loss logged at the run's last step (None if the run has not logged it)."""
    rows = read_run_metrics(os.path.join(run_dir, "metrics.jsonl")).evals  # the rows with val/loss, not every row
    return next((float(r["val/loss"]) for r in rows if r.get("step") == steps and "val/loss" in r), None)


def select_learning_rates(study, sweep_dir: str, scan_runs: list[dict], steps_of,
                          records: str | None = None) -> tuple[dict, dict]:
    """For each variant whose scan runs have all finished: the value with the lowest final validation loss, the mean
    over the selection seeds (NaN and diverged runs lose) - unless it is an end of the scan and the scan may still
    grow on that side (at most study.lr_scan_extend values beyond each end of the configured grid, one step of the
    grid's spacing at that end at a time, the same rule for every optimizer): then the next value out is asked for
    instead. Returns ({variant label: {"lr": chosen, "val_loss": {lr: loss}}}, {variant label: the value to add to
    its scan})."""
    by_variant: dict[str, list[dict]] = {}
    for r in scan_runs:
        by_variant.setdefault(variant_label(r), []).append(r)
    allowed = int(study.get("lr_scan_extend") or 0)
    chosen_lrs, more = {}, {}
    for label, members in by_variant.items():
        per_seed: dict = {}
        for r in members:
            steps = steps_of(r)
            if not done(sweep_dir, records, r["name"], steps):
                break
            run_dir = run_folder(sweep_dir, records, r["name"], steps)
            loss = final_val_loss(run_dir, steps)
            per_seed.setdefault(r["lr"], []).append(loss if loss is not None and math.isfinite(loss) else math.inf)
        else:
            losses = {lr: sum(v) / len(v) for lr, v in per_seed.items()}
            chosen = min(losses, key=lambda lr: (losses[lr], lr))
            grid = sorted(scan_values(study, members[0]["optimizer"]))
            low, high = (grid[1] / grid[0], grid[-1] / grid[-2]) if len(grid) > 1 else (2.0, 2.0)
            if chosen == min(losses) and sum(lr < min(grid) for lr in losses) < allowed and len(losses) > 1:
                more[label] = float(f"{chosen / low:.3g}")
            elif chosen == max(losses) and sum(lr > max(grid) for lr in losses) < allowed and len(losses) > 1:
                more[label] = float(f"{chosen * high:.3g}")
            else:
                chosen_lrs[label] = {"lr": chosen, "val_loss": {str(lr): v for lr, v in sorted(losses.items())}}
    return chosen_lrs, more


def common_learning_rates(study, selected: dict) -> dict:
    """{variant label: the lr of its "common" phase} from study.common_lr: a number is every variant's; with
    `lowest_selected`, the variants of one model and one combination of study.axes (the same optimizer's RowNorm
    scales, say) share the lowest of their selected lrs, once every one of them is selected ({} without the key)."""
    rule = study.get("common_lr")
    if rule is None:
        return {}
    if study.get("lr_scan") is None:
        raise ValueError("study.common_lr needs study.lr_scan: it is a phase after the lr selection")
    if isinstance(rule, bool) or not (rule in COMMON_RULES or isinstance(rule, (int, float)) and rule > 0):
        raise ValueError(f"study.common_lr must be a positive number or one of {list(COMMON_RULES)}; got {rule!r}")
    labels = [variant_label(v) for v in variants(study)]
    if rule != "lowest_selected":
        return {label: float(rule) for label in labels}
    groups: dict[tuple, list[str]] = {}
    for v in variants(study):
        groups.setdefault((v["model"], axes_label(v)), []).append(variant_label(v))
    out = {}
    for members in groups.values():
        if all(m in selected for m in members):
            lowest = min(selected[m] for m in members)
            out.update({m: lowest for m in members})
    return out


def load_experiment(name: str, overrides: list[str] = (), config_dir: str | None = None):
    """The experiment composed as the trainer sees it (its defaults, e.g. another experiment it extends), with the
    user's --config-dir where Hydra puts it, after ours."""
    from hydra import compose, initialize_config_dir

    from dit_train.config.search_path import searchpath_override

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose(config_name="config", overrides=[*searchpath_override(config_dir, []), f"experiment={name}",
                                                        *overrides], return_hydra_config=True)


def finished(run_dir: str, steps: int) -> bool:
    """A run is done when its newest complete checkpoint is at its train.steps AND its summary.json, written only
    after the end-of-run evaluation, says so (a checkpoint alone: the end-of-run work may have been stopped, and a
    rerun of the run does it; a summary alone: an extended run keeps an old one until it is overwritten)."""
    return (os.path.isdir(run_dir) and newest_step(run_dir) >= steps
            and summary_steps(run_dir, fix="delete it: rerunning the run (train.resume=auto) writes it again") >= steps)


def summary_steps(run_dir: str, fix: str) -> int:
    """The step count of run_dir's summary.json (written only after the end-of-run evaluation); -1 without one."""
    path = os.path.join(run_dir, "summary.json")
    if not os.path.isfile(path):
        return -1
    return summary_step_count(read_json(path, fix=fix))


def published(record_dir: str, steps: int) -> bool:
    """A published record (dit-publish-study: no checkpoints) is a finished run when its summary.json, written only
    after the end-of-run evaluation, is of its train.steps."""
    return (not os.path.isdir(os.path.join(record_dir, "checkpoints"))
            and summary_steps(record_dir, fix="restore it from the sweep it was published from") >= steps)


def run_folder(sweep_dir: str, records: str | None, name: str, steps: int) -> str:
    """Where run `name` lives: its sweep folder, unless it is not finished there and a published record of it is
    (a study continued on another machine or in a later session, from the records committed so far)."""
    here = os.path.join(sweep_dir, name)
    if records and not finished(here, steps) and published(os.path.join(records, name), steps):
        return os.path.join(records, name)
    return here


def done(sweep_dir: str, records: str | None, name: str, steps: int) -> bool:
    """Finished in the sweep folder, or published finished in `records`."""
    return finished(os.path.join(sweep_dir, name), steps) or bool(records) and published(os.path.join(records, name),
                                                                                          steps)


def previous_record(sweep_dir: str) -> dict:
    """The sweep's study.json ({} before the first invocation)."""
    path = os.path.join(sweep_dir, "study.json")
    if not os.path.exists(path):
        return {}
    return read_study(path, fix="restore it, or move it away to start the study's record afresh")


def previous_invocations(sweep_dir: str) -> list[dict]:
    """A study completed in pieces keeps every command and commit that ran it (older files: their one command)."""
    return invocations_of(previous_record(sweep_dir))


def invocations_of(old: dict) -> list[dict]:
    """The invocations a study.json records (older files: their one command)."""
    if "invocations" in old:
        return old["invocations"]
    return [{"command": old["command"], "git_commit": old.get("git_commit")}] if "command" in old else []


NOT_DESIGN = ("name", "notes")  # the default folder's name and free text: not part of what the study measures
PER_RUN = ("seed", "optimizer.lr", "run_dir")  # each run's own (the grid sets them), and its folder


def study_design(study, steps, cfg=None) -> dict:
    """What defines the study, as study.json records it at the first invocation: every key of `study:` (keys.py's
    StudyConfig) but its name and notes, the runs' train.steps, and (`cfg`: the experiment composed with the command
    line's overrides) every other key of the run config that defines its runs (run_config). Written to JSON and back,
    so that it compares equal to the record."""
    keys = {k: v for k, v in OmegaConf.to_container(study, resolve=True).items() if k not in NOT_DESIGN}
    design = {"study": keys, "train": {"steps": steps}}
    if cfg is not None:
        design["config"] = run_config(cfg)
    return json.loads(json.dumps(design, sort_keys=True))


def run_config(cfg) -> dict:
    """The composed run config as {dotted key: value}, but for what legitimately differs between the runs of one study
    or the machines that run them: the keys a resumed run may change (their schemas' resume=True: paths, cadence,
    logging, the parallel layout, `study:`, train.steps, recorded apart), each run's seed, lr and folder, and Hydra's
    own node (the launcher). A batch size, warm-up or data.root changed between two invocations ran one arm of a
    study under one and the other under another, and the report paired them."""
    import fnmatch

    from dit_train.config.schemas import may_change_on_resume
    from dit_train.runs.resume_policy import flatten

    tree = OmegaConf.to_container(cfg, resolve=False)
    tree.pop("hydra", None)
    tree.pop("run_dir", None)  # ${hydra:runtime.output_dir}: no value outside a job
    may_change = may_change_on_resume()
    return {k: v for k, v in flatten(OmegaConf.to_container(OmegaConf.create(tree), resolve=True)).items()
            if k not in PER_RUN and not any(fnmatch.fnmatchcase(k, p) for p in may_change)}


def design_sha256(design: dict) -> str:
    return hashlib.sha256(json.dumps(design, sort_keys=True).encode()).hexdigest()


def shared_design_change(recorded: dict, new: dict) -> tuple[str, object, object] | None:
    """design_change on the parts both designs record: a design recorded by an older dit-study (without `config`,
    the run config) is compared on what it has."""
    return design_change({k: v for k, v in recorded.items() if k in new},
                         {k: v for k, v in new.items() if k in recorded})


def design_change(old, new, key: str = "") -> tuple[str, object, object] | None:
    """The first (dotted key, recorded value, value now) where two designs differ; None where they are equal."""
    if isinstance(old, dict) and isinstance(new, dict):
        for k in sorted(set(old) | set(new)):
            found = design_change(old.get(k, ABSENT), new.get(k, ABSENT), f"{key}.{k}" if key else k)
            if found:
                return found
        return None
    return None if old == new else (key, old, new)



def selection_seeds_of(old: dict) -> set:
    """Every seed that chose a learning rate in this sweep, by its record: study.json's selection_seeds, the
    recorded design's, and the seeds of its scan runs (the older protocol, which recorded no selection seeds)."""
    seeds = set(old.get("selection_seeds") or [])
    seeds |= {r["seed"] for r in old.get("runs", []) if r.get("phase") == "scan"}
    design = old.get("design")
    if isinstance(design, dict) and isinstance(design.get("study"), dict):
        seeds |= {s for s in design["study"].get("selection_seeds") or [] if is_int(s)}
    return seeds


def check_design(old: dict, design: dict, study, path: str, experiment: str) -> None:
    """Refuse (ValueError, one line) an invocation whose design differs from the one study.json recorded: a
    pre-registered study changed mid-way (an added seed or lr value, another selection seed) leaves runs of two
    designs in one sweep, and its report would describe neither. Adding evaluation seeds is refused too: seeds
    added after results were seen are optional stopping. An evaluation seed that chose the lr in this sweep is
    refused with or without a recorded design (older records have none)."""
    new_dir = "run the changed design into a new --sweep-dir"
    if study.get("lr_scan") is not None:
        chose = sorted(selection_seeds_of(old) & set(scan_seeds(study)[1]))
        if chose:
            raise ValueError(f"{path}: evaluation seed(s) {chose} of study.seeds {list(study.seeds)} chose the "
                             f"learning rates in this sweep (study.json's selection runs): a seed that chose the lr "
                             f"is never evaluated; restore experiment {experiment}'s study, or {new_dir}")
    recorded = old.get("design")
    if recorded is None:  # an older record: what it says of the selection seeds
        chose = sorted(old.get("selection_seeds") or {r["seed"] for r in old.get("runs", [])
                                                       if r.get("phase") == "scan"})
        now = scan_seeds(study)[0] if study.get("lr_scan") is not None else []
        if chose and sorted(now) != chose:
            raise ValueError(f"{path}: selection seed(s) {chose} chose the learning rates in this sweep; "
                             f"study.selection_seeds is {now} now: restore experiment {experiment}'s study, or "
                             f"{new_dir}")
        return
    change = shared_design_change(recorded, design)
    if change:
        key, was, now = change
        what = (f"restore experiment {experiment}'s study" if not key.startswith("config.") else
                f"restore {key[len('config.'):]} in experiment {experiment} or the command line's overrides")
        raise ValueError(f"{path}: the study's design changed since study.json recorded it: {key} was {was!r}, is "
                         f"{now!r} now; a study's design (seeds, selection seeds, lr grids, optimizers, steps, every "
                         f"run config key a resume may not change) is fixed at its first invocation: {what}, or "
                         f"{new_dir}")


@ctrl_c_exits("dit-study: interrupted; finished runs and checkpoints are kept: rerun the same command to continue")
def main(argv=None) -> int:
    """The command: a damaged file of the sweep (a torn train_state.json, study.json) is one line, exit status 2."""
    try:
        return run_study(argv)
    except StudyStopped as e:  # a scancel or Ctrl-C must not move on to the next group's runs
        print(f"[study] stopped: {e}", file=sys.stderr)
        return e.exit_code
    except (FileNotFoundError, ValueError) as e:  # DamagedJSONFile and CheckpointError are ValueErrors
        print_error(str(e))
        return 2


def run_study(argv=None) -> int:
    p = argparse.ArgumentParser(prog="dit-study", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("experiment", help="a file name in dit_train/conf/experiment/ or DIR/experiment/ (without .yaml)")
    p.add_argument("overrides", nargs="*", help="Hydra overrides for every run (launcher=slurm, data.root=...)")
    p.add_argument("--sweep-dir", default=None, help="default: sweeps/<study.name>")
    p.add_argument("--models", default=None,
                   help="comma-separated subset of study.models to run now (the report still lists the others)")
    p.add_argument("--records", default=None,
                   help="a folder of published run records (dit-publish-study's DEST/runs): runs finished there are "
                        "not run again, so a study continues from what an earlier machine published")
    p.add_argument("--config-dir", "-cd", default=None,
                   help="your own config folder, as for dit-train: DIR/experiment/<name>.yaml is a study too")
    p.add_argument("--dry-run", action="store_true")
    args = p.parse_intermixed_args(argv)
    moved = next((o for o in args.overrides if placement_override(o)), None)
    if moved is not None:  # the runs would go where study.json does not look: no lr is ever selected
        print_error(f"{moved}: dit-study places each run in <sweep folder>/<its overrides> itself, where study.json "
                    f"finds it; give the sweep folder as --sweep-dir")
        return 2
    if args.config_dir is not None:
        if not os.path.isdir(args.config_dir):
            print_error(f"--config-dir {args.config_dir}: no such folder (it holds your own config groups, e.g. "
                        f"{os.path.join(args.config_dir, 'experiment', 'mine.yaml')})")
            return 2
        args.config_dir = os.path.abspath(args.config_dir)  # the runs start in the checkout
    valid = group_options("experiment", [args.config_dir] if args.config_dir else [])
    if args.experiment not in valid:
        print_error(f"experiment {args.experiment!r} does not exist; valid: {', '.join(valid)}")
        return 2
    exp = load_experiment(args.experiment, config_dir=args.config_dir)
    study = exp.get("study")
    if study is None:  # a single run's experiment (debug): was `study=None is not valid: expected a mapping ...`
        studies = [n for n in valid if load_experiment(n, config_dir=args.config_dir).get("study") is not None]
        print_error(f"experiment {args.experiment!r} is not a study (it has no study: grid; run it with "
                    f"{override_text.shell_command(['dit-train', 'experiment=' + args.experiment])}); "
                    f"studies: {', '.join(studies)}")
        return 2
    try:  # every key of study: by its declaration (keys.py), before anything is written or run
        check_study(OmegaConf.to_container(study, resolve=True) if OmegaConf.is_config(study) else study)
    except ValueError as e:
        print_error(f"{args.experiment}: {e}")
        return 2
    exclude = list(OmegaConf.select(exp, "hydra.job.config.override_dirname.exclude_keys") or [])
    sweep_dir = os.path.abspath(args.sweep_dir or os.path.join("sweeps", study.name))
    only = set(args.models.split(",")) if args.models else None
    if only and not only <= set(study.models):
        print_error(f"--models {args.models!r} not in study.models {list(study.models)}")
        return 2
    try:
        runs = expand(study, args.overrides, exclude)
        common_learning_rates(study, {})  # a bad study.common_lr is refused now, not after the scan
    except ValueError as e:
        print_error(f"{args.experiment}: {e}")
        return 2
    try:  # a sweep folder from elsewhere, before study.json is written (each run's dit-train checks it again)
        refuse_hydra_writes_outside(sweep_dir, "--sweep-dir")
    except ConfigError as e:
        print_error(str(e))
        return 2
    checked: set = set()
    steps_cache: dict[tuple, int] = {}
    # a bad override: one line before anything is written
    check_groups(runs, only, sweep_dir, args, checked, steps_cache)
    old = previous_record(sweep_dir)
    plain = load_experiment(args.experiment, args.overrides, args.config_dir) if args.overrides else exp
    design = study_design(study, plain.train.steps, plain)
    check_design(old, design, study, os.path.join(sweep_dir, "study.json"), args.experiment)
    if args.records:  # a study continued from its published records: the same design as theirs
        check_design(previous_record(args.records), design, study, os.path.join(args.records, "study.json"),
                     args.experiment)
    first_designed = old.get("design_first_invocation", 1)
    config_first = old.get("design_config_first_invocation", 1)
    if old and "design" not in old:  # a record from before dit-study kept the design (the published ones)
        first_designed = len(invocations_of(old)) + 1
        print(f"[study] {os.path.join(sweep_dir, 'study.json')} has no record of the study's design (written by "
              f"an older dit-study): {'a real run records' if args.dry_run else 'recording'} this invocation's "
              f"design; later invocations must match it")
    elif isinstance(old.get("design"), dict) and "config" not in old["design"]:  # a design of study: and steps only
        config_first = len(invocations_of(old)) + 1
        print(f"[study] {os.path.join(sweep_dir, 'study.json')} records the study's design without its run config "
              f"(written by an older dit-study): {'a real run records' if args.dry_run else 'recording'} this "
              f"invocation's run config into it; later invocations must match it")
    if not args.dry_run:  # a dry run prints the commands only
        os.makedirs(sweep_dir, exist_ok=True)
    call = {"command": override_text.shell_command(["dit-study", *(sys.argv[1:] if argv is None else argv)]),
            "git_commit": git_commit(CHECKOUT), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "design_sha256": design_sha256(design)}
    invocations = invocations_of(old) + [call]

    def steps_of(r: dict) -> int:
        fixed = steps_key(r)
        if fixed not in steps_cache:
            steps_cache[fixed] = load_experiment(args.experiment, [*fixed, *args.overrides],
                                                 args.config_dir).train.steps
        return steps_cache[fixed]

    def record(runs: list[dict], selection: dict | None = None, extended: dict | None = None,
               common: dict | None = None) -> None:
        if args.dry_run:  # the record of a study under way is left as it is
            return
        rec = {"experiment": args.experiment, **call, "notes": study.get("notes", ""), "design": design,
               **({"design_first_invocation": first_designed} if first_designed > 1 else {}),
               **({"design_config_first_invocation": config_first} if config_first > 1 else {}),
               "invocations": invocations, "runs": [{k: v for k, v in r.items() if k != "overrides"} for r in runs]}
        if study.get("lr_scan") is not None:
            rec["selection_seeds"] = scan_seeds(study)[0]
        if selection is not None:
            rec["lr_selection"] = selection
        if extended:
            rec["lr_scan_extended"] = extended
        if common:
            rec["common_lr"] = common
        # atomic: the record of a half-finished study must survive a crash mid-write
        atomic_write_bytes(json.dumps(rec, indent=2).encode(), os.path.join(sweep_dir, "study.json"))

    if study.get("lr_scan") is None:
        record(runs)
        failures = run_groups(runs, only, sweep_dir, steps_of, args)
    else:  # the scan (growing at an end where its best value lies), then the other seeds at the chosen values
        extended: dict[str, list] = {}
        failures = []
        while True:
            runs = expand(study, args.overrides, exclude, extended=extended)
            check_groups(runs, only, sweep_dir, args, checked, steps_cache)  # an added value's groups
            record(runs, extended=extended)
            failures += run_groups(runs, only, sweep_dir, steps_of, args)
            selection, more = ({}, {}) if args.dry_run else select_learning_rates(study, sweep_dir, runs, steps_of,
                                                                                    args.records)
            if not more:
                break
            for label, lr in more.items():
                print(f"[study] {label}: the best lr is at the end of its scan; adding lr={lr:g}")
                extended.setdefault(label, []).append(lr)
        for label, chosen in selection.items():
            print(f"[study] {label}: lr={chosen['lr']} selected (final val loss by lr: {chosen['val_loss']})")
            note = edge_note(label, chosen, study)
            if note:
                print(note)
        selected = {k: v["lr"] for k, v in selection.items()}
        common = common_learning_rates(study, selected)
        for label, lr in common.items():
            print(f"[study] {label}: common lr={lr}")
        runs = expand(study, args.overrides, exclude, selected, extended, common)
        check_groups(runs, only, sweep_dir, args, checked, steps_cache)
        record(runs, selection, extended, common)
        failures += run_groups([r for r in runs if r.get("phase") in ("seeds", "common")], only, sweep_dir,
                               steps_of, args)
        waiting = len(variants(study)) - len(selection)
        if waiting:
            print(f"[study] {waiting} variant(s) wait for their lr scan to finish before their other seeds run")
    refused = failures.count(2)  # the trainer's config check (exit 2): the same command would fail the same way
    if refused:
        print(f"[study] {refused} group(s) refused by the trainer's config check (exit 2, the error above): rerunning "
              f"the same command cannot fix that; fix the overrides or the experiment, then rerun")
    busy = failures.count(EXIT_RUN_FOLDER_BUSY)  # another process writes a run folder: waiting fixes that
    if busy:
        print(f"[study] {busy} group(s) stopped at a run folder in use by another process (exit "
              f"{EXIT_RUN_FOLDER_BUSY}, the error above): rerun the same command when it has finished")
    if len(failures) > refused + busy:
        print(f"[study] {len(failures) - refused - busy} group(s) failed; rerun the same command to retry them "
              f"(finished runs are kept)")
    report = "dit-paired-report" if study.get("lr_scan") is not None else "dit-report"
    print(f"[study] report: {override_text.shell_command([report, sweep_dir])}")
    return 1 if failures else 0


def groups_of(runs: list[dict], only) -> dict[tuple, list[dict]]:
    """The runs by (model, optimizer, K, RowNorm scale, axes, lr), each run once (a run listed in two phases runs
    once), without the models --models leaves for later."""
    groups: dict[tuple, dict[str, dict]] = {}
    for r in runs:
        if only and r["model"] not in only:
            continue
        key = (r["model"], r["optimizer"], r["K"], r["scale"], axes_label(r), r["lr"])
        groups.setdefault(key, {}).setdefault(r["name"], r)
    return {key: list(named.values()) for key, named in groups.items()}


def group_label(members: list[dict]) -> str:
    return variant_label(members[0]) + ("" if members[0]["lr"] is None else f" lr={members[0]['lr']}")


def trainer_command(members: list[dict], sweep_dir: str, args) -> list[str]:
    """The group's `python -m dit_train --multirun` for the seeds of `members`."""
    fixed = [o for o in members[0]["overrides"] if not o.startswith("seed=")]
    config_dir = ["--config-dir", args.config_dir] if args.config_dir else []
    return [sys.executable, "-m", "dit_train", *config_dir, "--multirun", f"experiment={args.experiment}", *fixed,
            "seed=" + ",".join(str(r["seed"]) for r in members),
            override_text.override("hydra.sweep.dir", sweep_dir), *args.overrides]  # `a=1,b 2`: one folder


def check_groups(runs: list[dict], only, sweep_dir: str, args, checked: set, steps_cache: dict) -> None:
    """Each group's trainer command line through the trainer's own check (a misspelled key, `train.steps=abc`), as
    one line (a ConfigError, exit 2) before study.json is written or a run starts: run by run it was a Hydra
    traceback after study.json recorded the command, or every group refused in turn and "rerun to retry". One job
    per group (its first seed; the seeds are integers, keys.check_study): its jobs differ in the seed alone, and each
    job costs a composition. The resume of each run is left to its trainer (it reads the run folder; a finished
    group is not started at all). `checked`: the groups checked already by this invocation; `steps_cache` gets each
    group's train.steps from its checked config (run_study's steps_of: no second composition)."""
    from dit_train.config.command_line import check_jobs

    for key, members in groups_of(runs, only).items():
        if key in checked:
            continue
        try:
            configs = check_jobs(trainer_command(members[:1], sweep_dir, args)[3:], decide_resume=False)
        except ConfigError as e:
            raise ConfigError(f"{e} (the runs of {group_label(members)})") from None
        checked.add(key)
        steps_cache[steps_key(members[0])] = configs[0].train.steps


def steps_key(r: dict) -> tuple:
    """The overrides that set a run's train.steps beside the user's: all of its own but its seed."""
    return tuple(o for o in r["overrides"] if not o.startswith("seed="))


PLACEMENT = ("hydra.sweep", "hydra.run.dir", "hydra.job.config.override_dirname")


def placement_override(override: str) -> bool:
    """An override that moves or renames the runs' folders (Hydra's sweep folder, subfolder or run folder, the
    folder names): dit-study sets those itself, and study.json names each run's folder by them."""
    k = override.split("=", 1)[0].lstrip("+~")
    return any(k == p or k.startswith(p + ".") for p in PLACEMENT)


def edge_note(label: str, chosen: dict, study) -> str | None:
    """One line where the selected lr is the lowest or highest value scanned and the scan grew no further beyond
    it (study.lr_scan_extend, default 0: never): the best lr may lie outside the grid."""
    scanned = sorted(float(lr) for lr in chosen["val_loss"])
    if len(scanned) < 2 or chosen["lr"] not in (scanned[0], scanned[-1]):
        return None
    end = "lowest" if chosen["lr"] == scanned[0] else "highest"
    allowed = int(study.get("lr_scan_extend") or 0)
    why = ("study.lr_scan_extend is 0, so the scan does not grow" if not allowed else
           f"the scan grew by study.lr_scan_extend={allowed} value(s) at that end, its limit")
    return (f"[study] {label}: the selected lr={chosen['lr']} is the {end} value scanned and {why}: the best lr may "
            f"lie beyond it (set study.lr_scan_extend in a new design to grow the scan at its ends)")


def run_groups(runs: list[dict], only, sweep_dir: str, steps_of, args) -> list[int]:
    """One `python -m dit_train --multirun` per (model, optimizer, K, RowNorm scale, axes, lr) with its pending seeds
    (a run listed in two phases runs once); returns the exit codes of the groups that failed."""
    failures = []
    for members in groups_of(runs, only).values():
        pending = [r for r in members if not done(sweep_dir, args.records, r["name"], steps_of(r))]
        label = group_label(members)
        if not pending:
            print(f"[study] {label}: all seeds finished, skipping")
            continue
        cmd = trainer_command(pending, sweep_dir, args)
        # as a user pastes it (cmd[0] is this interpreter's full path; the printed line had dropped it)
        print("[study]", override_text.shell_command(["python", *cmd[1:]]), flush=True)
        if not args.dry_run:
            code = run_trainer(cmd)
            if code in (EXIT_PREEMPTED, EXIT_INTERRUPTED):
                raise StudyStopped(f"{label}: the trainer stopped on a signal and checkpointed (exit {code}); "
                                   f"rerun the same command to resume it", code)
            if code < 0:  # SIGKILL (the OOM killer, kill -9): no checkpoint of the last steps, but no reason to go on
                raise StudyStopped(f"{label}: the trainer was killed by {signal.Signals(-code).name}; its last "
                                   f"checkpoint is kept: rerun the same command to resume from it", 128 - code)
            if code:
                failures.append(code)
    return failures


def run_trainer(cmd: list[str]) -> int:
    """The group's trainer process, with any stop signal sent to this runner alone (`kill PID`, a wrapper) passed
    on, so the trainer checkpoints instead of running on as an orphan; a second copy of a signal that reached both
    (Ctrl-C in the terminal) is only recorded by the trainer."""
    child = subprocess.Popen(cmd, cwd=CHECKOUT, env={**os.environ, UNDER_STUDY_ENV: "1"})
    previous = {s: signal.signal(s, lambda signum, _frame: child.send_signal(signum)) for s in SIGNALS}
    try:
        return child.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


if __name__ == "__main__":
    sys.exit(main())
