"""dit-paired-report on fabricated run folders: runs paired by seed at each variant's selected lr, the selection
seeds kept out of the evaluation rows, the 95% t-interval of the per-seed relative differences and the TOST
equivalence verdict (both against scipy), and the interpolated time to a target loss."""

import json
import math
import shlex

import pytest
import scipy.stats

from dit_train.config import ConfigError
from dit_train.config.override_text import shell_command
from dit_train.study import paired_report
from test_study import write_run


def rows(val: dict, fd: float, opt_s: float, step_s: float = 0.5) -> list[dict]:
    """Window-mean train rows every 100 steps (10 steps per window), validation at 200/400/600, FD at the end."""
    out = [{"step": s, "train/loss": 1.0, "time/optimizer": opt_s, "time/step": step_s, "window/steps": 10,
            "time/forward": 0.1, "time/backward": 0.2, "opt/refresh_steps": 3, "active_time_s": s * step_s}
           for s in range(100, 601, 100)]
    out += [{"step": s, "val/loss": v} for s, v in val.items()]
    return sorted(out + [{"step": 600, "fd": fd}], key=lambda r: r["step"])


FINAL = {"adamw": [0.40, 0.42, 0.41, 0.415], "muon": [0.30, 0.33, 0.31, 0.32], "pr": [0.29, 0.32, 0.33, 0.325]}
SEEDS = range(4)  # seed 0 is the scan's (the selection seed), 1-3 are evaluated


def two_phase_sweep(sweep, study_extra: dict | None = None) -> None:
    """Three variants x 4 seeds at their selected lrs, plus a losing scan value each, and their study.json."""
    # final val loss per seed; each variant's curve is (2x, 1.5x, 1x) its final value at steps 200/400/600
    fd = {"adamw": [100.0, 110.0, 105.0, 107.0], "muon": [80.0, 85.0, 82.0, 83.0], "pr": [81.0, 84.0, 86.0, 85.0]}
    spec = {"adamw": ("adamw", None, None, 8e-3), "muon": ("muon", None, None, 1.6e-2),
            "pr": ("periodic_rowwise", 3, "spectral", 8e-3)}
    study_runs = []
    for key, (opt, K, scale, lr) in spec.items():
        for seed in SEEDS:
            name = f"{key}_lr{lr}_s{seed}"
            v = FINAL[key][seed]
            write_run(sweep / name, "dit_s", opt, seed, rows({200: 2 * v, 400: 1.5 * v, 600: v}, fd[key][seed],
                                                             {"adamw": 0.01, "muon": 0.1, "pr": 0.04}[key]), K=K, lr=lr,
                      scale=scale)
            study_runs.append({"name": name, "model": "dit_s", "optimizer": opt, "K": K, "scale": scale, "lr": lr,
                               "seed": seed, "phase": "scan" if seed == 0 else "seeds"})
        # a scan value that lost (and is left out of every comparison)
        loser = f"{key}_loser"
        write_run(sweep / loser, "dit_s", opt, 0, rows({600: 0.9}, 300.0, 0.01), K=K, lr=lr * 2, scale=scale)
        study_runs.append({"name": loser, "model": "dit_s", "optimizer": opt, "K": K, "scale": scale, "lr": lr * 2,
                           "seed": 0, "phase": "scan"})
    selection = {"dit_s adamw": {"lr": 8e-3}, "dit_s muon": {"lr": 1.6e-2},
                 "dit_s periodic_rowwise K=3 rownorm_scale=spectral": {"lr": 8e-3}}
    (sweep / "study.json").write_text(json.dumps({"experiment": "fab", "runs": study_runs, "lr_selection": selection,
                                                   **(study_extra or {})}))


def pr_vs_muon(seeds) -> list[float]:
    return [100 * (FINAL["pr"][s] - FINAL["muon"][s]) / FINAL["muon"][s] for s in seeds]


