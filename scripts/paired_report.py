#!/usr/bin/env python
"""The report of a paired-seed optimizer comparison (a study with study.lr_scan, e.g. optimizer_comparison_cpu):
differences against Muon and AdamW with 95% intervals over paired seeds — reading run folders only.

    python scripts/paired_report.py SWEEP_DIR [--out FOLDER]

Each optimizer variant is compared at the learning rate its scan selected (study.json's lr_selection: lowest final
validation loss at seed 0); its seed-0 run is the scan's run at that value. A comparison pairs runs of the same seed
(same initial weights, data order and noise), so seed-to-seed variation common to both cancels:
    d_s = 100 (x_s(variant) - x_s(reference)) / x_s(reference)   per seed s, then mean(d) +- t(0.975, n-1) sd(d)/sqrt(n).
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from report import Run, fmt, provenance, read_run  # noqa: E402
from dit_train.json_file import DamagedJSONFile, read_json  # noqa: E402
from run_study import variant_label  # noqa: E402  (the key of study.json's lr_selection)

# two-sided 95% quantiles of Student's t by degrees of freedom (1..30); normal beyond
T975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042]
VAL_STEPS = (200, 400, 600)


def t975(dof: int) -> float:
    return T975[dof - 1] if dof <= len(T975) else 1.960


def interval(diffs: list[float]) -> tuple[float, float, float]:
    """(mean, low, high) of the 95% t-interval of the mean; the bounds are NaN with fewer than two values."""
    diffs = [d for d in diffs if math.isfinite(d)]
    if not diffs:
        return math.nan, math.nan, math.nan
    m = statistics.mean(diffs)
    if len(diffs) < 2:
        return m, math.nan, math.nan
    half = t975(len(diffs) - 1) * statistics.stdev(diffs) / math.sqrt(len(diffs))
    return m, m - half, m + half


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
    out.update({"final FD": run.fd_curve[-1][2] if run.fd_curve else math.nan, "steps to target": steps,
                "time to target (s)": secs, "optimizer s/step": run.optimizer_s})
    return out


def collect(sweep_dir: str, study: dict) -> tuple[dict, dict]:
    """({variant: {seed: Run}} at the selected lr, {variant: [(lr, final val loss at seed 0, selected)]})."""
    selection = study.get("lr_selection") or {}
    chosen_lr = {key: sel["lr"] for key, sel in selection.items()}
    runs, scan = defaultdict(dict), defaultdict(list)
    for r in study["runs"]:
        key = variant_label(r)
        folder = os.path.join(sweep_dir, r["name"])
        run = read_run(folder, r["name"]) if os.path.isdir(folder) else None
        selected = key in chosen_lr and r["lr"] == chosen_lr[key]
        if r.get("phase") == "scan":
            final = run.val_loss if run is not None and run.status == "finished" else math.nan
            scan[label(r)].append((r["lr"], final, selected))
        if selected and run is not None and run.status == "finished":
            runs[label(r)][r["seed"]] = run
    return runs, scan


def paired_rows(runs: dict, reference: str, target: float) -> list[str]:
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
            finite = [d for d in diffs if math.isfinite(d)]
            better = sum(d < 0 for d in finite)
            ci = "—" if math.isnan(lo) else f"[{lo:+.1f}, {hi:+.1f}]"
            verdict = ("lower" if hi < 0 else "higher" if lo > 0 else "no difference resolved") if not math.isnan(lo) \
                else "—"
            rows.append(f"| {variant} | {metric} | {len(finite)} | {m:+.1f}% | {ci} | {better}/{len(finite)} | "
                        f"{verdict} |")
    return rows


def build(sweep_dir: str, out_dir: str | None) -> str:
    out_dir = out_dir or sweep_dir
    study = read_json(os.path.join(sweep_dir, "study.json"),
                      fix="restore it from a copy (scripts/run_study.py writes it)")
    if "lr_selection" not in study:
        raise SystemExit(f"error: {sweep_dir}/study.json has no lr_selection: not a two-phase study, or its lr scan "
                         f"has not finished (run: python scripts/run_study.py {study.get('experiment', '?')})")
    runs, scan = collect(sweep_dir, study)
    # the highest final loss among the compared runs: every finished run reaches it, so every pair has a time to it
    # (AdamW's mean final value, the obvious choice, is not reached by about half of AdamW's own seeds)
    finals = [r.val_loss for group in runs.values() for r in group.values() if math.isfinite(r.val_loss)]
    target = max(finals) if finals else math.nan
    all_runs = [r for group in runs.values() for r in group.values()]

    lines = [f"# Paired optimizer comparison: {study.get('experiment', '?')}",
             f"Built by `python scripts/paired_report.py {sweep_dir}{'' if out_dir == sweep_dir else f' --out {out_dir}'}`"
             f" from {len(all_runs)} finished runs at the selected learning rates.",
             provenance(study, all_runs), study.get("notes", ""),
             "## Learning-rate scan (seed 0, final EMA validation loss; * = selected, the lowest)",
             "| variant | lr | final val loss |", "| --- | ---: | ---: |"]
    for variant in sorted(scan):
        values = sorted(scan[variant])
        for i, (lr, loss, selected) in enumerate(values):
            edge = " (edge of the scan)" if selected and i in (0, len(values) - 1) else ""
            lines.append(f"| {variant} | {lr:g}{' *' if selected else ''}{edge} | {loss:.4f} |")

    lines += ["## Quality and cost at the selected learning rate (mean ± sd over seeds)",
              "| variant | lr | seeds | " + " | ".join(f"val loss @{s}" for s in VAL_STEPS)
              + " | final FD | optimizer ms/step | refresh steps timed |",
              ("| --- | ---: | ---: | " + "---: | " * (len(VAL_STEPS) + 3)).rstrip()]
    for variant in sorted(runs):
        group = list(runs[variant].values())
        refresh = sum(r.refresh_steps for r in group if math.isfinite(r.refresh_steps))
        timed = sum(r.timed_steps for r in group)
        lines.append(f"| {variant} | {group[0].lr:g} | {len(group)} | "
                     + " | ".join(fmt([val_at_step(r, s) for r in group]) for s in VAL_STEPS)
                     + f" | {fmt([r.fd_curve[-1][2] if r.fd_curve else math.nan for r in group])}"
                     + f" | {fmt([1e3 * r.optimizer_s for r in group], 3)} | {refresh:.0f} of {timed:.0f} |")

    for reference in ("muon", "adamw"):
        lines += [f"## Paired differences against {reference} (per seed, then the 95% t-interval of the mean)",
                  "Negative is better for every metric (lower loss, lower FD, fewer steps, less time). "
                  f"The target validation loss is the highest final value among the compared runs, {target:.4f}, "
                  "so every finished run reaches it (a pair without a time to it would be left out of that row; the "
                  "n column counts the pairs).",
                  "| variant | metric | n | mean difference | 95% interval | seeds lower | resolved |",
                  "| --- | --- | ---: | ---: | --- | ---: | --- |", *paired_rows(runs, reference, target)]
    lines += ["Optimizer times are means over every step of each run (refresh and RowNorm steps both counted), "
              "measured on a 2-core machine shared with other work: the ratios are noisier than "
              "scripts/bench_optimizer.py's side-by-side measurement, and active times to target inherit that noise."]
    text = "\n\n".join(l for l in _paragraphs(lines) if l) + "\n"
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "report.md"), "w") as f:
        f.write(text)
    return text


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
    args = p.parse_args(argv)
    if not os.path.isfile(os.path.join(args.sweep_dir, "study.json")):
        raise SystemExit(f"error: {args.sweep_dir!r} has no study.json (made by scripts/run_study.py)")
    try:
        build(args.sweep_dir, args.out)
    except DamagedJSONFile as e:
        raise SystemExit(f"error: {e}") from None
    print(f"wrote {os.path.join(args.out or args.sweep_dir, 'report.md')}")


if __name__ == "__main__":
    sys.exit(main())
