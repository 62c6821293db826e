"""The seeded initialisation without a full copy: each rank computes its own FSDP2 shards (build.build_models), and
2 or 3 gloo ranks together hold exactly the single process's weights, buffers and EMA, bit for bit, with no rank
ever allocating a whole parameter; the DiT distributions (xavier, N(0, 0.02), adaLN-Zero) are kept; a resume or
fork never runs the init."""

import math
import os

import pytest
import torch
from omegaconf import OmegaConf

from conftest import compose, gloo_group, needs_fashion, spawn_ranks
from dit_train.model import init as weight_init
from dit_train.model.dit import build_model, sincos_pos_embed_2d

# every rule kind (qk-norm RMSNorm ones, cross-attention zeros, class and timestep N(0, 0.02)); hidden 48 over 3
# ranks gives uneven shards of every matrix, 16 x 16-row patches give a position table of 4 rows
OVERRIDES = ["model.hidden_size=48", "model.depth=2", "model.num_heads=2", "model.patch_size=8",
             "model.qk_norm=true", "model.text_dim=16", "seed=7", "optimizer=adamw"]
TINY_RUN = ["model.hidden_size=32", "model.depth=1", "model.num_heads=1", "model.patch_size=8",
            "train.batch_size=4", "train.val_samples=4", "train.val_batch_size=4", "train.val_t_points=1",
            "train.val_every=0", "train.sample_every=0", "train.progress=false", "train.warmup_steps=0",
            "train.ckpt_every=2", "train.steps=2", "optimizer=adamw"]
SMALL_BLOCK = 100  # elements per draw: blocks of 2 rows of 48, cut by shard edges (the default is 65536)


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def gathered(model, ema) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of the model and of the EMA, whole, on the CPU (collective when sharded)."""
    out = {}
    for prefix, m in (("model.", model), ("ema.", ema.model)):
        for name, t in [*m.named_parameters(), *m.named_buffers()]:
            out[prefix + name] = full(t.detach()).cpu().clone()
    return out


class LargestAllocation(torch.utils._python_dispatch.TorchDispatchMode):
    """The largest plain (non-DTensor) tensor any op produces outside the meta device."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if type(t) is torch.Tensor and t.device.type != "meta":
                self.numel = max(self.numel, t.numel())
        return out


def build(cfg, world: int):
    """build_models as training calls it, recording the devices build_model was asked for and the largest tensor
    allocated."""
    from dit_train.trainer import build as build_module
    from dit_train.parallel.fsdp import DistInfo, resolve_plan

    rank = torch.distributed.get_rank() if world > 1 else 0
    plan = resolve_plan(cfg.parallel, DistInfo(rank=rank, world_size=world))
    asked, original = [], build_module.build_model
    build_module.build_model = lambda mcfg, device=None: (asked.append(device), original(mcfg, device))[1]
    try:
        with LargestAllocation() as largest:
            model, ema = build_module.build_models(cfg, plan, torch.device("cpu"))
    finally:
        build_module.build_model = original
    return model, ema, asked, largest.numel