def test_paired_differences_intervals_and_time_to_target(tmp_path):
    sweep = tmp_path / "sweep"
    two_phase_sweep(sweep)
    text = paired_report.build(str(sweep), None)
    assert "| periodic_rowwise K=3 (spectral) | 0.008 * (edge of the scan) | 0.2900 |" in text
    assert "| periodic_rowwise K=3 (spectral) | 0.016 | 0.9000 |" in text

    # the evaluation rows pair seeds 1-3 only: seed 0 chose the lr
    assert "Selection seed 0 chose the learning rates and is excluded from every evaluation row" in text
    evaluation = text.split("## Including selection seed 0")[0]
    diffs = pr_vs_muon([1, 2, 3])
    ref = scipy.stats.ttest_1samp(diffs, 0.0).confidence_interval(0.95)
    mean = sum(diffs) / 3
    row = (f"| periodic_rowwise K=3 (spectral) | val loss @600 | 3 | {mean:+.2f}% | "
           f"[{ref.low:+.2f}, {ref.high:+.2f}]")
    assert row in evaluation, evaluation
    # Muon against AdamW: every seed lower, and the interval excludes 0
    assert "| muon | val loss @600 | 3 | " in evaluation and evaluation.count("| lower |") >= 1
    # optimizer time: 0.04 vs 0.1 s per step for every seed -> -60%, no spread, so also beyond a 1% margin
    assert ("| periodic_rowwise K=3 (spectral) | optimizer s/step | 3 | -60.00% | [-60.00, -60.00] | 3/3 | lower | "
            "[-60.00, -60.00] | better |") in evaluation
    # the target is the highest final loss of the evaluated runs, AdamW seed 1's 0.42
    assert "The target validation loss is the highest final value among the compared runs, 0.4200" in evaluation
    assert "| muon | steps to target | 3 | " in evaluation and "| adamw | steps to target | 3 | " in evaluation
    # the selection seed ran at the selected lr (the old protocol): its rows only in the labelled section
    biased = text.split("## Including selection seed 0")[1]
    assert f"| periodic_rowwise K=3 (spectral) | val loss @600 | 4 | {sum(pr_vs_muon(SEEDS)) / 4:+.2f}% |" in biased
    # crossing: muon seed 0 (curve 0.60 @200, 0.45 @400, 0.30 @600) crosses it
    # at step 400 + 200 * (0.45 - 0.41) / 0.15
    strata = paired_report.collect(str(sweep), json.loads((sweep / "study.json").read_text()))[0]
    run = strata[("", paired_report.OWN)]["muon"][0]  # the one stratum of a study without axes or a common lr
    steps, secs = paired_report.crossing(run, 0.41)
    assert steps == pytest.approx(400 + 200 * 0.04 / 0.15) and secs == pytest.approx(0.5 * steps)
    assert math.isnan(paired_report.crossing(run, 0.1)[0])


def test_selection_seeds_recorded_by_the_runner_are_never_evaluated(tmp_path):
    sweep = tmp_path / "sweep"
    two_phase_sweep(sweep, {"selection_seeds": [0, 1]})
    text = paired_report.build(str(sweep), None)
    assert "(evaluation seeds 2, 3)" in text and "Selection seeds 0, 1 chose the learning rates" in text
    evaluation = text.split("## Including selection seed")[0]
    assert "| periodic_rowwise K=3 (spectral) | val loss @600 | 2 | " in evaluation
    assert "| val loss @600 | 3 |" not in evaluation and "| val loss @600 | 4 |" not in evaluation
    # recorded selection seeds ran the scan only: no section with them (that is the old protocol's)
    assert "## Including selection seed" not in text


