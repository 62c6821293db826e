#!/usr/bin/env python
"""The report of a paired-seed optimizer comparison (a study with study.lr_scan, e.g. optimizer_comparison_cpu):
differences against Muon and AdamW with 95% intervals over paired seeds and an equivalence test (TOST) at a margin —
reading run folders only.

    python scripts/paired_report.py SWEEP_DIR [--out FOLDER] [--margin 1.0]

Each optimizer variant is compared at the learning rate its scan selected (study.json's lr_selection: lowest final
validation loss over the selection seeds). The selection seeds (study.json's selection_seeds; in records from before
the runner wrote it, the seeds of its scan runs) chose the lr, so they are never evaluation rows: a study whose
selection seed also ran at the selected lr gets those rows in a separate, labelled section only.
A comparison pairs runs of the same seed (same initial weights, data order and noise), so seed-to-seed variation
common to both cancels:
    d_s = 100 (x_s(variant) - x_s(reference)) / x_s(reference)   per seed s, then mean(d) +- t(0.975, n-1) sd(d)/sqrt(n).
Equivalence at margin m (percent): two one-sided t tests at 5% each, i.e. the 90% interval mean(d) +- t(0.95, n-1)
sd(d)/sqrt(n) lies inside (-m, +m) -> "equivalent"; entirely above +m -> "worse"; entirely below -m -> "better";
otherwise "not shown equivalent".
Metrics: EMA validation velocity loss at steps 200/400/600 (the primary metric), final FD, steps and active time to
reach a target validation loss (the highest final value among the compared runs, so that every finished run reaches
it; linear between validation points), and optimizer time per
step averaged over every step (window means weighted by their step counts).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
from collections import defaultdict

import scipy.stats

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from report import Run, banner, fmt, provenance, read_run  # noqa: E402
from dit_train.runs.json_file import DamagedJSONFile, read_json  # noqa: E402
from run_study import variant_label  # noqa: E402  (the key of study.json's lr_selection)

VAL_STEPS = (200, 400, 600)
DEFAULT_MARGIN = 1.0  # percent: the equivalence margin of the TOST column


def interval(diffs: list[float], level: float = 0.95) -> tuple[float, float, float]:
    """(mean, low, high) of the two-sided t-interval of the mean at `level`; the bounds are NaN with fewer than two
    values."""
    diffs = [d for d in diffs if math.isfinite(d)]
    if not diffs:
        return math.nan, math.nan, math.nan
    m = statistics.mean(diffs)
    if len(diffs) < 2:
        return m, math.nan, math.nan
    half = scipy.stats.t.ppf(0.5 + level / 2, len(diffs) - 1) * statistics.stdev(diffs) / math.sqrt(len(diffs))
    return m, m - half, m + half


def equivalence(diffs: list[float], margin: float) -> tuple[float, float, str]:
    """TOST at `margin` (percent) and 5% per side: (low, high) of the 90% t-interval and the verdict."""
    _, lo, hi = interval(diffs, 0.90)
    if math.isnan(lo):
        return lo, hi, "—"
    if -margin < lo and hi < margin:
        return lo, hi, "equivalent"
    if lo >= margin:
        return lo, hi, "worse"
    if hi <= -margin:
        return lo, hi, "better"
    return lo, hi, "not shown equivalent"


def val_at_step(run: Run, step: int) -> float:
    return next((v for s, _, v in run.val_curve if s == step), math.nan)


def crossing(run: Run, target: float) -> tuple[float, float]:
    """(step, active seconds) at which the validation curve first reaches `target`, linear between validation points;
    NaN when it never does."""
    pts = [(0, 0.0, math.inf)] + sorted(run.val_curve)
    for (s0, a0, v0), (s1, a1, v1) in zip(pts, pts[1:]):
        if v1 <= target:
            if not math.isfinite(v0):  # reached at the first validation point: no earlier value to interpolate from
                return float(s1), a1
            f = (v0 - target) / (v0 - v1) if v0 != v1 else 1.0
            return s0 + f * (s1 - s0), a0 + f * (a1 - a0)
    return math.nan, math.nan


def label(r: dict) -> str:
    """A variant's name in the tables: 'periodic_rowwise K=3 (spectral)'."""
    return " ".join([r["optimizer"], *([f"K={r['K']}"] if r.get("K") is not None else [])]) + (
        f" ({r['scale']})" if r.get("scale") else "")


