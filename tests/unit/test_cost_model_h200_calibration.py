"""The H200 profile is calibrated on the GPU check runs of 2026-12-04 (docs/gpu_check_runs/): the optimizer's NS5
rates on the first (1210.jsonl), forward + backward (benchmarks/cost_model/compute.py: counted from the model,
priced per op) on all three (1210 and 1747 jsonl, the 1755 table). Its measured numbers must stay what those files
give, the fitted parameters what the fit gives, the table what docs/cost_model.md prints, and each formula of the
counted term is checked against an independent reference (FlopCounterMode, the bytes of an op by hand, the
recompute as the blocks' forward), so a change of any is noticed."""

import json
from collections import Counter
import statistics
from dataclasses import replace
from pathlib import Path

import pytest

from benchmarks.cost_model import gpu_calibration
from benchmarks.cost_model.compute import (ComputeRates, compute_seconds, count_forward_backward, gemm_curve,
                                           records_by_depth,
                                           record_seconds)
from benchmarks.cost_model.contender import Optim
from benchmarks.cost_model.hardware import H200_FITTED, H200_GEMM_POINTS, PROFILES
from benchmarks.op_cost import MATMULS, OpRecord
from benchmarks.cost_model.predict import predict
from benchmarks.cost_model.shapes import model_shapes
from dit_train.model.dit import load_preset
from dit_train.model.flops import training_flops_per_image
from dit_train.optim.directions import ns5_executed_flops
from dit_train.optim.directions.ns5 import uses_gram

ROOT = Path(__file__).resolve().parents[2]
H200 = PROFILES["h200"]


def _stage(name: str, run: str = "2026-12-04_1210") -> dict:
    rows = [json.loads(line) for line in (ROOT / f"docs/gpu_check_runs/{run}.jsonl").read_text().splitlines()
            if line.strip()]
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


def test_dit1b3_refresh_minus_rownorm_is_predicted():
    """NS5's cost on one GPU (the optimizer's ns5_rates[1536] is fitted to it); the steps themselves are forward +
    backward's, in the three-run table below (the single MFU fitted to this RowNorm step is gone)."""
    p, step_s = _dit1b3()
    measured_diff = step_s[3] - step_s[2]
    assert p["steps"]["refresh"] - p["steps"]["rownorm"] == pytest.approx(measured_diff, rel=0.03)


def test_the_h200_counts_forward_backward():
    assert H200.mfu is None and H200.compute is not None  # forward + backward counted, no MFU read (H100: its file)


def test_docs_print_the_measured_numbers():
    env = _stage("env")["values"]
    _, step_s = _dit1b3()
    page = (ROOT / "docs/cost_model.md").read_text()
    section = page[page.index("## Calibrated on the GPU check (H200, one run"):]
    for number in (f"{env['gemm_flops'] / 1e12:.0f} TFLOP/s", f"{env['gemm_flops'] / env['spec_bf16_flops']:.2f}",
                   f"{step_s[2] * 1e3:.1f} ms", f"{step_s[3] * 1e3:.1f} ms", f"{(step_s[3] - step_s[2]) * 1e3:.1f} ms"):
        assert number in section, number
    for run in _stage("ns5")["values"]["runs"]:
        m, n = run["shape"]
        assert f"| {m}x{n} | {run['batch']} | {run[run['auto'] + '_s'] * 1e3:.2f} |" in section, run


# ---- forward + backward counted from the model (compute.py), calibrated on three runs (gpu_calibration.py) ----
RUN_3_TABLE = (ROOT / gpu_calibration.RUN_3).read_text()
SMALL = load_preset("dit_1b3", 64, 2)  # 2 blocks of width 64, one head: counted in a second
RATES = ComputeRates(gemm_max=500e12, gemm_half_side=1000, sdpa=300e12, memory_efficiency=0.5, op_s=10e-6)


@pytest.fixture(scope="module")
def table_rows():
    return gpu_calibration.rows()


def test_the_gemm_curve_runs_through_the_rates_measured_in_the_files():
    env = _stage("env", "2026-12-04_1747")["values"]
    ns5_1536 = next(line for line in RUN_3_TABLE.splitlines() if "NS5 1536x1536 (automatic: plain)" in line)
    assert dict(H200_GEMM_POINTS) == {8192: pytest.approx(env["gemm_flops"], rel=1e-3),
                                      4096: dict(H200.ns5_rates)[4096], 1536: 469e12}
    assert "b8: plain 469," in ns5_1536
    for side, rate in H200_GEMM_POINTS:  # a curve of two parameters through three points: within 3% of each
        assert H200.compute.gemm_rate(side) == pytest.approx(rate, rel=0.03)
    assert gemm_curve(((1000, 250e12), (3000, 375e12))) == pytest.approx((500e12, 1000))  # by hand: 1/R linear