def test_intervals_use_the_exact_t_quantile():
    # n=5: the rounded table value 2.776 (t(0.975, 4) = 2.7764) moved published bounds by 0.1
    diffs = [-0.53, 0.13, 1.45, 0.93, 1.06]
    mean, lo, hi = paired_report.interval(diffs)
    ref = scipy.stats.ttest_1samp(diffs, 0.0).confidence_interval(0.95)
    assert (lo, hi) == (pytest.approx(ref.low, rel=1e-12), pytest.approx(ref.high, rel=1e-12))
    _, lo90, hi90 = paired_report.interval(diffs, 0.90)
    ref90 = scipy.stats.ttest_1samp(diffs, 0.0).confidence_interval(0.90)
    assert (lo90, hi90) == (pytest.approx(ref90.low, rel=1e-12), pytest.approx(ref90.high, rel=1e-12))

    # one value: its mean, and no interval
    mean, lo, hi = paired_report.interval([2.5])
    assert mean == 2.5 and math.isnan(lo) and math.isnan(hi)


def test_validation_columns_and_a_target_reached_at_the_first_validation():
    """The columns are the logged steps nearest a third, two thirds and all of the last one, the later of two as
    near; a target the first validation point already meets is reached there (no earlier value to interpolate)."""
    from types import SimpleNamespace

    curve = lambda steps: SimpleNamespace(val_curve=[(s, 0.5 * s, 1.0) for s in steps])  # noqa: E731
    assert paired_report.val_steps([curve([400, 800, 1200]), curve([300, 1200])]) == [400, 800, 1200]
    # 450 / 3 = 150 lies halfway between 100 and 200: the later one
    assert paired_report.val_steps([curve([100, 200, 300, 450])]) == [200, 300, 450]
    run = SimpleNamespace(val_curve=[(100, 50.0, 0.3), (200, 100.0, 0.2)])
    assert paired_report.crossing(run, 0.35) == (100.0, 50.0)


def test_a_tie_is_not_counted_as_a_seed_lower(tmp_path, monkeypatch):
    """'seeds lower' counts the seeds whose difference is below 0: seed 1 of the variant equals Muon's (0.33), so
    of the three evaluation seeds none is lower."""
    monkeypatch.setitem(FINAL, "pr", [0.29, 0.33, 0.33, 0.325])
    two_phase_sweep(tmp_path / "sweep")
    evaluation = paired_report.build(str(tmp_path / "sweep"), None).split("## Including selection seed 0")[0]
    diffs = pr_vs_muon([1, 2, 3])
    assert diffs[0] == 0.0
    ref = scipy.stats.ttest_1samp(diffs, 0.0).confidence_interval(0.95)
    row = (f"| periodic_rowwise K=3 (spectral) | val loss @600 | 3 | {sum(diffs) / 3:+.2f}% | "
           f"[{ref.low:+.2f}, {ref.high:+.2f}] | 0/3 |")
    assert row in evaluation, evaluation

@pytest.mark.parametrize("diffs, margin, verdict", [
    ([0.2, -0.1, 0.3, 0.0, 0.1, -0.2, 0.25, 0.05], 1.0, "equivalent"),
    ([0.13, 1.45, 0.93, 1.06], 1.0, "not shown equivalent"),  # optimizer_comparison_cpu, spectral vs Muon, seeds 1-4
    ([2.1, 2.6, 1.9, 2.4, 2.2], 1.0, "worse"),
    ([-2.1, -2.6, -1.9, -2.4, -2.2], 1.0, "better"),
    ([0.13, 1.45, 0.93, 1.06], 2.0, "equivalent"),
])
def test_equivalence_is_two_one_sided_t_tests(diffs, margin, verdict):
    lo, hi, got = paired_report.equivalence(diffs, margin)
    ref = scipy.stats.ttest_1samp(diffs, 0.0).confidence_interval(0.90)
    assert (lo, hi) == (pytest.approx(ref.low, rel=1e-12), pytest.approx(ref.high, rel=1e-12))
    # TOST by hand: H0 mean <= -margin and H0 mean >= +margin, each rejected at 5%
    p_low = scipy.stats.ttest_1samp(diffs, -margin, alternative="greater").pvalue
    p_high = scipy.stats.ttest_1samp(diffs, margin, alternative="less").pvalue
    assert (max(p_low, p_high) < 0.05) == (got == "equivalent")
    assert got == verdict