def metrics_of(run: Run, target: float) -> dict[str, float]:
    steps, secs = crossing(run, target)
    out = {f"val loss @{s}": val_at_step(run, s) for s in VAL_STEPS}
    fwd_bwd = run.phases.get("forward", math.nan) + run.phases.get("backward", math.nan)
    out.update({"final FD": run.fd_curve[-1][2] if run.fd_curve else math.nan, "steps to target": steps,
                "time to target (s)": secs, "optimizer s/step": run.optimizer_s,
                "optimizer / fwd+bwd": run.optimizer_s / fwd_bwd if fwd_bwd > 0 else math.nan})
    return out


def selection_seeds(study: dict) -> list[int]:
    """The seeds that chose the learning rates: study.json's selection_seeds, or (records from before the runner
    wrote it) the seeds of its scan runs."""
    if "selection_seeds" in study:
        return sorted(study["selection_seeds"])
    return sorted({r["seed"] for r in study["runs"] if r.get("phase") == "scan"})


def collect(sweep_dir: str, study: dict) -> tuple[dict, dict]:
    """({variant: {seed: Run}} at the selected lr, every seed, {variant: {lr: ([final val loss per selection seed],
    selected)}})."""
    selection = study.get("lr_selection") or {}
    chosen_lr = {key: sel["lr"] for key, sel in selection.items()}
    runs, scan = defaultdict(dict), defaultdict(dict)
    for r in study["runs"]:
        key = variant_label(r)
        folder = os.path.join(sweep_dir, r["name"])
        run = read_run(folder, r["name"]) if os.path.isdir(folder) else None
        selected = key in chosen_lr and r["lr"] == chosen_lr[key]
        if r.get("phase") == "scan":
            final = run.val_loss if run is not None and run.status == "finished" else math.nan
            scan[label(r)].setdefault(r["lr"], ([], selected))[0].append(final)
        if selected and run is not None and run.status == "finished":
            runs[label(r)][r["seed"]] = run
    return runs, scan


def without(runs: dict, seeds: list[int]) -> dict:
    return {variant: {s: r for s, r in group.items() if s not in seeds} for variant, group in runs.items()}


def target_of(runs: dict) -> float:
    """The highest final loss among the compared runs: every finished run reaches it, so every pair has a time to it
    (AdamW's mean final value, the obvious choice, is not reached by about half of AdamW's own seeds)."""
    finals = [r.val_loss for group in runs.values() for r in group.values() if math.isfinite(r.val_loss)]
    return max(finals) if finals else math.nan


def paired_rows(runs: dict, reference: str, target: float, margin: float) -> list[str]:
    rows = []
    ref = runs.get(reference, {})
    for variant in sorted(runs):
        if variant == reference:
            continue
        seeds = sorted(set(runs[variant]) & set(ref))
        if not seeds:
            continue
        a = {s: metrics_of(runs[variant][s], target) for s in seeds}
        b = {s: metrics_of(ref[s], target) for s in seeds}
        for metric in a[seeds[0]]:
            diffs = [100 * (a[s][metric] - b[s][metric]) / b[s][metric] for s in seeds]
            m, lo, hi = interval(diffs)
            lo90, hi90, equivalent = equivalence(diffs, margin)
            finite = [d for d in diffs if math.isfinite(d)]
            better = sum(d < 0 for d in finite)
            verdict = ("lower" if hi < 0 else "higher" if lo > 0 else "no difference resolved") if not math.isnan(lo) \
                else "—"
            rows.append(f"| {variant} | {metric} | {len(finite)} | {m:+.2f}% | {bounds(lo, hi)} | "
                        f"{better}/{len(finite)} | {verdict} | {bounds(lo90, hi90)} | {equivalent} |")
    return rows