def test_the_third_runs_constants_are_its_table():
    for name, steps in gpu_calibration.RUN_3_STEPS.items():
        text = " / ".join(f"{s * 1e3:.0f}" for s in steps) + " ms"
        assert any(line.startswith(f"| {name} | dit_15b rank 0 of") and text in line
                   for line in RUN_3_TABLE.splitlines()), (name, text)


def test_the_points_are_the_files_steps_and_configurations():
    points = {p.name: p for p in gpu_calibration.measured_points()}
    expect = {"dit15b_w32_ac (run A)": ("dit15b_w32_ac", "1747"), "dit15b_w8_ac": ("dit15b_w8_ac", "1747")}
    for name, (stage, run) in expect.items():
        v = _stage(stage, f"2026-12-04_{run}")["values"]
        p = points[name]
        assert (p.world, p.images, p.ac, p.step_s) == (v["world"], v["micro_batch"], v["activation_checkpointing"],
                                                       tuple(v["step_s"]))
    assert [round(s * 1e3) for s in points["dit1b3_eager"].step_s] == [224, 350, 214]
    assert [round(s * 1e3, 1) for s in points["dit1b3_compile_ac (run A)"].step_s] == [196.2, 317.3]
    assert [round(s * 1e3) for s in points["dit1b3_compile_ac (run B)"].step_s] == [263, 449, 263]
    assert [round(s * 1e3) for s in points["dit15b_w8_ac"].step_s] == [5444, 5626]
    assert (points["dit15b_w8"].world, points["dit15b_w8"].images) == (8, 16)


def test_counted_flops_are_flop_counters():
    """The matmuls' FLOPs and SDPA's, counted record by record, against FlopCounterMode's model FLOPs: equal once
    SDPA's backward is taken at its convention (2 x forward, not the 2.5 x of a recomputing flash backward)."""
    recs = count_forward_backward(SMALL, 3)
    gemm = sum(r.flops for r in recs if r.op in MATMULS)
    sdpa_fwd = sum(r.flops for r in recs if r.category == "sdpa" and not r.op.endswith("_backward"))
    sdpa_bwd = sum(r.flops for r in recs if r.category == "sdpa" and r.op.endswith("_backward"))
    assert sdpa_bwd == 2.5 * sdpa_fwd > 0
    assert gemm + sdpa_fwd + sdpa_bwd * 2 / 2.5 == training_flops_per_image(SMALL) * 3


@pytest.mark.parametrize("depth", [3, 5])
def test_counting_two_blocks_gives_every_depths_records(depth):
    """The counted records at depth D, extrapolated from depths 1 and 2, equal a full count at D, for qk-norm
    blocks and for SwiGLU blocks without qk-norm (a mutation of the extrapolation, D - 2 or D blocks, or the
    blocks' records taken from depth 1 alone, changes the block records' counts)."""
    plain = load_preset("dit_1b3", 64, depth)
    swiglu = plain.copy()
    swiglu.swiglu, swiglu.qk_norm = True, False
    for cfg in (plain, swiglu):
        full = Counter(count_forward_backward(cfg, 2))
        assert records_by_depth(cfg, 2) == full
        assert full != Counter(count_forward_backward(load_preset("dit_1b3", 64, 2), 2))


def test_an_elementwise_op_moves_its_activation_once_each_way():
    """gelu on the MLP's hidden activation: 3 images x 256 tokens x 4 x 64 bf16 values read and as many written."""
    gelu = [r for r in count_forward_backward(SMALL, 3) if r.op == "gelu"]
    assert len(gelu) == SMALL.depth
    assert all((r.read, r.written, r.phase) == (3 * 256 * 256 * 2, 3 * 256 * 256 * 2, "block_forward") for r in gelu)


def test_a_record_is_priced_by_its_roofline():
    mm = OpRecord("backward", "mm", "gemm", read=3_000_000, written=1_000_000, flops=2 * 512 * 2048 * 4096,
                  dims=(512, 2048, 4096))
    rate = 500e12 * 512 / 1512  # shortest side 512
    assert record_seconds(mm, RATES, 4e12) == {"gemm": pytest.approx(mm.flops / rate), "launch": 10e-6}
    skinny = replace(mm, flops=2 * 4 * 2048 * 4096, dims=(4, 2048, 4096), read=4e9, written=0)  # memory-bound
    assert record_seconds(skinny, RATES, 4e12)["gemm"] == pytest.approx(4e9 / (4e12 * 0.5))
    add = OpRecord("forward", "add", "stream", read=8e9, written=4e9)
    assert record_seconds(add, RATES, 4e12) == {"memory": pytest.approx(12e9 / 2e12), "launch": 10e-6}
    sdpa = OpRecord("forward", "_scaled_dot_product_cudnn_attention", "sdpa", 1, 1, flops=3e12)
    assert record_seconds(sdpa, RATES, 4e12) == {"sdpa": pytest.approx(0.01), "launch": 10e-6}