def test_the_margin_is_named_in_the_report_and_a_bad_one_is_refused(tmp_path, capsys):
    sweep = tmp_path / "sweep"
    two_phase_sweep(sweep)
    paired_report.main([str(sweep), "--margin", "2.5"])
    text = (sweep / "report.md").read_text()
    assert f"Built by `dit-paired-report {sweep} --margin 2.5`" in text
    assert "| equivalence at ±2.5% |" in text
    capsys.readouterr()
    for bad in ("0", "-1", "nan"):  # exit status 2, as in every dit-* command (was 1)
        assert paired_report.main([str(sweep), "--margin", bad]) == 2
        assert capsys.readouterr().err.startswith(f"error: --margin {bad} must be a positive number of percent")


def test_the_built_by_command_and_the_dit_report_hint_paste_as_the_same_words(tmp_path, capsys):
    """A sweep folder named like a sweep's overrides (`a=1,b 2`), with a quote and non-ASCII: the "Built by"
    command (and the one-phase refusal's `dit-report` command) were written unquoted, so pasting them named other
    folders ('Built by `dit-paired-report /x/a=1,b 2 it's ü`' is an unclosed quote to a shell)."""
    sweep, out = tmp_path / "a=1,b 2 it's ü", tmp_path / "out $HOME"
    two_phase_sweep(sweep)
    assert paired_report.main([str(sweep), "--out", str(out), "--margin", "2.5", "--reference", "muon"]) == 0
    built_by = (out / "report.md").read_text().split("Built by `", 1)[1].split("`", 1)[0]
    assert shlex.split(built_by) == ["dit-paired-report", str(sweep), "--out", str(out), "--margin", "2.5",
                                     "--reference", "muon"]
    one_phase = tmp_path / "b=2,c 3 it's ü"
    one_phase.mkdir()
    (one_phase / "study.json").write_text(json.dumps({"experiment": "smoke", "runs": []}))
    capsys.readouterr()
    assert paired_report.main([str(one_phase)]) == 2
    assert shlex.split(capsys.readouterr().err.split("its report is `", 1)[1].split("`")[0]) == [
        "dit-report", str(one_phase)]


def test_a_study_without_a_finished_scan_is_refused(tmp_path):
    (tmp_path / "study.json").write_text(json.dumps({"experiment": "optimizer_comparison_cpu", "runs": [
        {"name": "a", "model": "dit_s", "optimizer": "muon", "lr": 0.01, "seed": 0, "phase": "scan"}]}))
    with pytest.raises(ConfigError, match=r"has no lr_selection: its lr scan has not finished \(run: dit-study "
                                          r"optimizer_comparison_cpu\)$"):
        paired_report.build(str(tmp_path), None)
    # the command that made the study (dit-study records it), which names its own --sweep-dir: the sweep continued
    sweep = tmp_path / "sweep a=1,b it's ü"
    command = shell_command(["dit-study", "optimizer_comparison_cpu", "--sweep-dir", str(sweep)])
    record = json.loads((tmp_path / "study.json").read_text())
    (tmp_path / "study.json").write_text(json.dumps({**record, "command": command}))
    with pytest.raises(ConfigError) as e:
        paired_report.build(str(tmp_path), None)
    assert shlex.split(str(e.value).split("(run: ", 1)[1][:-1]) == ["dit-study", "optimizer_comparison_cpu",
                                                                     "--sweep-dir", str(sweep)]


