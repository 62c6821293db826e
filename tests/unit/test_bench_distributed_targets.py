"""benchmarks/bench_distributed.py's targets: the floors it derives per run, and docs/bench_distributed.md, which
describes them (it published fixed targets, 0.340 and 0.450, after the tool had stopped using them)."""

import argparse
import os
import re

import pytest

from benchmarks.bench_distributed import TIME_SLACK, targets
from conftest import ROOT

P = 4
WALL = {"muon-gather": 2.0, "muon-owner": 0.6, "rownorm": 0.05, "periodic_rowwise K=3 gather": 0.8,
        "periodic_rowwise K=3 owner": 0.3}
MEAN = {"muon-gather": 1000.0, "muon-owner": 500.0, "periodic_rowwise K=3 gather": 353.0,
        "periodic_rowwise K=3 owner": 186.0, "rownorm": 29.0}


def lines():
    s = {k: {"wall": WALL[k], "bytes_mean": MEAN[k], "bytes_max": MEAN[k] * 1.01} for k in WALL}
    return targets(s, {"width": 128, "depth": 4}, argparse.Namespace(preset="dit_xs"), P)


def test_the_floors_are_the_documented_formulas():
    t = {name: (value, goal, why) for name, value, goal, why in lines()}
    for mode, refresh in (("gather", 1.0), ("owner", 2 / P)):  # owner: 2 (p - 1)/p^2 against (p - 1)/p
        _, goal, why = t[f"periodic K=3 {mode}: logical bytes / muon-gather"]
        printed_refresh, rownorm = map(float, re.search(r"refresh ([\d.]+) \+ 2 x RowNorm step ([\d.]+)", why).groups())
        assert printed_refresh == pytest.approx(refresh, abs=5e-4)
        assert 0 < rownorm < 0.1 and goal == pytest.approx((refresh + 2 * rownorm) / 3 * 1.0005, rel=1e-3)
        _, goal, _ = t[f"periodic K=3 {mode}: optimizer time / muon-gather"]
        assert goal == pytest.approx(TIME_SLACK * (WALL[f"muon-{mode}"] + 2 * WALL["rownorm"]) / 3 / WALL["muon-gather"])
    assert t["muon-owner bytes per rank (mean) / muon-gather"][1] == t["muon-owner bytes, busiest rank / muon-gather"][1] == 2 / P


def test_the_doc_describes_every_target_line_the_tool_prints():
    with open(os.path.join(ROOT, "docs", "bench_distributed.md")) as f:
        doc = f.read()
    section = doc.split("## Targets, as the tool prints them\n")[1].split("\n## ")[0]
    for name, *_ in lines():
        assert f"`{re.sub(r'K=3 (gather|owner)', 'K=3 <mode>', name)}`" in section, name
    assert f"{TIME_SLACK:g} x (muon-<mode> + 2 x rownorm) / 3" in section and "| 2 / p |" in section