def bounds(lo: float, hi: float) -> str:
    return "—" if math.isnan(lo) else f"[{lo:+.2f}, {hi:+.2f}]"


def paired_section(runs: dict, reference: str, margin: float, heading: str) -> list[str]:
    target = target_of(runs)
    return [heading,
            "Negative is better for every metric (lower loss, lower FD, fewer steps, less time). "
            f"The target validation loss is the highest final value among the compared runs, {target:.4f}, "
            "so every finished run reaches it (a pair without a time to it would be left out of that row; the "
            "n column counts the pairs). Equivalence: two one-sided t tests at 5% each against "
            f"±{margin:g}% (the 90% interval inside ±{margin:g}%: equivalent; entirely beyond +{margin:g}%: worse; "
            f"entirely beyond −{margin:g}%: better; otherwise not shown equivalent).",
            f"| variant | metric | n | mean difference | 95% interval | seeds lower | resolved | 90% interval | "
            f"equivalence at ±{margin:g}% |",
            "| --- | --- | ---: | ---: | --- | ---: | --- | --- | --- |", *paired_rows(runs, reference, target_of(runs),
                                                                          margin)]


def build(sweep_dir: str, out_dir: str | None, margin: float = DEFAULT_MARGIN) -> str:
    out_dir = out_dir or sweep_dir
    study = read_json(os.path.join(sweep_dir, "study.json"),
                      fix="restore it from a copy (scripts/run_study.py writes it)")
    if "lr_selection" not in study:
        raise SystemExit(f"error: {sweep_dir}/study.json has no lr_selection: not a two-phase study, or its lr scan "
                         f"has not finished (run: python scripts/run_study.py {study.get('experiment', '?')})")
    runs, scan = collect(sweep_dir, study)
    chosen_by = selection_seeds(study)
    evaluated = without(runs, chosen_by)
    eval_runs = [r for group in evaluated.values() for r in group.values()]
    seeds = sorted({r.seed for r in eval_runs})
    out_arg = "" if out_dir == sweep_dir else f" --out {out_dir}"
    margin_arg = "" if margin == DEFAULT_MARGIN else f" --margin {margin:g}"

    lines = [f"# Paired optimizer comparison: {study.get('experiment', '?')}", banner(study),
             f"Built by `python scripts/paired_report.py {sweep_dir}{out_arg}{margin_arg}` from {len(eval_runs)} "
             f"finished runs at the selected learning rates (evaluation seeds {_seeds(seeds)}). Selection "
             f"seed{'s' if len(chosen_by) > 1 else ''} {_seeds(chosen_by)} chose the learning rates and "
             f"{'are' if len(chosen_by) > 1 else 'is'} excluded from every evaluation row.",
             provenance(study, eval_runs), study.get("notes", ""),
             f"## Learning-rate scan (selection seed{'s' if len(chosen_by) > 1 else ''} {_seeds(chosen_by)}, final EMA "
             f"validation loss"
             f"{', mean over the seeds' if len(chosen_by) > 1 else ''}; * = selected, the lowest)",
             "| variant | lr | final val loss |", "| --- | ---: | ---: |"]
    for variant in sorted(scan):
        values = sorted(scan[variant].items())
        for i, (lr, (losses, selected)) in enumerate(values):
            edge = " (edge of the scan)" if selected and i in (0, len(values) - 1) else ""
            lines.append(f"| {variant} | {lr:g}{' *' if selected else ''}{edge} | {statistics.mean(losses):.4f} |")

    lines += [f"## Quality and cost at the selected learning rate (mean ± sd over evaluation seeds {_seeds(seeds)})",
              "| variant | lr | seeds | " + " | ".join(f"val loss @{s}" for s in VAL_STEPS)
              + " | final FD | optimizer ms/step | refresh steps timed |",
              ("| --- | ---: | ---: | " + "---: | " * (len(VAL_STEPS) + 3)).rstrip()]
    for variant in sorted(evaluated):
        group = list(evaluated[variant].values())
        if not group:
            continue
        refresh = sum(r.refresh_steps for r in group if math.isfinite(r.refresh_steps))
        timed = sum(r.timed_steps for r in group)
        lines.append(f"| {variant} | {group[0].lr:g} | {len(group)} | "
                     + " | ".join(fmt([val_at_step(r, s) for r in group]) for s in VAL_STEPS)
                     + f" | {fmt([r.fd_curve[-1][2] if r.fd_curve else math.nan for r in group])}"
                     + f" | {fmt([1e3 * r.optimizer_s for r in group], 3)} | {refresh:.0f} of {timed:.0f} |")

    for reference in ("muon", "adamw"):
        lines += paired_section(evaluated, reference, margin, f"## Paired differences against {reference}, evaluation "
                                f"seeds {_seeds(seeds)} (per seed, then the t-intervals of the mean)")
    every_seed = sorted({s for group in runs.values() for s in group})
    if set(chosen_by) & set(every_seed):
        lines += [f"## Including selection seed {_seeds(chosen_by)} (biased: the learning rates were chosen on it)",
                  "This study's selection seed also ran at the selected learning rates (the protocol before "
                  "selection seeds were kept out). Its rows are given only to compare with figures published from "
                  "them; the evaluation rows above are the ones to read."]
        for reference in ("muon", "adamw"):
            lines += paired_section(runs, reference, margin, f"### Against {reference}, seeds {_seeds(every_seed)} "
                                    "including the selection seed")
    lines += ["Optimizer times are means over every step of each run (refresh and RowNorm steps both counted), "
              "measured on a 2-core machine shared with other work: machine load, not the optimizer, dominates their "
              "seed-to-seed spread. `optimizer / fwd+bwd` divides each run's optimizer time by its forward plus "
              "backward time, which share that load; scripts/bench_optimizer.py's side-by-side measurement is the "
              "cost to quote. Active times to target inherit the load's noise."]
    text = "\n\n".join(l for l in _paragraphs(lines) if l) + "\n"
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "report.md"), "w") as f:
        f.write(text)
    return text