def test_a_one_phase_study_is_sent_to_dit_report_not_told_to_rerun(tmp_path, capsys):
    """`dit-study smoke` then `dit-paired-report sweeps/smoke`: smoke has no lr scan, so rerunning it (what the
    refusal said) would change nothing; the refusal names the report that fits."""
    from dit_train.study import run as run_study

    study = run_study.load_experiment("smoke").study
    runs = run_study.expand(study, [], [])  # what dit-study records in study.json
    (tmp_path / "study.json").write_text(json.dumps({"experiment": "smoke", "runs": runs}))
    assert paired_report.main([str(tmp_path)]) == 2
    assert capsys.readouterr().err == (
        f"error: {tmp_path}/study.json has no lr_selection: smoke is a one-phase study (no study.lr_scan), whose runs "
        f"dit-paired-report does not pair; its report is `dit-report {tmp_path}`\n")


def test_publishing_a_two_phase_study_writes_its_paired_report_rebuilt_exactly_from_the_records(tmp_path,
                                                                                                 monkeypatch):
    from dit_train.study import publish as publish_study

    two_phase_sweep(tmp_path / "sweep")
    monkeypatch.chdir(tmp_path)
    assert publish_study.main(["sweep", "docs/results/fab"]) == 0
    published = (tmp_path / "docs/results/fab/report.md").read_text()
    assert published.startswith("# Paired optimizer comparison: fab")
    assert "Built by `dit-paired-report docs/results/fab/runs --out docs/results/fab`" in published
    assert paired_report.build("docs/results/fab/runs", "docs/results/fab") == published


def stability_sweep(sweep) -> dict:
    """periodic_rowwise K=3, frobenius and spectral, qk_norm on and off (study.axes), 200 steps logged every step:
    selection seed 30 (scan runs only, one of them at the selected lr), evaluation seeds 40-42 at each arm's own lr
    and at the common lr. Returns {(scale, qk_norm, lr kind, seed): (final val loss, max loss spike)}."""
    own = {("frobenius", True): 4e-3, ("spectral", True): 8e-3, ("frobenius", False): 2e-3, ("spectral", False): 2e-3}
    common = {True: 4e-3, False: 2e-3}
    truth, study_runs, selection = {}, [], {}
    for (scale, qk), lr in own.items():
        label = f"dit_m periodic_rowwise K=3 rownorm_scale={scale} model.qk_norm={qk}"
        selection[label] = {"lr": lr}
        arms = [("scan", lr, 30), ("scan", 2 * lr, 30)] + [(p, x, s) for p, x in (("seeds", lr), ("common", common[qk]))
                                                           for s in (40, 41, 42)]
        for phase, x, seed in arms:
            h = 1 + seed % 7 / 10 + (scale == "frobenius") * (1 + (not qk)) + (x != lr) * 0.3
            final = 0.25 + 0.01 * (seed % 5) + (scale == "frobenius") * 0.05 + (not qk) * 0.02 + (x != lr) * 0.03
            name = f"{scale}_qk{qk}_lr{x}_s{seed}"
            # the spike window's mean over the lowest 10-step mean before it (steps 71-80, mean loss at step 75.5);
            # 1 where that is lower (h = 1): a falling mean is its own minimum
            spike = max(1.0, h * (1.0 - 0.5 * 80 / 200) / (1.0 - 0.5 * 75.5 / 200))
            if phase != "scan":
                truth[(scale, qk, "common" if phase == "common" else "own", seed)] = (final, spike)
            if not (sweep / name).exists():
                losses = [1.0 - 0.5 * s / 200 for s in range(1, 201)]
                losses[80:90] = [h * (1.0 - 0.5 * 80 / 200)] * 10  # one 10-step window at h x the running minimum
                rows = [{"step": s, "train/loss": losses[s - 1], "time/optimizer": 0.01, "time/step": 0.5,
                         "window/steps": 1, "time/forward": 0.1, "time/backward": 0.2, "active_time_s": 0.5 * s}
                        for s in range(1, 201)]
                rows += [{"step": s, "val/loss": final * (1 + (200 - s) / 200)} for s in (50, 100, 150, 200)]
                write_run(sweep / name, "dit_m", "periodic_rowwise", seed, sorted(rows, key=lambda r: r["step"]), K=3,
                          lr=x, scale=scale, warmup=20)
            study_runs.append({"name": name, "model": "dit_m", "optimizer": "periodic_rowwise", "K": 3,
                               "scale": scale, "axes": {"model.qk_norm": qk}, "lr": x, "seed": seed, "phase": phase})
    (sweep / "study.json").write_text(json.dumps({
        "experiment": "rownorm_scale_stability_dit_m", "runs": study_runs, "lr_selection": selection,
        "selection_seeds": [30], "common_lr": {k: common[k.endswith("True")] for k in selection}}))
    return truth


