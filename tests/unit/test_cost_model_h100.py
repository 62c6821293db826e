"""The H100 profile is the H200's with the H100's HBM (benchmarks/cost_model/hardware.py: the same GH100 die, peak
and power; no H100 measured): its forward + backward counted and priced as the H200's, every memory-bound op at
3.35 TB/s instead of 4.8. The paper's table runs what experiment=scaling_study runs."""

from dataclasses import asdict
from pathlib import Path

import pytest
import yaml

from benchmarks.cost_model.compute import compute_seconds, record_seconds
from benchmarks.cost_model.hardware import PROFILES
from benchmarks.cost_model.paper import PAPER_ACTIVATION_CHECKPOINTING, PAPER_GLOBAL_BATCH, paper_settings
from benchmarks.cost_model.predict import describe_prediction
from benchmarks.cost_model.shapes import model_shapes
from benchmarks.op_cost import OpRecord
from dit_train.model.dit import load_preset

ROOT = Path(__file__).resolve().parents[2]
H100, H200 = PROFILES["h100"], PROFILES["h200"]
SMALL = load_preset("dit_1b3", 64, 2)  # 2 blocks of width 64: counted in a second


def test_the_h100_differs_from_the_h200_only_in_its_hbm():
    h100, h200 = asdict(H100), asdict(H200)
    assert {k for k in h100 if h100[k] != h200[k]} == {"name", "memory_bytes_s"}
    assert (H100.name, H100.memory_bytes_s, H200.memory_bytes_s) == ("H100 SXM", 3.35e12, 4.8e12)  # data sheets
    assert H100.compute is H200.compute and H100.mfu is None  # counted, not at an assumed MFU


def test_a_memory_bound_op_on_the_h100_by_hand():
    """An add reading 8 GB and writing 4 GB: 12e9 B / (3.35e12 B/s x the fitted share 1.0) = 3.582 ms, + the fitted
    15.5 us launch; on the H200 12e9 / 4.8e12 = 2.5 ms."""
    add = OpRecord("forward", "add", "stream", read=8e9, written=4e9)
    assert record_seconds(add, H100.compute, H100.memory_bytes_s) == {"memory": pytest.approx(3.5820896e-3),
                                                                        "launch": pytest.approx(15.5e-6)}
    assert record_seconds(add, H200.compute, H200.memory_bytes_s)["memory"] == pytest.approx(2.5e-3)


def test_forward_backward_differs_only_where_it_reads_memory():
    """The same counted records: SDPA and launches equal, the memory-bound ops 4.8 / 3.35 x slower, the GEMMs no
    faster (a memory-bound GEMM is its bytes' time)."""
    shapes = model_shapes("dit_1b3", 64, 2)
    h100, h200 = (compute_seconds(shapes, hw.compute, hw.memory_bytes_s, 3, True) for hw in (H100, H200))
    assert (h100["sdpa"], h100["launch"], h100["ops"]) == (h200["sdpa"], h200["launch"], h200["ops"])
    assert h100["memory"] == pytest.approx(h200["memory"] * 4.8 / 3.35)
    assert h100["gemm"] >= h200["gemm"] and h100["compute"] > h200["compute"]


def test_the_check_line_on_an_h100_counts_forward_backward():
    opt = {"name": "periodic_rowwise", "K": 3, "rownorm_scale": "spectral"}
    line = {dev: describe_prediction(SMALL, opt, 1, 3, dev, network=False, activation_checkpointing=True)
            for dev in ("NVIDIA H100 80GB HBM3", "NVIDIA H200")}
    step = {dev: int(text.split("step ")[1].split(" ms")[0]) for dev, text in line.items()}
    assert "H100 SXM, fwd+bwd counted, AC" in line["NVIDIA H100 80GB HBM3"]
    assert "MFU" not in line["NVIDIA H100 80GB HBM3"]
    assert step["NVIDIA H100 80GB HBM3"] >= step["NVIDIA H200"]


def test_the_paper_table_runs_the_scaling_studys_settings():
    study = yaml.safe_load((ROOT / "dit_train/conf/experiment/scaling_study.yaml").read_text())
    assert PAPER_GLOBAL_BATCH == study["train"]["batch_size"]
    assert PAPER_ACTIVATION_CHECKPOINTING is study["parallel"]["activation_checkpointing"]
    assert study["parallel"]["replicate"] == "${model.launch.nodes}"  # HSDP: the header says the table is not
    settings = paper_settings(H100)
    assert "activation checkpointing's recompute" in settings and "the study runs HSDP" in settings
    assert "MFU" not in settings


def test_every_paper_cell_prices_the_recompute(monkeypatch):
    """paper_table passes the study's activation checkpointing to each prediction (counting and shapes stubbed)."""
    from benchmarks.cost_model import paper

    seen = []

    def fake_predict(shapes, opt, hw, world, images, activation_checkpointing=False):
        seen.append((world, images, activation_checkpointing))
        return {k: 1.0 for k in ("compute", "fsdp_exposed", "optimizer", "step", "bytes")} | {"slowest": {}}

    monkeypatch.setattr(paper, "model_shapes", lambda preset: preset)
    monkeypatch.setattr(paper, "counted_ranks", lambda shapes, opts, world, gpu: {o: {0: {}} for o in opts})
    monkeypatch.setattr(paper, "predict", fake_predict)
    paper.paper_table(H100, ("dit_1b3",), (8, 32), "owner")
    assert sorted(set(seen)) == [(8, 128, True), (32, 32, True)] and len(seen) == 10


def test_ns5_from_the_gemm_curve_prices_only_the_sides_named():
    """dit_4b's 2560 and dit_9b's 3072 take the curve's rate R(s) = gemm_max s / (s + half) (by hand), not the 1536
    rate the nearest-at-or-below rule gives them; the measured sides and every other side keep theirs."""
    from benchmarks.cost_model.hardware import ns5_from_gemm_curve

    curve = ns5_from_gemm_curve(H100, [2560, 3072, 4096])
    c = H100.compute
    assert H100.ns5_rate(2560) == H100.ns5_rate(1536) == 254e12  # the rule the sensitivity replaces
    assert curve.ns5_rate(2560) == pytest.approx(c.gemm_max * 2560 / (2560 + c.gemm_half_side))
    assert curve.ns5_rate(3072) == pytest.approx(c.gemm_max * 3072 / (3072 + c.gemm_half_side))
    assert 550e12 < curve.ns5_rate(2560) < curve.ns5_rate(3072) < 600e12
    assert [curve.ns5_rate(s) for s in (256, 1536, 2047, 4096, 8192)] == [22e12, 254e12, 254e12, 640e12, 640e12]
    assert curve.op_rates().gemm == curve.ns5_rates  # op_cost prices the counted NS5 GEMMs from the same table
    with pytest.raises(ValueError, match=r"sides \[0\] are not valid"):
        ns5_from_gemm_curve(H100, [0])


def test_the_command_line_refuses_a_side_in_one_line_and_prices_the_named_ones(capsys):
    from benchmarks.cost_model import cli

    with pytest.raises(SystemExit) as e:
        cli.parse(["--paper", "--ns5-from-gemm-curve", "0"])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "python -m benchmarks.cost_model: error: --ns5-from-gemm-curve: sides [0] are not valid: positive integers "
        "(a matrix's short side)")
    args = cli.parse(["--paper", "--ns5-from-gemm-curve", "2560"])
    assert args.hw.ns5_rate(2560) == pytest.approx(H100.compute.gemm_rate(2560)) and args.hw.name == "H100 SXM"
    assert cli.parse(["--paper"]).hw is H100
