"""The report of a paired-seed optimizer comparison (a study with study.lr_scan, e.g. optimizer_comparison_cpu):
differences against Muon and AdamW with 95% intervals over paired seeds and an equivalence test (TOST) at a margin —
reading run folders only.

    dit-paired-report SWEEP_DIR [--out FOLDER] [--margin 1.0] [--reference 'periodic_rowwise K=3 (frobenius)']

Each optimizer variant is compared at the learning rate its scan selected (study.json's lr_selection: lowest final
validation loss over the selection seeds). The selection seeds (study.json's selection_seeds; in records from before
the runner wrote it, the seeds of its scan runs) chose the lr, so they are never evaluation rows: a study whose
selection seed also ran at the selected lr gets those rows in a separate, labelled section only.
A comparison pairs runs of the same seed (same initial weights, data order and noise), so seed-to-seed variation
common to both cancels; in a study with study.axes (e.g. qk_norm on and off) or study.common_lr, runs pair by seed
within one combination of the axes and one lr kind (each variant's own selected lr, or the common lr), and each such
stratum has its own sections. The references are Muon and AdamW unless --reference names others (a variant as the
tables name it):
    d_s = 100 (x_s(variant) - x_s(reference)) / x_s(reference)   per seed s, then mean(d) +- t(0.975, n-1) sd(d)/sqrt(n).
(A mean of per-seed percent differences: A against B and B against A are not mirror images; the report says so.)
Equivalence at margin m (percent): two one-sided t tests at 5% each, i.e. the 90% interval mean(d) +- t(0.95, n-1)
sd(d)/sqrt(n) lies inside (-m, +m) -> "equivalent"; entirely above +m -> "worse"; entirely below -m -> "better";
otherwise "not shown equivalent".
Metrics: EMA validation velocity loss at the validation steps nearest a third, two thirds and all of the run
(200/400/600 for 600 steps validated every 100; the last is the primary metric), final FD, steps and active time to
reach a target validation loss (the highest final value among the compared runs, so that every finished run reaches
it; linear between validation points), optimizer time per step averaged over every step (window means weighted by
their step counts), and, for runs that log every step's train loss, the max loss spike and divergence of
dit_train/study/stability.py. A Runs table ends the report: every run study.json lists, with its role (lr scan,
evaluation), status, primary value and git commit.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
from collections import defaultdict

import scipy.stats

from dit_train.config.errors import ConfigError
from dit_train.config.override_text import shell_command
from dit_train.runs.atomic_io import atomic_write_bytes, describe_os_error, remove_dead_temp_files
from dit_train.runs.json_file import DamagedJSONFile, refuse_unless_regular
from dit_train.study.record import md, read_study, selection_seeds
from dit_train.study import stability
from dit_train.study.report import Run, banner, fmt, provenance, read_run, run_status
from dit_train.study.run import axes_label, variant_label  # variant_label: the key of study.json's lr_selection
from dit_train.trainer.preemption import ctrl_c_exits
from dit_train.plain_text import print_error

VAL_FRACTIONS = (1 / 3, 2 / 3, 1.0)  # of the run: where the validation-loss columns are read
DEFAULT_MARGIN = 1.0  # percent: the equivalence margin of the TOST column
DEFAULT_REFERENCES = ("muon", "adamw")
OWN, COMMON = "own lr", "common lr"  # the lr kinds of a stratum


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


def val_steps(runs: list[Run]) -> list[int]:
    """The validation steps nearest each of VAL_FRACTIONS of the last one (the later of two as near), over the runs."""
    logged = sorted({s for r in runs for s, _, _ in r.val_curve})
    if not logged:
        return []
    out = []
    for f in VAL_FRACTIONS:
        step = min(logged, key=lambda s: (abs(s - f * logged[-1]), -s))
        if step not in out:
            out.append(step)
    return out


def metrics_of(run: Run, target: float, at_steps: list[int]) -> dict[str, float]:
    steps, secs = crossing(run, target)
    out = {f"val loss @{s}": val_at_step(run, s) for s in at_steps}
    fwd_bwd = run.phases.get("forward", math.nan) + run.phases.get("backward", math.nan)
    out.update({"final FD": run.fd_curve[-1][2] if run.fd_curve else math.nan, "steps to target": steps,
                "time to target (s)": secs, "optimizer s/step": run.optimizer_s,
                "optimizer / fwd+bwd": run.optimizer_s / fwd_bwd if fwd_bwd > 0 else math.nan})
    if stability.logs_every_step(run.train_curve):
        out["max loss spike"] = stability.loss_spike(run.train_curve, run.warmup_steps)
    return out


def collect(sweep_dir: str, study: dict) -> tuple[dict, dict, list]:
    """({stratum: {variant: {seed: Run}}} at the selected lr (and at the common lr), every seed,
    {variant and axes: {lr: ([final val loss per selection seed, None where unfinished], selected)}},
    [(study.json's entry, its Run or None where the folder is missing, selected)] for every listed run). A stratum
    is (axes, lr kind): a study without study.axes or study.common_lr has the one stratum ('', OWN)."""
    selection = study.get("lr_selection") or {}
    chosen_lr = {key: sel["lr"] for key, sel in selection.items()}
    runs, scan, listed = defaultdict(lambda: defaultdict(dict)), defaultdict(dict), []
    for r in study["runs"]:
        key = variant_label(r)
        folder = os.path.join(sweep_dir, r["name"])  # r["name"] is one folder name (record.check_run_entry)
        if os.path.islink(folder):
            raise ConfigError(f"{folder} is a symbolic link (to {os.readlink(folder)}): a run is read only from a "
                              f"folder of the sweep itself (a link brings in records from elsewhere); replace it by "
                              f"the folder or remove it")
        run = read_run(folder, r["name"]) if os.path.isdir(folder) else None
        if run is not None and run.config_key:
            check_labelled_as_configured(folder, r, run)
        finished = run is not None and run.status == "finished"
        selected = key in chosen_lr and r["lr"] == chosen_lr[key] and r.get("phase") != "common"
        listed.append((r, run, selected))
        if r.get("phase") == "scan":
            final = run.val_loss if finished else None
            scan[md(" ".join(filter(None, [label(r), axes_label(r)])))].setdefault(r["lr"], ([], selected))[0].append(
                final)
        if finished and (selected or r.get("phase") == "common"):
            runs[(md(axes_label(r)), COMMON if r.get("phase") == "common" else OWN)][md(label(r))][r["seed"]] = run
    return {k: dict(v) for k, v in sorted(runs.items())}, scan, listed


def check_labelled_as_configured(folder: str, r: dict, run: Run) -> None:
    """The tables label a run by its study.json entry: its config.yaml must say the same optimizer, lr, seed (and K
    and RowNorm scale where the entry names them), or a run of one optimizer was counted as another's."""
    opt = run.opt_cfg
    checks = [("model", md(r["model"]), run.model), ("optimizer", r["optimizer"], opt.get("name")),
              ("seed", r["seed"], run.seed),
              *([("K", r["K"], opt.get("K"))] if r.get("K") is not None else []),
              *([("scale", r["scale"], opt.get("rownorm_scale"))] if r.get("scale") is not None else [])]
    for key, listed, configured in checks:
        if listed != configured:
            raise ConfigError(f"{folder}/config.yaml has {key} {configured!r} but study.json lists run {r['name']!r} "
                              f"with {key} {listed!r}: the record was edited or mixed up; restore the run folder or "
                              f"study.json")
    if r["lr"] is not None and not (math.isfinite(run.lr) and math.isclose(run.lr, r["lr"], rel_tol=1e-9)):
        raise ConfigError(f"{folder}/config.yaml has lr {run.lr!r} but study.json lists run {r['name']!r} with lr "
                          f"{r['lr']!r}: the record was edited or mixed up; restore the run folder or study.json")


def refuse_unequal_lengths(runs: dict) -> None:
    """Paired differences compare runs of one length: FD at step 400 against FD at step 600 is no comparison (and
    the validation columns of the one length are NaN for the other)."""
    lengths: dict[int, Run] = {}
    for by in runs.values():
        for group in by.values():
            for run in group.values():
                lengths.setdefault(run.planned_steps if run.planned_steps is not None else run.steps, run)
    if len(lengths) > 1:
        (a, ra), (b, rb) = sorted(lengths.items())[:2]
        raise ConfigError(f"runs {ra.name!r} ({a} steps) and {rb.name!r} ({b} steps) differ in train.steps: paired "
                          f"differences compare runs of one length; report each length from its own folder")


def checked_runs(sweep_dir: str, study: dict) -> tuple[dict, dict, list]:
    """collect's runs, refused in one line where study.json and the run folders disagree (dit-publish-study calls it
    on the sweep before it copies anything)."""
    no_lr = [r["name"] for r in study["runs"] if "lr" not in r]
    if no_lr:
        raise ConfigError(f"{sweep_dir}/study.json: run {no_lr[0]!r} has no 'lr': a two-phase study pairs runs at "
                          f"their selected lr, so every run of it names one (a number, or null for the experiment's); "
                          f"restore it from a copy (dit-study writes it)")
    runs, scan, listed = collect(sweep_dir, study)
    refuse_unequal_lengths(runs)
    return runs, scan, listed


def without(runs: dict, seeds: list[int]) -> dict:
    return {stratum: {variant: {s: r for s, r in group.items() if s not in seeds} for variant, group in by.items()}
            for stratum, by in runs.items()}


def stratum_name(stratum: tuple[str, str], strata: list) -> str:
    """'model.qk_norm=False, common lr'; '' where the study has the one stratum of the plain protocol."""
    if list(strata) == [("", OWN)]:
        return ""
    return ", ".join(filter(None, [stratum[0], stratum[1]]))


def stability_cells(group: list[Run]) -> str:
    """' | max loss spike | diverged |' cells of a quality row (stability.py's definitions)."""
    flags = [stability.diverged(r.train_curve) for r in group]
    counted = [f for f in flags if f is not None]
    spikes = [stability.loss_spike(r.train_curve, r.warmup_steps) for r in group]
    return f" | {fmt(spikes, 3)} | {sum(counted)} of {len(counted)} |"


def target_of(runs: dict) -> float:
    """The highest final loss among the compared runs: every finished run reaches it, so every pair has a time to it
    (AdamW's mean final value, the obvious choice, is not reached by about half of AdamW's own seeds)."""
    finals = [r.val_loss for group in runs.values() for r in group.values() if math.isfinite(r.val_loss)]
    return max(finals) if finals else math.nan


def paired_rows(runs: dict, reference: str, target: float, margin: float, at_steps: list[int]) -> list[str]:
    rows = []
    ref = runs.get(reference, {})
    for variant in sorted(runs):
        if variant == reference:
            continue
        seeds = sorted(set(runs[variant]) & set(ref))
        if not seeds:
            continue
        a = {s: metrics_of(runs[variant][s], target, at_steps) for s in seeds}
        b = {s: metrics_of(ref[s], target, at_steps) for s in seeds}
        for metric in a[seeds[0]]:
            diffs = [100 * (a[s][metric] - b[s].get(metric, math.nan)) / b[s].get(metric, math.nan) for s in seeds]
            m, lo, hi = interval(diffs)
            lo90, hi90, equivalent = equivalence(diffs, margin)
            finite = [d for d in diffs if math.isfinite(d)]
            if not finite:  # no pair has both values (a metric one arm never measured): no row of nan
                continue
            better = sum(d < 0 for d in finite)
            verdict = ("lower" if hi < 0 else "higher" if lo > 0 else "no difference resolved") if not math.isnan(lo) \
                else "—"
            rows.append(f"| {variant} | {metric} | {len(finite)} | {m:+.2f}% | {bounds(lo, hi)} | "
                        f"{better}/{len(finite)} | {verdict} | {bounds(lo90, hi90)} | {equivalent} |")
    return rows


def bounds(lo: float, hi: float) -> str:
    return "—" if math.isnan(lo) else f"[{lo:+.2f}, {hi:+.2f}]"


def paired_section(runs: dict, reference: str, margin: float, heading: str, at_steps: list[int]) -> list[str]:
    target = target_of(runs)
    return [heading,
            "Negative is better for every metric (lower loss, lower FD, fewer steps, less time). The mean difference "
            "is the mean over seeds of each seed's percent difference, 100 (variant − reference) / reference: it is "
            "not antisymmetric, so a variant against the reference and the reference against the variant are not "
            "mirror images (a seed at +100% one way is −50% the other), most visibly in the time rows, whose "
            "seed-to-seed spread is large. "
            f"The target validation loss is the highest final value among the compared runs, {target:.4f}, "
            "so every finished run reaches it (a pair without a time to it would be left out of that row; the "
            "n column counts the pairs). Equivalence: two one-sided t tests at 5% each against "
            f"±{margin:g}% (the 90% interval inside ±{margin:g}%: equivalent; entirely beyond +{margin:g}%: worse; "
            f"entirely beyond −{margin:g}%: better; otherwise not shown equivalent).",
            f"| variant | metric | n | mean difference | 95% interval | seeds lower | resolved | 90% interval | "
            f"equivalence at ±{margin:g}% |",
            "| --- | --- | ---: | ---: | --- | ---: | --- | --- | --- |", *paired_rows(runs, reference, target, margin,
                                                                          at_steps)]


def build(sweep_dir: str, out_dir: str | None, margin: float = DEFAULT_MARGIN,
          references: list[str] | None = None) -> str:
    out_dir = out_dir or sweep_dir
    refuse_unless_regular(os.path.join(sweep_dir, "study.json"), "read")
    study = read_study(os.path.join(sweep_dir, "study.json"))
    if "lr_selection" not in study:
        if "selection_seeds" in study or any("phase" in r for r in study.get("runs", [])):  # dit-study's lr_scan
            rerun = study.get("command") or f"dit-study {study.get('experiment', '?')}"  # its --sweep-dir too
            raise ConfigError(f"{sweep_dir}/study.json has no lr_selection: its lr scan has not finished (run: "
                              f"{rerun})")
        raise ConfigError(f"{sweep_dir}/study.json has no lr_selection: {study.get('experiment', 'this')} is a "
                          f"one-phase study (no study.lr_scan), whose runs dit-paired-report does not pair; its "
                          f"report is `{shell_command(['dit-report', sweep_dir])}`")
    runs, scan, listed = checked_runs(sweep_dir, study)
    chosen_by = selection_seeds(study)
    evaluated = without(runs, chosen_by)
    eval_runs = [r for by in evaluated.values() for group in by.values() for r in group.values()]
    names = sorted({v for by in evaluated.values() for v, group in by.items() if group})
    if references and not set(references) <= set(names):
        raise ConfigError(f"--reference {', '.join(sorted(set(references) - set(names)))!r} is not a variant "
                         f"with evaluation runs here; valid: {', '.join(repr(n) for n in names) or 'none'}")
    references = list(references or DEFAULT_REFERENCES)
    strata = list(evaluated)
    at_steps = val_steps(eval_runs)
    per_step = any(stability.logs_every_step(r.train_curve) for r in eval_runs)
    seeds = sorted({r.seed for r in eval_runs})
    command = shell_command(["dit-paired-report", sweep_dir, *([] if out_dir == sweep_dir else ["--out", out_dir]),
                             *([] if margin == DEFAULT_MARGIN else ["--margin", f"{margin:g}"]),
                             *([w for r in references for w in ("--reference", r)]
                               if references != list(DEFAULT_REFERENCES) else [])])

    lines = [f"# Paired optimizer comparison: {md(study.get('experiment', '?'))}", banner(study),
             f"Built by `{command}` from {len(eval_runs)} "
             f"finished runs at the selected learning rates{' and the common ones' if study.get('common_lr') else ''} "
             f"(evaluation seeds {_seeds(seeds)}). Selection "
             f"seed{'s' if len(chosen_by) > 1 else ''} {_seeds(chosen_by)} chose the learning rates and "
             f"{'are' if len(chosen_by) > 1 else 'is'} excluded from every evaluation row.",
             provenance(study, eval_runs), md(study.get("notes", "")),
             f"## Learning-rate scan (selection seed{'s' if len(chosen_by) > 1 else ''} {_seeds(chosen_by)}, final EMA "
             f"validation loss"
             f"{', mean over the seeds' if len(chosen_by) > 1 else ''}; * = selected, the lowest)",
             "| variant | lr | final val loss |", "| --- | ---: | ---: |"]
    for variant in sorted(scan):
        values = sorted(scan[variant].items())
        for i, (lr, (losses, selected)) in enumerate(values):
            edge = " (edge of the scan)" if selected and i in (0, len(values) - 1) else ""
            lines.append(f"| {variant} | {lr:g}{' *' if selected else ''}{edge} | {scan_cell(losses)} |")
    if study.get("common_lr"):
        lines.append("Common learning rates (the evaluation seeds of every variant at one lr shared by the variants of "
                     "its model and axes, study.common_lr): " + "; ".join(
                         f"{md(k)}: {v:g}" for k, v in sorted(study["common_lr"].items())) + ".")

    stab_head = " | max loss spike | diverged" if per_step else ""
    lines += [f"## Quality and cost at the selected learning rate (mean ± sd over evaluation seeds {_seeds(seeds)})",
              "| variant | lr | seeds | " + " | ".join(f"val loss @{s}" for s in at_steps)
              + f" | final FD | optimizer ms/step | refresh steps timed{stab_head} |",
              ("| --- | ---: | ---: | " + "---: | " * (len(at_steps) + 3 + 2 * per_step)).rstrip()]
    for stratum in strata:
        where = stratum_name(stratum, strata)
        for variant in sorted(evaluated[stratum]):
            group = list(evaluated[stratum][variant].values())
            if not group:
                continue
            refresh = sum(r.refresh_steps for r in group if math.isfinite(r.refresh_steps))
            timed = sum(r.timed_steps for r in group)
            lines.append(f"| {variant}{f' [{where}]' if where else ''} | {group[0].lr:g} | {len(group)} | "
                         + " | ".join(fmt([val_at_step(r, s) for r in group]) for s in at_steps)
                         + f" | {fmt([r.fd_curve[-1][2] if r.fd_curve else math.nan for r in group])}"
                         + f" | {fmt([1e3 * r.optimizer_s for r in group], 3)} | {refresh:.0f} of {timed:.0f}"
                         + (stability_cells(group) if per_step else " |"))
    if per_step:
        lines.append(f"Stability (dit_train/study/stability.py): max loss spike = the largest ratio, after the "
                     f"warm-up, of the {stability.WINDOW}-step mean train loss to the lowest such mean before it "
                     f"(1 = it never rose); diverged = a non-finite loss, or a final {stability.WINDOW}-step mean "
                     f"above {stability.DIVERGED_RATIO:g}x the lowest.")

    absent = [r for r in references if not any(r in evaluated[stratum] for stratum in strata)]
    if absent:  # a default reference the study has no arm of (Muon-only studies): say so, no empty table
        lines.append(f"No paired differences against {', '.join(absent)}: the study has no such arm.")
    references = [r for r in references if r not in absent]
    for reference in references:
        for stratum in strata:
            where = stratum_name(stratum, strata)
            lines += paired_section(evaluated[stratum], reference, margin,
                                    f"## Paired differences against {reference}{f', {where}' if where else ''}, "
                                    f"evaluation seeds {_seeds(seeds)} (per seed, then the t-intervals of the mean)",
                                    at_steps)
    every_seed = sorted({s for by in runs.values() for group in by.values() for s in group})
    # only the old protocol evaluated its selection seed; study.selection_seeds' own scan runs are scan rows only
    if "selection_seeds" not in study and set(chosen_by) & set(every_seed):
        lines += [f"## Including selection seed {_seeds(chosen_by)} (biased: the learning rates were chosen on it)",
                  "This study's selection seed also ran at the selected learning rates (the protocol before "
                  "selection seeds were kept out). Its rows are given only to compare with figures published from "
                  "them; the evaluation rows above are the ones to read."]
        for reference in references:
            for stratum in strata:
                where = stratum_name(stratum, strata)
                lines += paired_section(runs[stratum], reference, margin,
                                        f"### Against {reference}{f', {where}' if where else ''}, seeds "
                                        f"{_seeds(every_seed)} including the selection seed", at_steps)
    lines += ["Optimizer times are means over every step of each run (refresh and RowNorm steps both counted), "
              "measured on a 2-core machine shared with other work: machine load, not the optimizer, dominates their "
              "seed-to-seed spread. `optimizer / fwd+bwd` divides each run's optimizer time by its forward plus "
              "backward time, which share that load; benchmarks/bench_optimizer.py's side-by-side measurement is the "
              "cost to quote. Active times to target inherit the load's noise."]
    lines += runs_table(listed, at_steps[-1] if at_steps else None)
    text = "\n\n".join(l for l in _paragraphs(lines) if l) + "\n"
    os.makedirs(out_dir, exist_ok=True)
    remove_dead_temp_files(out_dir, ("report.md",))
    atomic_write_bytes(text.encode(), os.path.join(out_dir, "report.md"))  # a link there is replaced, not followed
    return text


def scan_cell(losses: list) -> str:
    """The mean final loss over the selection seeds that finished with a finite one, saying how many did not."""
    finite = [v for v in losses if v is not None and math.isfinite(v)]
    unfinished, bad = sum(v is None for v in losses), sum(v is not None and not math.isfinite(v) for v in losses)
    notes = [f"{unfinished} not finished"] * bool(unfinished) + [f"{bad} non-finite"] * bool(bad)
    return (f"{statistics.mean(finite):.4f}" if finite else "—") + (f" ({', '.join(notes)})" if notes else "")


def runs_table(listed: list, at_step: int | None) -> list[str]:
    """One row per run folder of study.json: every number above is a mean (or a paired difference) of rows of it. A
    run listed twice (an arm's own lr that is also the common lr: one run serves both) is one row with both roles."""
    primary = f"val loss @{at_step} (primary)" if at_step is not None else "val loss (none logged)"
    names = {"scan": "lr scan", "seeds": "evaluation", "common": "evaluation at the common lr"}
    roles: dict[str, list[str]] = defaultdict(list)
    first = {}
    for r, run, selected in listed:
        role = names.get(r.get("phase"), "—") + (" (selected lr)" if selected and r.get("phase") == "scan" else "")
        if role not in roles[r["name"]]:
            roles[r["name"]].append(role)
        first.setdefault(r["name"], (r, run))
    lines = ["## Runs",
             "One row per run folder that study.json lists, with its own status and commit. The learning-rate scan "
             "averages the lr scan rows; the other tables are means and paired differences of the finished rows at "
             "the selected (or common) learning rates. A run that did not finish is in no table but this one.",
             f"| run | variant | lr | seed | role | status | {primary} | git commit |",
             "| --- | --- | ---: | ---: | --- | --- | ---: | --- |"]
    for r, run in sorted(first.values(), key=lambda x: (label(x[0]), axes_label(x[0]), x[0]["lr"] or 0,
                                                        x[0]["seed"], x[0]["name"])):
        variant = md(" ".join(filter(None, [label(r), axes_label(r)])))
        lr = r["lr"] if r.get("lr") is not None else (run.lr if run is not None else math.nan)
        value = "—"
        if run is not None:
            logged = [v for s, _, v in run.val_curve if s == at_step]  # none where no run validated (at_step None)
            value = "—" if not logged else f"{logged[0]:.4f}" if math.isfinite(logged[0]) else "non-finite"
        status = "missing" if run is None else run_status(run)
        commit = (run.git_commit[:10] if run is not None else "") or "—"
        lr_text = "—" if math.isnan(lr) else f"{lr:g}"
        lines.append(f"| {md(r['name'])} | {variant} | {lr_text} | {r['seed']} | {'; '.join(roles[r['name']])} | "
                     f"{status} | {value} | {commit} |")
    return lines


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


@ctrl_c_exits("dit-paired-report: interrupted; report.md is written whole or not at all: rerun the same command")
def main(argv=None) -> int:
    """The command: bad input is one line and exit status 2, as in every dit-* command."""
    p = argparse.ArgumentParser(prog="dit-paired-report", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("sweep_dir")
    p.add_argument("--out", default=None, help="folder for report.md (default: the sweep folder)")
    p.add_argument("--margin", type=float, default=DEFAULT_MARGIN,
                   help=f"equivalence margin in percent for the TOST column (default {DEFAULT_MARGIN:g})")
    p.add_argument("--reference", action="append", default=None,
                   help="a variant to pair the others against, as the tables name it (e.g. 'periodic_rowwise K=3 "
                        f"(frobenius)'); repeatable; default: {' and '.join(DEFAULT_REFERENCES)}")
    args = p.parse_args(argv)
    try:
        if not (math.isfinite(args.margin) and args.margin > 0):
            raise ConfigError(f"--margin {args.margin:g} must be a positive number of percent (e.g. 1 for ±1%)")
        if not os.path.isfile(os.path.join(args.sweep_dir, "study.json")):
            raise ConfigError(f"{args.sweep_dir!r} has no study.json (made by dit-study)")
        build(args.sweep_dir, args.out, args.margin, args.reference)
    except (ConfigError, DamagedJSONFile) as e:
        print_error(str(e))
        return 2
    except OSError as e:  # a read-only output folder, a full disk: one line (report.md is whole or absent)
        print_error(describe_os_error(e))
        return 2
    print(f"wrote {os.path.join(args.out or args.sweep_dir, 'report.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