def test_a_study_with_axes_and_a_common_lr_pairs_by_seed_within_qk_norm_and_lr_kind(tmp_path):
    sweep = tmp_path / "sweep"
    truth = stability_sweep(sweep)
    paired_report.main([str(sweep), "--reference", "periodic_rowwise K=3 (frobenius)"])
    text = (sweep / "report.md").read_text()
    assert "Built by `dit-paired-report " + str(sweep) + " --reference 'periodic_rowwise K=3 (frobenius)'`" in text
    tables, runs_rows = text.split("\n## Runs\n")
    # selection seed 30 is in no evaluation row; the Runs table lists its runs as the scan's
    assert "and the common ones (evaluation seeds 40, 41, 42)" in text and "| 30 |" not in tables
    seed_30 = [line for line in runs_rows.splitlines() if "| 30 |" in line]
    assert len(seed_30) == 8 and all("| lr scan" in line for line in seed_30), seed_30
    # a run serving both its arm's own lr and the common lr (the same lr) is one row with both roles
    assert runs_rows.count("| frobenius_qkFalse_lr0.002_s40 |") == 1
    assert "| 40 | evaluation; evaluation at the common lr | finished | 0.3200 | — |" in runs_rows
    assert "## Including selection seed" not in text  # seed 30 ran at a selected lr, in the scan only
    assert "## Paired differences against muon" not in text
    for qk in (True, False):
        for kind, words in (("own", "own lr"), ("common", "common lr")):
            section = text.split(f"## Paired differences against periodic_rowwise K=3 (frobenius), "
                                 f"model.qk_norm={qk}, {words}, evaluation seeds 40, 41, 42")[1].split("\n## ")[0]
            for metric, i in (("val loss @200", 0), ("max loss spike", 1)):
                diffs = [100 * (truth[("spectral", qk, kind, s)][i] - truth[("frobenius", qk, kind, s)][i])
                         / truth[("frobenius", qk, kind, s)][i] for s in (40, 41, 42)]
                mean = sum(diffs) / 3
                if max(diffs) - min(diffs) < 1e-9:  # no spread: the interval is the mean itself
                    bounds = f"[{mean:+.2f}, {mean:+.2f}]"
                else:
                    ci = scipy.stats.ttest_1samp(diffs, 0.0).confidence_interval(0.95)
                    bounds = f"[{ci.low:+.2f}, {ci.high:+.2f}]"
                row = f"| periodic_rowwise K=3 (spectral) | {metric} | 3 | {mean:+.2f}% | {bounds} |"
                assert row in section, (row, section)
    # the quality table: one row per arm, qk_norm and lr kind; the spike is the window's height over the minimum
    row = "| periodic_rowwise K=3 (frobenius) [model.qk_norm=False, common lr] | 0.002 | 3 | "
    assert row in text
    # validation read at a third (50 is nearer 66.7 than 100), two thirds (150) and the end of the 200 steps
    assert ("| variant | lr | seeds | val loss @50 | val loss @150 | val loss @200 | final FD | optimizer ms/step | "
            "refresh steps timed | max loss spike | diverged |") in text
    assert text.count("| 0 of 3 |") == 8  # each of the 8 arms: 3 seeds, none diverged
    with pytest.raises(ConfigError, match=r"--reference 'muon' is not a variant with evaluation runs here; valid: "
                                          r"'periodic_rowwise K=3 \(frobenius\)', 'periodic_rowwise K=3 \(spectral\)'"):
        paired_report.build(str(sweep), None, references=["muon"])


