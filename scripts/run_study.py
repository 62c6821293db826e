#!/usr/bin/env python
"""Run a study grid (conf/experiment/<name>.yaml, its `study:` node) as Hydra multiruns, skipping finished runs.

    python scripts/run_study.py scaling_study_cpu                       # the CPU study, on this machine
    python scripts/run_study.py scaling_study launcher=slurm data.root=/data/latents eval.encoder_path=/w/dinov2
    python scripts/run_study.py scaling_study_cpu --dry-run            # print the commands only
    python scripts/run_study.py scaling_study_cpu --models dit_xs      # one size now, the rest later

The grid is models x optimizers x seeds, with periodic_rowwise expanded over study.K (and every optimizer over
study.lr where a study scans learning rates, or each at its own study.lr.<optimizer> where a study tunes them).
Each run's folder is <sweep_dir>/<sorted overrides> (Hydra's override_dirname), so rerunning finds finished runs
(a checkpoint at the run's train.steps; a summary alone proves nothing) and skips them, and continues interrupted
ones from their last checkpoint (the experiments set train.resume=auto): a study can be completed in pieces. One
`python -m dit_train --multirun` per (model, optimizer[, K, lr]) with the pending seeds, so a Slurm job's shape
follows its model.
Then: python scripts/report.py <sweep_dir>.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from omegaconf import OmegaConf

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from dit_train.atomic_io import atomic_write_bytes  # noqa: E402
from dit_train.checkpoint import newest_step  # noqa: E402
from dit_train.run_info import git_commit  # noqa: E402

EXPERIMENTS = os.path.join(ROOT, "dit_train", "conf", "experiment")


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


def expand(study, extra: list[str], exclude_keys: list[str]) -> list[dict]:
    """models x optimizers (periodic_rowwise x study.K) x learning_rates() x seeds."""
    runs = []
    for model in study.models:
        for opt in study.optimizers:
            for K in (list(study.K) if opt == "periodic_rowwise" else [None]):
                for lr in learning_rates(study, opt, K):
                    for seed in study.seeds:
                        overrides = [f"model={model}", f"optimizer={opt}", f"seed={seed}"]
                        if K is not None:
                            overrides.append(f"optimizer.K={K}")
                        if lr is not None:
                            overrides.append(f"optimizer.lr={lr}")
                        runs.append({"name": run_name(overrides + extra, exclude_keys), "model": model,
                                     "optimizer": opt, "K": K, "lr": lr, "seed": seed, "overrides": overrides})
    return runs


def load_experiment(name: str, overrides: list[str] = ()):
    """The experiment composed as the trainer sees it (its defaults, e.g. another experiment it extends)."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=os.path.join(ROOT, "dit_train", "conf"), version_base="1.3"):
        return compose(config_name="config", overrides=[f"experiment={name}", *overrides], return_hydra_config=True)


def finished(run_dir: str, steps: int) -> bool:
    """A run is done when its newest complete checkpoint is at its train.steps (not when a summary exists: an
    extended run keeps an old one until it is overwritten)."""
    return os.path.isdir(run_dir) and newest_step(run_dir) >= steps


def previous_invocations(sweep_dir: str) -> list[dict]:
    """A study completed in pieces keeps every command and commit that ran it (older files: their one command)."""
    path = os.path.join(sweep_dir, "study.json")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        old = json.load(f)
    if "invocations" in old:
        return old["invocations"]
    return [{"command": old["command"], "git_commit": old.get("git_commit")}] if "command" in old else []


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("experiment", help="a file name in dit_train/conf/experiment/ (without .yaml)")
    p.add_argument("overrides", nargs="*", help="Hydra overrides for every run (launcher=slurm, data.root=...)")
    p.add_argument("--sweep-dir", default=None, help="default: sweeps/<study.name>")
    p.add_argument("--models", default=None,
                   help="comma-separated subset of study.models to run now (the report still lists the others)")
    p.add_argument("--dry-run", action="store_true")
    args = p.parse_intermixed_args(argv)
    path = os.path.join(EXPERIMENTS, f"{args.experiment}.yaml")
    if not os.path.exists(path):
        valid = sorted(f[:-5] for f in os.listdir(EXPERIMENTS) if f.endswith(".yaml"))
        print(f"error: experiment {args.experiment!r} does not exist; valid: {', '.join(valid)}", file=sys.stderr)
        return 2
    exp = load_experiment(args.experiment)
    study = exp.study
    exclude = list(OmegaConf.select(exp, "hydra.job.config.override_dirname.exclude_keys") or [])
    sweep_dir = os.path.abspath(args.sweep_dir or os.path.join("sweeps", study.name))
    try:
        runs = expand(study, args.overrides, exclude)
    except ValueError as e:
        print(f"error: {args.experiment}: {e}", file=sys.stderr)
        return 2
    os.makedirs(sweep_dir, exist_ok=True)
    call = {"command": " ".join(["python scripts/run_study.py", *(sys.argv[1:] if argv is None else argv)]),
            "git_commit": git_commit(ROOT), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    record = {"experiment": args.experiment, **call, "notes": study.get("notes", ""),
              "invocations": previous_invocations(sweep_dir) + ([] if args.dry_run else [call]),
              "runs": [{k: v for k, v in r.items() if k != "overrides"} for r in runs]}
    # atomic: the record of a half-finished study must survive a crash mid-write
    atomic_write_bytes(json.dumps(record, indent=2).encode(), os.path.join(sweep_dir, "study.json"))

    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        groups.setdefault((r["model"], r["optimizer"], r["K"], r["lr"]), []).append(r)
    failures = 0
    only = set(args.models.split(",")) if args.models else None
    if only and not only <= set(study.models):
        print(f"error: --models {args.models!r} not in study.models {list(study.models)}", file=sys.stderr)
        return 2
    for (model, opt, K, lr), members in groups.items():
        if only and model not in only:
            continue
        fixed = [o for o in members[0]["overrides"] if not o.startswith("seed=")]
        steps = load_experiment(args.experiment, [*fixed, *args.overrides]).train.steps
        pending = [r for r in members if not finished(os.path.join(sweep_dir, r["name"]), steps)]
        label = f"{model} {opt}{'' if K is None else f' K={K}'}{'' if lr is None else f' lr={lr}'}"
        if not pending:
            print(f"[study] {label}: all seeds finished, skipping")
            continue
        # the group's own overrides (model, optimizer, K, lr), all seeds still to run in one multirun
        cmd = [sys.executable, "-m", "dit_train", "--multirun", f"experiment={args.experiment}", *fixed,
               "seed=" + ",".join(str(r["seed"]) for r in pending), f"hydra.sweep.dir={sweep_dir}", *args.overrides]
        print("[study]", " ".join(cmd[1:]), flush=True)
        if not args.dry_run:
            failures += subprocess.run(cmd, cwd=ROOT).returncode != 0
    if failures:
        print(f"[study] {failures} group(s) failed; rerun the same command to retry them (finished runs are kept)")
    print(f"[study] report: python scripts/report.py {sweep_dir}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