def _build_on_ranks(rank, world, port, out_dir):
    weight_init.BLOCK_ELEMENTS = SMALL_BLOCK
    with gloo_group(rank, world, port):
        cfg = compose(OVERRIDES + [f"run_dir={out_dir}"])
        model, ema, asked, largest = build(cfg, world)
        biggest_param = max(p.numel() for p in model.parameters())
        tensors = gathered(model, ema)
        if rank == 0:
            torch.save({"tensors": tensors, "asked": asked, "largest": largest, "biggest_param": biggest_param,
                        "shard": max(p.to_local().numel() for p in model.parameters())},
                       os.path.join(out_dir, f"world{world}.pt"))


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """The single process's (unsharded) build, with the small blocks the spawned ranks use."""
    saved = weight_init.BLOCK_ELEMENTS
    weight_init.BLOCK_ELEMENTS = SMALL_BLOCK
    try:
        cfg = compose(OVERRIDES + [f"run_dir={tmp_path_factory.mktemp('single')}"])
        model, ema, asked, _ = build(cfg, 1)
        return gathered(model, ema), asked
    finally:
        weight_init.BLOCK_ELEMENTS = saved


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_build_the_single_process_weights_without_a_full_copy(world, single, tmp_path):
    reference, asked = single
    assert asked == ["meta", "meta"]  # the model and the EMA; nothing is built whole, even on one process
    spawn_ranks(_build_on_ranks, world, (str(tmp_path),))
    got = torch.load(tmp_path / f"world{world}.pt")
    assert got["tensors"].keys() == reference.keys()
    for name, value in reference.items():
        assert torch.equal(got["tensors"][name], value), name
    assert got["asked"] == ["meta", "meta"]
    # rank 0 allocated at most one shard at a time, never a whole parameter (the largest: adaLN, 288 x 48)
    assert got["largest"] <= got["shard"] < got["biggest_param"]


def test_ema_starts_as_the_model_and_the_init_depends_on_the_seed(single):
    reference, _ = single
    for name, value in reference.items():
        if name.startswith("model."):
            assert torch.equal(reference["ema." + name[len("model."):]], value), name
    from dit_train.trainer.build import build_models
    from dit_train.parallel.fsdp import ParallelPlan

    other, _ = build_models(compose(OVERRIDES[:-2] + ["seed=8"]), ParallelPlan(), torch.device("cpu"))
    w = "blocks.0.attn.qkv.weight"
    assert not torch.equal(dict(other.named_parameters())[w].detach(), reference["model." + w])


def test_blocks_do_not_change_the_values_of_a_whole_parameter(monkeypatch):
    """A parameter drawn in one go equals the same one drawn as row blocks only when it fits one block: the block
    size is part of the definition, so it is a constant (changing it changes every run's initial weights)."""
    rule, shape = weight_init.Rule("uniform", 0.1), (6, 5)
    whole = torch.empty(shape)
    weight_init.fill(whole, rule, seed=1, name="w")
    assert torch.equal(whole, weight_init.draw_block(rule, shape, 1, "w", 0))  # 30 values: one block
    monkeypatch.setattr(weight_init, "BLOCK_ELEMENTS", 10)  # 2 rows per block
    blocks = torch.empty(shape)
    weight_init.fill(blocks, rule, seed=1, name="w")
    parts = [weight_init.draw_block(rule, shape, 1, "w", k) for k in range(3)]
    assert torch.equal(blocks, torch.cat(parts)) and not torch.equal(blocks, whole)


def test_dit_distributions_are_kept():
    cfg = OmegaConf.create({"hidden_size": 256, "depth": 2, "num_heads": 4, "patch_size": 2, "image_size": 32,
                            "in_channels": 4, "num_classes": 10, "qk_norm": True, "text_dim": 64})
    torch.manual_seed(0)
    model = build_model(cfg)
    params = dict(model.named_parameters())
    assert set(model.init_rules()) == set(params)
    for name, p in params.items():
        if "adaLN_modulation" in name or name.startswith("final_layer.") or name.endswith("cross_attn.proj.weight"):
            assert not p.any(), name  # adaLN-Zero: the blocks and the output start as the identity / zero
        elif name.endswith(".bias") and "norm" not in name:
            assert not p.any(), name
    for name in ("y_embedder.embedding_table.weight", "t_embedder.mlp.0.weight", "t_embedder.mlp.2.weight"):
        assert abs(params[name].std().item() - 0.02) < 0.002, name
    for name in ("blocks.0.attn.qkv.weight", "blocks.1.mlp.fc1.weight", "x_embedder.proj.weight"):
        p = params[name]
        bound = math.sqrt(6.0 / (p.shape[0] + p.shape[1]))
        assert p.abs().max() <= bound and p.abs().max() > 0.95 * bound, name  # xavier-uniform's range, filled
        assert abs(p.std().item() - bound / math.sqrt(3)) < 0.03 * bound, name
    assert params["blocks.0.attn.q_norm.weight"].eq(1).all() and params["blocks.0.norm_cross.weight"].eq(1).all()
    torch.manual_seed(0)
    again = dict(build_model(cfg).named_parameters())
    assert all(torch.equal(again[k], params[k]) for k in params)  # torch.manual_seed still picks a standalone model