def test_a_study_without_an_adamw_arm_says_so_instead_of_an_empty_table(tmp_path):
    """optimizer_confirmation_cpu compares periodic_rowwise with Muon only: the default references are Muon and
    AdamW, and the report printed an AdamW heading over an empty table."""
    sweep = tmp_path / "sweep"
    two_phase_sweep(sweep)
    study = json.loads((sweep / "study.json").read_text())
    study["runs"] = [r for r in study["runs"] if r["optimizer"] != "adamw"]
    del study["lr_selection"]["dit_s adamw"]
    (sweep / "study.json").write_text(json.dumps(study))
    text = paired_report.build(str(sweep), None)
    assert "## Paired differences against adamw" not in text and "### Against adamw" not in text
    assert "No paired differences against adamw: the study has no such arm." in text
    assert "## Paired differences against muon" in text
    assert "| periodic_rowwise K=3 (spectral) | val loss @600 | 3 | " in text


@pytest.mark.parametrize("name, row", [
    ("optimizer_confirmation_cpu", "| periodic_rowwise K=3 (spectral) | val loss @600 | 10 | +0.49% | [-0.08, +1.06] |"),
    ("optimizer_comparison_cpu", "| periodic_rowwise K=3 (spectral) | val loss @600 | 4 | +0.89% | [+0.01, +1.77] |"),
    ("rownorm_scale_stability_dit_m", "| periodic_rowwise K=3 (spectral) | val loss @200 | 6 | +3.43% | [+1.20, +5.66] |")])
def test_the_published_paired_reports_are_rebuilt_exactly_from_their_records(tmp_path, monkeypatch, name, row):
    """docs/results/optimizer_confirmation_cpu/report.md (issue 30's answer), optimizer_comparison_cpu's and
    rownorm_scale_stability_dit_m's are what dit-paired-report builds from the committed run records, byte for byte:
    no number in them was edited by hand."""
    import os
    import shutil

    from conftest import ROOT

    study = f"docs/results/{name}"
    shutil.copytree(os.path.join(ROOT, study, "runs"), tmp_path / study / "runs")
    monkeypatch.chdir(tmp_path)  # the report names its folders as the published one does
    references = ["periodic_rowwise K=3 (frobenius)"] if name == "rownorm_scale_stability_dit_m" else None
    text = paired_report.build(f"{study}/runs", study, references=references)  # as its README's command says
    with open(os.path.join(ROOT, study, "report.md")) as f:
        assert text == f.read()
    assert row in text
    assert "\n## Runs\n" in text  # "each run's commit is in the Runs table", as the report says


