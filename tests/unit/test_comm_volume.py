"""dit-comm-volume: the per-rank bytes of docs/scaling_out.md's FSDP/HSDP table from the preset shapes."""

import pytest
import torch


def _script():
    from dit_train.parallel import comm_volume_table

    return comm_volume_table


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


def test_an_integer_reshard_regathers_within_its_group():
    from dit_train.parallel.comm_volume import fsdp_volumes

    v = fsdp_volumes(1000, [300, 300, 300], shard=8, replicas=1, reduce_bytes=4, reshard=2)
    assert v["ag_bwd"] == 1 / 2 * 600 * 2 and v["ag_fwd"] == 7 / 8 * 2000


@pytest.mark.parametrize("replicate, env, nodes", [(4, {"LOCAL_WORLD_SIZE": "8"}, 4),
                                                   (1, {"SLURM_NTASKS_PER_NODE": "8(x4)"}, 4), (1, {}, 1)])
def test_the_start_line_gives_a_runs_traffic_between_nodes(monkeypatch, replicate, env, nodes):
    """What a sharded run prints at start: dit_15b on 32 ranks moves ~117 GB per rank per step through FSDP2;
    between 4 nodes all of it under plain FSDP, only the replicas' all-reduce under HSDP (2 x 3/4 x P/8 x 4 bytes:
    11.4 GB, docs/scaling_out.md's table), nothing on one node."""
    from dit_train.parallel.comm_volume import describe_run, ranks_per_node
    from dit_train.model.dit import build_model, load_preset
    from dit_train.parallel.fsdp import DistInfo, resolve_plan

    for name in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    model = build_model(load_preset("dit_15b"), device="meta")
    P = sum(p.numel() for p in model.parameters())
    last = sum(p.numel() for p in model.blocks[-1].parameters())
    plan = resolve_plan({"replicate": replicate, "mixed_precision": "bf16"}, DistInfo(0, 32, torch.device("cpu")))
    S = 32 // replicate
    total = (S - 1) / S * (2 * P + 2 * (sum(p.numel() for p in model.blocks.parameters()) - last) + 4 * P) \
        + 2 * (replicate - 1) / replicate * P / S * 4
    crossing = 0 if nodes == 1 else (2 * 3 / 4 * P / 8 * 4 if replicate > 1 else total)
    line = describe_run(model, plan, 32, ranks_per_node(32))
    assert line == (f"FSDP2 traffic per rank per step: {total / 1e9:.2f} GB, {crossing / 1e9:.2f} GB of it between "
                    f"nodes ({nodes} node(s) of {32 // nodes} ranks{', HSDP' if replicate > 1 else ''})")
    assert 116 < total / 1e9 < 118


@pytest.mark.parametrize("per_unit, regathered_blocks", [(1, 49), (2, 48), (4, 48), (7, 49), (50, 0)])
def test_backward_regathers_every_unit_of_blocks_but_the_last(per_unit, regathered_blocks):
    """parallel.blocks_per_fsdp_unit: the last unit stays gathered from forward to backward, so the backward
    all-gather moves every block outside it: dit_15b's 50 blocks by 4 end in a unit of 2 (48 regathered), by 7 in
    one of 1 (49), and one unit of all 50 regathers nothing. The forward gather and the reduce-scatter move every
    parameter whatever the units."""
    from dit_train.model.dit import build_model, load_preset
    from dit_train.parallel.comm_volume import GB, describe_run
    from dit_train.parallel.fsdp import DistInfo, resolve_plan

    model = build_model(load_preset("dit_15b"), device="meta")
    P = sum(p.numel() for p in model.parameters())
    per_block = sum(p.numel() for p in model.blocks[0].parameters())  # every block has the same shapes
    plan = resolve_plan({"blocks_per_fsdp_unit": per_unit, "mixed_precision": "bf16"},
                        DistInfo(0, 32, torch.device("cpu")))
    total = 31 / 32 * (2 * P + 2 * regathered_blocks * per_block + 4 * P)
    assert describe_run(model, plan, 32, 32).startswith(f"FSDP2 traffic per rank per step: {total / GB:.2f} GB,")


@pytest.mark.parametrize("preset, world, replicas", [("dit_15b", 32, 4), ("dit_9b", 16, 2), ("dit_1b3", 8, 1)])
def test_the_scaling_study_shards_within_a_node_and_replicates_across_nodes(preset, world, replicas):
    """HSDP for the multi-node presets (one replica per node of model.launch): what leaves a node per step drops
    from all of FSDP's traffic to the replicas' all-reduce; the config validates at the preset's launch size (its
    memory: tests/integration/test_memory_estimate.py)."""
    from conftest import compose
    from dit_train.config import validate

    cfg = compose(["experiment=scaling_study", f"model={preset}", "run_dir=/tmp/unused", "data.root=/tmp",
                   "train.sample_every=0", "eval.every_n_steps=0"])
    assert cfg.parallel.replicate == replicas == cfg.model.launch.nodes
    validate(cfg, world_size=world)