def test_a_parameter_without_a_rule_is_refused():
    layer = torch.nn.Linear(3, 2)
    with pytest.raises(KeyError, match="no init rule for parameter.*bias"):
        weight_init.init_parameters(layer, {"weight": weight_init.ZEROS}, seed=0)
    with pytest.raises(ValueError, match="kind 'xavier' is not one of zeros, ones, uniform, normal"):
        weight_init.Rule("xavier")


@needs_fashion
def test_a_resume_or_a_fork_skips_the_init(tmp_path, monkeypatch):
    """Their checkpoint overwrites every weight: the seeded init is not computed for them (dit_15b: minutes)."""
    from dit_train.runs import checkpoint as ckpt
    from dit_train.model.dit import DiT
    from dit_train.parallel.fsdp import DistInfo
    from dit_train.trainer.loop import Trainer, run

    seeds, original = [], DiT.reset_parameters
    monkeypatch.setattr(DiT, "reset_parameters", lambda self, seed=None: (seeds.append(seed), original(self, seed))[1])
    tiny = lambda run_dir, *extra: compose(TINY_RUN + [f"run_dir={run_dir}", *extra])
    run(tiny(tmp_path / "run"))
    assert len(seeds) == 1 and seeds[0] is not None  # a fresh run: once, from the run seed
    seeds.clear()
    assert run(tiny(tmp_path / "run", "train.resume=auto", "train.steps=3"))["steps"] == 3
    fork = Trainer(tiny(tmp_path / "fork", f"train.init_from={tmp_path / 'run'}"), DistInfo())
    fork.resume()
    assert seeds == []
    source = ckpt.read_tensors(ckpt.resolve_checkpoint(str(tmp_path / "run")), "ema")
    assert all(torch.equal(v, source[k]) for k, v in fork.ema.model.state_dict().items())
    pos = fork.ema.model.pos_embed  # not in checkpoints: computed on every start
    assert torch.equal(pos, sincos_pos_embed_2d(pos.shape[1], fork.model.grid))


def _fork_on_ranks(rank, world, port, source, out_dir, out_path):
    from dit_train.parallel.fsdp import DistInfo
    from dit_train.trainer.loop import Trainer

    with gloo_group(rank, world, port):
        fork = Trainer(compose(TINY_RUN + [f"run_dir={out_dir}", f"train.init_from={source}"]),
                       DistInfo(rank=rank, world_size=world))
        fork.resume()
        tensors = gathered(fork.model, fork.ema)
        fork.logger.close()
    if rank == 0:
        torch.save(tensors, out_path)


@needs_fashion
def test_a_fork_on_two_ranks_loads_each_shard_from_a_one_process_checkpoint(tmp_path, monkeypatch):
    """train.init_from under FSDP2: the DCP load reshards the single process's checkpoint, every rank reading its
    own rows, and the forked model and EMA equal the source's weights exactly."""
    from dit_train.runs import checkpoint as ckpt
    from dit_train.trainer.loop import run

    run(compose(TINY_RUN + [f"run_dir={tmp_path / 'run'}"]))
    source = ckpt.resolve_checkpoint(str(tmp_path / "run"))
    spawn_ranks(_fork_on_ranks, 2, (str(tmp_path / "run"), str(tmp_path / "fork"), str(tmp_path / "t.pt")))
    got = torch.load(tmp_path / "t.pt", weights_only=True)
    for part in ("model", "ema"):
        want = ckpt.read_tensors(source, part)
        for k, v in want.items():
            assert torch.equal(got[f"{part}.{k}"], v), (part, k)
