"""scripts/comm_volume.py: the per-rank bytes of docs/scaling_out.md's FSDP/HSDP table from the preset shapes."""

import importlib.util
import os

import pytest

from conftest import ROOT


def _script():
    spec = importlib.util.spec_from_file_location("comm_volume", os.path.join(ROOT, "scripts", "comm_volume.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_volumes_follow_the_ring_formulas():
    cv = _script()
    counts = {"params": 1000, "blocks": [300, 300, 300], "matrix": 800}
    fsdp = cv.volumes(counts, shard=4, replicas=1, reduce_bytes=4, reshard=True)
    assert fsdp["ag_fwd"] == 3 / 4 * 2000 and fsdp["ag_bwd"] == 3 / 4 * 600 * 2 and fsdp["rs"] == 3 / 4 * 4000
    assert fsdp["ar_replicas"] == 0 and fsdp["fsdp_total"] == fsdp["ag_fwd"] + fsdp["ag_bwd"] + fsdp["rs"]
    hsdp = cv.volumes(counts, shard=2, replicas=2, reduce_bytes=2, reshard=False)
    assert hsdp["ag_bwd"] == 0 and hsdp["rs"] == 1 / 2 * 2000 and hsdp["ar_replicas"] == 2 * 1 / 2 * 500 * 2
    assert hsdp["muon_gather"] == 1 / 2 * 1600 and hsdp["muon_owner"] == 2 * 1 / 4 * 1600 * 2


def test_dit_15b_on_4_nodes_moves_about_117_gb_per_rank_under_fsdp_and_11_between_nodes_under_hsdp():
    cv = _script()
    counts = cv.preset_counts("dit_15b")
    assert counts["params"] == pytest.approx(15.16e9, rel=1e-3) and len(counts["blocks"]) == 50
    fsdp = cv.volumes(counts, 32, 1, 4, True)
    hsdp = cv.volumes(counts, 8, 4, 4, True)
    assert fsdp["fsdp_total"] / 1e9 == pytest.approx(116.8, abs=0.05)
    assert hsdp["ar_replicas"] / 1e9 == pytest.approx(11.4, abs=0.05)
    assert "| dit_15b | 15.16 B | HSDP 4 x 8 |" in cv.table(["dit_15b"], 4, 8, "fp32", True)