def _seeds(seeds: list[int]) -> str:
    return ", ".join(str(s) for s in seeds) or "none"


def _paragraphs(lines: list[str]) -> list[str]:
    """Table rows joined by single newlines, other lines as paragraphs."""
    out: list[str] = []
    for line in lines:
        if line.startswith("|") and out and out[-1].startswith("|"):
            out[-1] += "\n" + line
        else:
            out.append(line)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("sweep_dir")
    p.add_argument("--out", default=None, help="folder for report.md (default: the sweep folder)")
    p.add_argument("--margin", type=float, default=DEFAULT_MARGIN,
                   help=f"equivalence margin in percent for the TOST column (default {DEFAULT_MARGIN:g})")
    args = p.parse_args(argv)
    if not (math.isfinite(args.margin) and args.margin > 0):
        raise SystemExit(f"error: --margin {args.margin:g} must be a positive number of percent (e.g. 1 for ±1%)")
    if not os.path.isfile(os.path.join(args.sweep_dir, "study.json")):
        raise SystemExit(f"error: {args.sweep_dir!r} has no study.json (made by scripts/run_study.py)")
    try:
        build(args.sweep_dir, args.out, args.margin)
    except DamagedJSONFile as e:
        raise SystemExit(f"error: {e}") from None
    print(f"wrote {os.path.join(args.out or args.sweep_dir, 'report.md')}")


if __name__ == "__main__":
    sys.exit(main())