def test_activation_checkpointing_adds_the_blocks_forward_once():
    shapes = model_shapes("dit_1b3", 64, 2)
    recs = count_forward_backward(SMALL, 3)
    block_forward = sum(sum(record_seconds(r, RATES, 4e12).values()) for r in recs if r.phase == "block_forward")
    everything = sum(sum(record_seconds(r, RATES, 4e12).values()) for r in recs)
    off = compute_seconds(shapes, RATES, 4e12, 3)
    on = compute_seconds(shapes, RATES, 4e12, 3, activation_checkpointing=True)
    assert off["compute"] == pytest.approx(everything) and off["recompute"] == 0
    assert on["compute"] - off["compute"] == pytest.approx(block_forward) == pytest.approx(on["recompute"])
    assert on["ops"] - off["ops"] == sum(r.phase == "block_forward" for r in recs) > 0
    with pytest.raises(ValueError, match="images 0 is not valid"):
        count_forward_backward(SMALL, 0)
    with pytest.raises(ValueError, match="memory_efficiency"):
        replace(RATES, memory_efficiency=1.5)


def test_the_fit_gives_the_profiles_parameters():
    fit = gpu_calibration.fit_h200()
    assert (fit["memory_efficiency"], fit["op_s"]) == pytest.approx(
        (H200_FITTED["memory_efficiency"], H200_FITTED["op_s"]))
    assert (H200.compute.memory_efficiency, H200.compute.op_s) == (H200_FITTED["memory_efficiency"],
                                                                   H200_FITTED["op_s"])


# predicted / measured of every row, as docs/cost_model.md prints them ("Calibrated on three GPU check runs")
RATIOS = {("dit15b_w32", "rownorm"): 1.12, ("dit15b_w32", "refresh"): 1.16,
          ("dit15b_w32_ac (run B)", "rownorm"): 1.04, ("dit15b_w32_ac (run B)", "refresh"): 1.03,
          ("dit15b_w8", "rownorm"): 1.07, ("dit15b_w8", "refresh"): 1.13,
          ("dit15b_w32_ac (run A)", "rownorm"): 0.95, ("dit15b_w32_ac (run A)", "refresh"): 1.04,
          ("dit15b_w8_ac", "rownorm"): 0.98, ("dit15b_w8_ac", "refresh"): 0.99,
          ("dit1b3_eager", "rownorm"): 0.93, ("dit1b3_eager", "refresh"): 0.92,
          ("dit1b3_compile_ac (run A)", "rownorm"): 1.34, ("dit1b3_compile_ac (run A)", "refresh"): 1.21,
          ("dit1b3_compile_ac (run B)", "rownorm"): 1.00, ("dit1b3_compile_ac (run B)", "refresh"): 0.85}


def test_predicted_over_measured_is_the_documented_table(table_rows):
    got = {(r["point"], r["kind"]): round(r["predicted"] / r["measured"], 2) for r in table_rows}
    assert got == RATIOS
    held = [v for (point, kind), v in got.items()
            if not next(r["fit"] for r in table_rows if (r["point"], r["kind"]) == (point, kind))]
    outside = {k for k, v in got.items() if not 0.75 <= v <= 1.25}
    assert outside == {("dit1b3_compile_ac (run A)", "rownorm")} and len(held) == 13


def test_docs_print_the_three_run_table(table_rows):
    page = (ROOT / "docs/cost_model.md").read_text()
    section = page[page.index("## Calibrated on three GPU check runs"):]
    for line in gpu_calibration.table().splitlines():
        assert line in section, line


def test_the_check_line_prices_activation_checkpointing():
    from benchmarks.cost_model.predict import describe_prediction

    opt = {"name": "periodic_rowwise", "K": 3, "rownorm_scale": "spectral"}
    line = {ac: describe_prediction(SMALL, opt, 1, 3, "NVIDIA H200", network=False, activation_checkpointing=ac)
            for ac in (False, True)}
    step = {ac: int(text.split("step ")[1].split(" ms")[0]) for ac, text in line.items()}
    assert "fwd+bwd counted, AC" in line[True] and "MFU" not in line[True]
    assert step[True] > step[False]
