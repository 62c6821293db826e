"""A study report, and a run's closing line, never show nan or a plot without data: records shaped like
`dit-study smoke` leaves (one FD point per run, a run whose first validation comes after the
budget, no phase timings)."""

import json
import os
import re

import pytest
import yaml

from conftest import needs_fashion
from dit_train.study import report

NAN = re.compile(r"\bnan\b", re.IGNORECASE)


def write_run(folder, opt, K, val_times, fd):
    """Four logged steps without phase timings (train.timing=false), validation at steps 2 and 4 at the given
    active times, one FD point at the end."""
    os.makedirs(folder)
    with open(os.path.join(folder, "config.yaml"), "w") as f:
        yaml.safe_dump({"model": {"name": "dit_s"}, "optimizer": {"name": opt, **({"K": K} if K else {})},
                        "seed": 0}, f)
    t2, t4 = val_times  # a validation row's active time is the train row's of its step
    active = {1: t2 / 2, 2: t2, 3: (t2 + t4) / 2, 4: t4}
    rows = [{"step": s, "train/loss": 1.7, "active_time_s": a} for s, a in active.items()]
    rows += [{"step": 2, "val/loss": 1.69}, {"step": 4, "val/loss": 1.65},
             {"step": 4, "fd": fd, "fd_encoder": "inception", "fd_num_gen": 8, "fd_num_ref": 16}]
    with open(os.path.join(folder, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    with open(os.path.join(folder, "summary.json"), "w") as f:
        json.dump({"steps": 4, "val_loss": 1.65}, f)


@pytest.fixture
def smoke_like(tmp_path):
    sweep = tmp_path / "sweep"
    # AdamW's last validation (1.0 s) is the budget; periodic_rowwise validates first at 1.5 s
    write_run(sweep / "adamw", "adamw", None, (0.5, 1.0), 435.4559)
    write_run(sweep / "periodic", "periodic_rowwise", 2, (1.5, 2.0), 435.4261)
    return sweep


def test_report_marks_missing_values_n_a_with_the_reason(smoke_like):
    text = report.build_report(str(smoke_like))
    assert not NAN.search(text), [ln for ln in text.splitlines() if NAN.search(ln)]
    none = "n/a (no validation by the budget)"
    assert f"| dit_s | periodic_rowwise K=2 | 1 s | {none} | {none} | {none} |" in text
    assert "| dit_s | adamw | 1 s | 4 | 1.65 | — |" in text
    no_muon = "n/a (no muon value)"  # each n/a says why: this sweep has no muon run to compare with
    assert (f"| dit_s | adamw | n/a (not timed) | {no_muon} | n/a (not timed) | {no_muon} | 0 | {no_muon} | 1 s | "
            f"{no_muon} |") in text
    assert "step_time_phases.png" not in os.listdir(smoke_like)  # no bar chart of nothing


def test_single_points_are_markers_on_axes_without_offset(smoke_like, monkeypatch):
    figures = {}
    save = report.save_figure  # renders into memory, then replaces the file (never through a planted link)

    def keep(fig, path, *a, **kw):
        figures[os.path.basename(path)] = fig
        return save(fig, path, *a, **kw)

    monkeypatch.setattr(report, "save_figure", keep)
    report.build_report(str(smoke_like))
    ax = figures["fd_vs_active_time.png"].axes[0]
    assert [(len(line.get_xdata()), line.get_marker()) for line in ax.get_lines()] == [(1, "o"), (1, "o")]
    for fig in figures.values():
        fig.canvas.draw()
        for ax in fig.axes:  # '+4.354e2' above the FD axis made both points read as 0.03 and 0.06
            assert ax.yaxis.get_major_formatter().get_offset() == ""
            assert ax.xaxis.get_major_formatter().get_offset() == ""


@needs_fashion
def test_done_line_without_validation_says_n_a(tiny_cfg, capsys):
    """`python -m dit_train train.val_every=0 ...` ends with `done: ... val_loss=n/a ...`, not val_loss=nan."""
    from dit_train.trainer.loop import run

    tiny_cfg.train.val_every = 0
    tiny_cfg.train.ckpt_every = 0
    run(tiny_cfg)
    done = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("done:")]
    assert len(done) == 1 and " val_loss=n/a " in done[0] and re.search(r" train_loss=\d+\.\d{4} ", done[0])


def test_a_ratio_to_muon_says_which_side_is_missing():
    nan = float("nan")
    assert report.ratio(1.0, 4.0, "muon") == "0.250"
    assert report.ratio(1.0, nan, "muon lr=0.004") == "n/a (no muon lr=0.004 value)"
    assert report.ratio(nan, 4.0, "muon") == "n/a (not timed)"
    assert report.ratio(0.0, 0.0, "muon") == "n/a (muon: 0)"  # one process: no bytes sent by either
