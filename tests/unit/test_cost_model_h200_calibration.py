"""The H200 profile is calibrated on the first GPU check run, docs/gpu_check_runs/2026-12-04_1210.jsonl: its measured
numbers must stay what that file gives, and the docs must print what it holds, so a change of either is noticed."""

import json
import statistics
from pathlib import Path

import pytest

from benchmarks.cost_model.contender import Optim
from benchmarks.cost_model.hardware import PROFILES
from benchmarks.cost_model.predict import predict
from benchmarks.cost_model.shapes import model_shapes
from dit_train.optim.directions import ns5_executed_flops
from dit_train.optim.directions.ns5 import uses_gram

ROOT = Path(__file__).resolve().parents[2]
H200 = PROFILES["h200"]


def _stage(name: str) -> dict:
    rows = [json.loads(line) for line in (ROOT / "docs/gpu_check_runs/2026-12-04_1210.jsonl").read_text().splitlines() if line.strip()]
    return next(r for r in rows if r["stage"] == name)


def _executed_rate(run: dict) -> float:
    """flop/s of the automatic form's executed GEMMs in one ns5 run of the check."""
    m, n = run["shape"]
    return run["batch"] * ns5_executed_flops(m, n) / run[run["auto"] + "_s"]


def _dit1b3() -> tuple[dict, list]:
    p = predict(model_shapes("dit_1b3"), Optim("periodic_rowwise", 3, "spectral", "owner"), H200, 1, 32)
    return p, _stage("dit1b3_compile_ac")["values"]["step_s"]  # compile, first RowNorm, RowNorm, refresh


def test_the_check_chose_the_form_the_model_prices():
    for run in _stage("ns5")["values"]["runs"]:
        assert (run["auto"] == "gram") == uses_gram(*run["shape"]), run


def test_ns5_rates_are_the_measured_ones():
    rates = dict(H200.ns5_rates)
    runs = [r for r in _stage("ns5")["values"]["runs"] if r["batch"] == 8]
    side_4096 = statistics.median(_executed_rate(r) for r in runs if min(r["shape"]) == 4096)
    side_256 = [_executed_rate(r) for r in runs if min(r["shape"]) == 256]
    assert rates[4096] == pytest.approx(side_4096, rel=0.03)
    assert rates[256] == pytest.approx(side_256[0], rel=0.05)


def test_dit1b3_refresh_minus_rownorm_and_rownorm_step_are_predicted():
    p, step_s = _dit1b3()
    measured_diff = step_s[3] - step_s[2]
    assert p["steps"]["refresh"] - p["steps"]["rownorm"] == pytest.approx(measured_diff, rel=0.03)
    assert p["compute"] + p["steps"]["rownorm"] == pytest.approx(step_s[2], rel=0.03)
    assert p["compute"] + p["steps"]["refresh"] == pytest.approx(step_s[3], rel=0.03)


def test_h100_keeps_the_assumptions():
    h100 = PROFILES["h100"]
    assert (h100.mfu, h100.ns5_of_peak, h100.ns5_rates) == (0.40, 0.5, ())


def test_docs_print_the_measured_numbers():
    env = _stage("env")["values"]
    _, step_s = _dit1b3()
    page = (ROOT / "docs/cost_model.md").read_text()
    section = page[page.index("## Calibrated on the GPU check"):]
    for number in (f"{env['gemm_flops'] / 1e12:.0f} TFLOP/s", f"{env['gemm_flops'] / env['spec_bf16_flops']:.2f}",
                   f"{step_s[2] * 1e3:.1f} ms", f"{step_s[3] * 1e3:.1f} ms", f"{(step_s[3] - step_s[2]) * 1e3:.1f} ms"):
        assert number in section, number
    for run in _stage("ns5")["values"]["runs"]:
        m, n = run["shape"]
        assert f"| {m}x{n} | {run['batch']} | {run[run['auto'] + '_s'] * 1e3:.2f} |" in section, run
