"""Everything a training run is made of, built in one order for any number of ranks: model and EMA (sharded by the
plan), optimizer (after sharding: it holds the shards), LR schedule and the training generator."""

from __future__ import annotations

import torch

from . import seeds
from .ema import EMA
from .model import build_model
from .optim.registry import build_optimizer
from .parallel import ParallelPlan, fsdp_mesh, materialize_from_rank0, parallelize
from .schedule import build_scheduler


def build_models(cfg, plan: ParallelPlan, is_main: bool, device: torch.device):
    """(model, EMA) starting from the seeded initialisation of a single process. Not sharded: the model on its
    device and the EMA a copy. Sharded: both built on the meta device and sharded, then filled with rank 0's
    seeded initialisation, and the EMA set to the same values."""
    torch.manual_seed(seeds.seed_for("model_init", cfg.seed))
    if not plan.sharded:
        model = build_model(cfg.model).to(device)
        ema = EMA(model, cfg.train.ema_decay)  # copied before checkpointing/compile wrap the blocks
        return parallelize(model, plan), ema
    reference = build_model(cfg.model) if is_main else None
    mesh = fsdp_mesh(plan, device.type)  # one mesh (and its process groups) for the model and its EMA
    model = parallelize(build_model(cfg.model, device="meta"), plan, mesh=mesh)
    shadow = parallelize(build_model(cfg.model, device="meta"), plan, trainable=False, mesh=mesh)
    materialize_from_rank0(model, reference, device)
    del reference
    shadow.to_empty(device=device)
    return model, EMA(model, cfg.train.ema_decay, shadow=shadow)


def build_training(cfg, plan: ParallelPlan, is_main: bool, device: torch.device):
    """(model, ema, optimizer, scheduler, training generator)."""
    tc = cfg.train
    model, ema = build_models(cfg, plan, is_main, device)
    optimizer = build_optimizer(model, cfg.optimizer)
    scheduler = build_scheduler(optimizer, tc.steps, tc.warmup_steps, tc.lr_schedule, tc.min_lr_ratio)
    # the same on every rank: each rank keeps its slice of the global batch's noise
    generator = seeds.generator("train_noise", cfg.seed, device=device)
    return model, ema, optimizer, scheduler, generator