def test_the_runs_table_lists_every_study_run_with_its_status_primary_value_and_commit(tmp_path):
    """The report said "each run's commit is in the Runs table" and had no Runs table; a run that did not finish
    left the tables without a word, and an unfinished scan run made its lr's mean "nan"."""
    sweep = tmp_path / "sweep"
    two_phase_sweep(sweep)
    (sweep / "muon_lr0.016_s3" / "summary.json").unlink()  # an evaluation run that stopped before its summary
    (sweep / "adamw_loser" / "summary.json").unlink()  # a scan run likewise
    (sweep / "pr_lr0.008_s1" / "run_info.json").write_text(json.dumps({"git_commit": "abc1234567890"}))
    text = paired_report.build(str(sweep), None)
    assert "(each run's commit is in the Runs table)" in text
    assert "| adamw | 0.016 | — (1 not finished) |" in text  # the scan table: no run of that lr finished
    assert "| muon | 0.016 | 2 |" in text.split("## Including selection seed")[0]  # evaluation seeds 1, 2 (3 stopped)
    runs = text.split("\n## Runs\n")[1]
    rows = [line for line in runs.splitlines() if line.startswith("| ") and not line.startswith(("| run |", "| ---"))]
    study = json.loads((sweep / "study.json").read_text())
    assert sorted(row.split(" | ")[0][2:] for row in rows) == sorted(r["name"] for r in study["runs"])
    assert "| run | variant | lr | seed | role | status | val loss @600 (primary) | git commit |" in runs
    for row in ("| muon_lr0.016_s3 | muon | 0.016 | 3 | evaluation | incomplete (step 600) | 0.3200 | — |",
                "| pr_lr0.008_s1 | periodic_rowwise K=3 (spectral) | 0.008 | 1 | evaluation | finished | 0.3200 | "
                "abc1234567 |",
                "| muon_lr0.016_s0 | muon | 0.016 | 0 | lr scan (selected lr) | finished | 0.3000 | — |",
                "| adamw_loser | adamw | 0.016 | 0 | lr scan | incomplete (step 600) | 0.9000 | — |"):
        assert row in rows, (row, runs)


def test_the_paired_report_says_its_percent_differences_are_not_antisymmetric(tmp_path):
    """adamw against muon read +113.94% on time to target and muon against adamw +187.43%: the mean of per-seed
    percent differences is no mirror image; the report says what its % is. The statistic itself is unchanged: a
    seed at 2x its reference is +100% one way and -50% the other."""
    sweep = tmp_path / "sweep"
    two_phase_sweep(sweep)
    one_way = paired_report.build(str(sweep), str(tmp_path / "a"), references=["muon"])
    other_way = paired_report.build(str(sweep), str(tmp_path / "b"), references=["adamw"])
    opt = {"adamw": 0.01, "muon": 0.1}  # two_phase_sweep's optimizer s/step: the same for every seed
    for text, variant, ref in ((one_way, "adamw", "muon"), (other_way, "muon", "adamw")):
        pct = 100 * (opt[variant] - opt[ref]) / opt[ref]
        assert f"| {variant} | optimizer s/step | 3 | {pct:+.2f}% |" in text  # -90.00% and +900.00%
        assert ("The mean difference is the mean over seeds of each seed's percent difference, 100 (variant − "
                "reference) / reference: it is not antisymmetric") in text


def test_dit_report_counts_selection_seeds_in_the_scan_only(tmp_path):
    """dit-report on a two-phase study: the selection seed's run at the selected lr was averaged with the evaluation
    seeds in Table 1 (4 seeds); it is in the lr-scan table only, and the Runs table and the first line say so."""
    import statistics

    from dit_train.study import report

    sweep = tmp_path / "sweep"
    two_phase_sweep(sweep, {"selection_seeds": [0]})
    text = report.build_report(str(sweep))
    evaluated = [FINAL["adamw"][s] for s in (1, 2, 3)]
    mean_sd = f"{statistics.mean(evaluated):.4g} ± {statistics.stdev(evaluated):.2g}"
    table1 = text.split("## Table 1")[1].split("## Table 2")[0]
    assert "| dit_s | adamw lr=0.008 | 0.008 | 3 | finished |" in table1, table1
    assert table1.split("| dit_s | adamw lr=0.008 |")[1].splitlines()[0].endswith(f"| {mean_sd} |"), table1
    # the scan (Table 4) is the selection seed's alone: seed 0's 0.4 at the selected lr, not a mean with seeds 1-3
    table4 = text.split("## Table 4")[1].split("## Table 5")[0]
    assert "| dit_s | adamw | 100 / 0.4 | 300 / 0.9 | — |" in table4, table4
    assert "6 selection-seed run(s) (seed 0, which chose the learning rates) are not counted" in text
    assert "| adamw_lr0.008_s0 | finished; selection seed: counted in the lr scan only |" in text
    assert "| adamw_lr0.008_s1 | finished |" in text
