"""Everything a training run is made of, built in one order for any number of ranks: model and EMA (sharded by the
plan), optimizer (after sharding: it holds the shards), LR schedule and the training generator."""

from __future__ import annotations

import torch

from dit_train import seeds
from dit_train.diffusion.ema import EMA
from dit_train.model.dit import build_model
from dit_train.optim.registry import build_optimizer
from dit_train.parallel.fsdp import ParallelPlan, fsdp_mesh, parallelize
from dit_train.optim.schedule import build_scheduler


def build_models(cfg, plan: ParallelPlan, device: torch.device, initialise: bool = True):
    """(model, EMA), the same way for any number of ranks: both built on the meta device and the plan applied
    (FSDP2 shards when sharded), then each rank allocates its own part on `device` and computes it from the run
    seed (model.reset_parameters: equal to a single process's weights, and no rank ever holds a full copy). The
    EMA starts as a copy. initialise=False (a resume or fork, whose checkpoint overwrites every weight) leaves
    the weights unset: only the position table, which no checkpoint holds, is computed."""
    mesh = fsdp_mesh(plan, device.type) if plan.sharded else None  # one mesh (and its groups) for model and EMA
    model = parallelize(build_model(cfg.model, device="meta"), plan, mesh=mesh)
    shadow = parallelize(build_model(cfg.model, device="meta"), plan, trainable=False, mesh=mesh)
    for m in (model, shadow):
        m.to_empty(device=device)
    model.reset_buffers()
    if initialise:
        model.reset_parameters(seeds.seed_for("model_init", cfg.seed))
    return model, EMA(model, cfg.train.ema_decay, shadow=shadow)


def build_training(cfg, plan: ParallelPlan, device: torch.device, initialise: bool = True):
    """(model, ema, optimizer, scheduler, training generator); initialise as in build_models."""
    tc = cfg.train
    model, ema = build_models(cfg, plan, device, initialise)
    optimizer = build_optimizer(model, cfg.optimizer)
    scheduler = build_scheduler(optimizer, tc.steps, tc.warmup_steps, tc.lr_schedule, tc.min_lr_ratio)
    # the same on every rank: each rank keeps its slice of the global batch's noise
    generator = seeds.generator("train_noise", cfg.seed, device=device)
    return model, ema, optimizer, scheduler, generator
