"""benchmarks/spectral_estimate_accuracy.py: the spectral RowNorm scale's estimate against the SVD's norm."""

import os
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, needs_fashion

from benchmarks.spectral_estimate_accuracy import estimates


@pytest.mark.parametrize("shape", [(48, 80), (80, 48)], ids=["wide", "tall"])
def test_estimates_are_exact_for_rank_1_and_a_lower_bound_otherwise(shape):
    g = torch.Generator().manual_seed(0)
    m, n = shape
    rank1 = torch.randn(m, 1, generator=g, dtype=torch.float64) @ torch.randn(1, n, generator=g, dtype=torch.float64)
    exact, (estimate,), cap = estimates(rank1, 1e-7)
    assert exact == pytest.approx(min(m, n) ** 0.5, rel=1e-9)  # unit rows, all parallel
    assert estimate == pytest.approx(exact, rel=1e-9)
    assert cap == pytest.approx(1 + (min(m, n) / max(m, n)) ** 0.5)
    # more rounds: still lower bounds, and closer (the power iteration's Rayleigh quotients increase)
    exact, ests, _ = estimates(torch.randn(m, n, generator=g, dtype=torch.float64), 1e-7, (2, 3, 8, 40))
    assert all(e <= exact * (1 + 1e-12) for e in ests) and ests == sorted(ests)
    assert ests[0] > 0.5 * exact and ests[-1] > 0.98 * exact


@needs_fashion
def test_the_script_prints_a_table_of_the_rownorm_steps():
    r = subprocess.run([sys.executable, "-m", "benchmarks.spectral_estimate_accuracy", "--steps", "5", "--window", "3",
                        "--rounds", "3,6", "experiment=debug"], cwd=ROOT, capture_output=True, text=True,
                       timeout=300, env={**os.environ, "PYTHONPATH": ROOT})
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [[c.strip() for c in line.split("|")[1:5]] for line in r.stdout.splitlines()
            if line.startswith("| 0-2 |") or line.startswith("| 3-5 |")]
    # K = 3, optimizer steps 0-4: RowNorm at 1, 2 (window 0-2) and 4 (window 3-5); a row per round count
    assert [(w, steps, rounds) for w, steps, _, rounds in rows] == [("0-2", "2", "3"), ("0-2", "2", "6"),
                                                                   ("3-5", "1", "3"), ("3-5", "1", "6")], r.stdout
