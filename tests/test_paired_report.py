"""scripts/paired_report.py on fabricated run folders: runs paired by seed at each variant's selected lr, the 95%
t-interval of the per-seed relative differences (against scipy), and the interpolated time to a target loss."""

import json
import math
import os
import sys

import pytest
import scipy.stats

from conftest import ROOT
from test_study import write_run

sys.path.insert(0, os.path.join(ROOT, "scripts"))
import paired_report  # noqa: E402


def rows(val: dict, fd: float, opt_s: float, step_s: float = 0.5) -> list[dict]:
    """Window-mean train rows every 100 steps (10 steps per window), validation at 200/400/600, FD at the end."""
    out = [{"step": s, "train/loss": 1.0, "time/optimizer": opt_s, "time/step": step_s, "window/steps": 10,
            "opt/refresh_steps": 3, "active_time_s": s * step_s} for s in range(100, 601, 100)]
    out += [{"step": s, "val/loss": v} for s, v in val.items()]
    return sorted(out + [{"step": 600, "fd": fd}], key=lambda r: r["step"])


FINAL = {"adamw": [0.40, 0.42, 0.41], "muon": [0.30, 0.33, 0.31], "pr": [0.31, 0.32, 0.33]}


def two_phase_sweep(sweep) -> None:
    """Three variants x 3 seeds at their selected lrs, plus a losing scan value each, and their study.json."""
    # final val loss per seed; each variant's curve is (2x, 1.5x, 1x) its final value at steps 200/400/600
    fd = {"adamw": [100.0, 110.0, 105.0], "muon": [80.0, 85.0, 82.0], "pr": [81.0, 84.0, 86.0]}
    spec = {"adamw": ("adamw", None, None, 8e-3), "muon": ("muon", None, None, 1.6e-2),
            "pr": ("periodic_rowwise", 3, "spectral", 8e-3)}
    study_runs = []
    for key, (opt, K, scale, lr) in spec.items():
        for seed in range(3):
            name = f"{key}_lr{lr}_s{seed}"
            v = FINAL[key][seed]
            write_run(sweep / name, "dit_s", opt, seed, rows({200: 2 * v, 400: 1.5 * v, 600: v}, fd[key][seed],
                                                             {"adamw": 0.01, "muon": 0.1, "pr": 0.04}[key]), K=K, lr=lr)
            study_runs.append({"name": name, "model": "dit_s", "optimizer": opt, "K": K, "scale": scale, "lr": lr,
                               "seed": seed, "phase": "scan" if seed == 0 else "seeds"})
        # a scan value that lost (and is left out of every comparison)
        loser = f"{key}_loser"
        write_run(sweep / loser, "dit_s", opt, 0, rows({600: 0.9}, 300.0, 0.01), K=K, lr=lr * 2)
        study_runs.append({"name": loser, "model": "dit_s", "optimizer": opt, "K": K, "scale": scale, "lr": lr * 2,
                           "seed": 0, "phase": "scan"})
    selection = {"dit_s adamw": {"lr": 8e-3}, "dit_s muon": {"lr": 1.6e-2},
                 "dit_s periodic_rowwise K=3 rownorm_scale=spectral": {"lr": 8e-3}}
    (sweep / "study.json").write_text(json.dumps({"experiment": "fab", "runs": study_runs,
                                                   "lr_selection": selection}))


def test_paired_differences_intervals_and_time_to_target(tmp_path):
    sweep = tmp_path / "sweep"
    two_phase_sweep(sweep)
    text = paired_report.build(str(sweep), None)
    assert "| periodic_rowwise K=3 (spectral) | 0.008 * (edge of the scan) | 0.3100 |" in text
    assert "| periodic_rowwise K=3 (spectral) | 0.016 | 0.9000 |" in text

    diffs = [100 * (p - m) / m for p, m in zip(FINAL["pr"], FINAL["muon"])]
    mean = sum(diffs) / 3
    half = scipy.stats.t.ppf(0.975, 2) * scipy.stats.tstd(diffs) / math.sqrt(3)
    row = f"| periodic_rowwise K=3 (spectral) | val loss @600 | 3 | {mean:+.1f}% | [{mean - half:+.1f}, {mean + half:+.1f}]"
    assert row in text, text
    # Muon against AdamW: every seed lower, and the interval excludes 0
    assert "| muon | val loss @600 | 3 | " in text and text.count("| lower |") >= 1
    # optimizer time: 0.04 vs 0.1 s per step for every seed -> -60%, no spread
    assert "| periodic_rowwise K=3 (spectral) | optimizer s/step | 3 | -60.0% | [-60.0, -60.0] | 3/3 | lower |" in text
    # the target is the highest final loss, AdamW seed 1's 0.42: every run reaches it, so every pair has a time to it
    assert "The target validation loss is the highest final value among the compared runs, 0.4200" in text
    assert "| muon | steps to target | 3 | " in text and "| adamw | steps to target | 3 | " in text
    # crossing: muon seed 0 (curve 0.60 @200, 0.45 @400, 0.30 @600) crosses it
    # at step 400 + 200 * (0.45 - 0.41) / 0.15
    run = paired_report.collect(str(sweep), json.loads((sweep / "study.json").read_text()))[0]["muon"][0]
    steps, secs = paired_report.crossing(run, 0.41)
    assert steps == pytest.approx(400 + 200 * 0.04 / 0.15) and secs == pytest.approx(0.5 * steps)
    assert math.isnan(paired_report.crossing(run, 0.1)[0])


def test_t_quantiles_match_scipy():
    for dof in range(1, 31):
        assert paired_report.t975(dof) == pytest.approx(scipy.stats.t.ppf(0.975, dof), abs=1e-3)


def test_a_study_without_a_finished_scan_is_refused(tmp_path):
    (tmp_path / "study.json").write_text(json.dumps({"experiment": "optimizer_comparison_cpu", "runs": []}))
    with pytest.raises(SystemExit, match="has no lr_selection"):
        paired_report.build(str(tmp_path), None)


def test_publishing_a_two_phase_study_writes_its_paired_report_rebuilt_exactly_from_the_records(tmp_path,
                                                                                                 monkeypatch):
    import publish_study

    two_phase_sweep(tmp_path / "sweep")
    monkeypatch.chdir(tmp_path)
    assert publish_study.main(["sweep", "docs/results/fab"]) == 0
    published = (tmp_path / "docs/results/fab/report.md").read_text()
    assert published.startswith("# Paired optimizer comparison: fab")
    assert "Built by `python scripts/paired_report.py docs/results/fab/runs --out docs/results/fab`" in published
    assert paired_report.build("docs/results/fab/runs", "docs/results/fab") == published
