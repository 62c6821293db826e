"""Checks of the composed config that run before anything heavy (no dataset read, no model allocated).
Each failure is one line naming the key, the value seen and what would be valid."""

from __future__ import annotations

import os

from omegaconf import OmegaConf

from .schedule import SCHEDULES

T_SAMPLINGS = ("logit_normal", "uniform")
PRECISIONS = ("fp32", "bf16")


class ConfigError(ValueError):
    """A bad configuration value; the message is the whole story (printed without a traceback)."""


def _require(ok: bool, key: str, value, valid: str) -> None:
    if not ok:
        raise ConfigError(f"{key}={value!r} is not valid: {valid}")


def _positive_int(cfg, key: str, allow_zero: bool = False) -> None:
    value = OmegaConf.select(cfg, key)
    ok = isinstance(value, int) and not isinstance(value, bool) and (value >= 0 if allow_zero else value >= 1)
    _require(ok, key, value, "expected an integer >= 0" if allow_zero else "expected an integer >= 1")


def check_config(cfg, world_size: int = 1) -> None:
    t, m, d = cfg.train, cfg.model, cfg.data
    for key in ("train.steps", "train.batch_size", "train.log_every", "train.val_batch_size",
                "train.val_t_points", "train.sample_steps", "train.samples_per_class"):
        _positive_int(cfg, key)
    for key in ("train.warmup_steps", "train.val_every", "train.sample_every", "train.ckpt_every",
                "train.keep_last", "train.val_samples", "train.num_workers", "train.max_bad_steps"):
        _positive_int(cfg, key, allow_zero=True)
    _require(t.batch_size % world_size == 0, "train.batch_size", t.batch_size,
             f"must be divisible by the world size {world_size}")
    _require(t.lr_schedule in SCHEDULES, "train.lr_schedule", t.lr_schedule, f"choose one of {', '.join(SCHEDULES)}")
    _require(0.0 <= t.min_lr_ratio <= 1.0, "train.min_lr_ratio", t.min_lr_ratio, "expected a value in [0, 1]")
    _require(t.grad_clip >= 0, "train.grad_clip", t.grad_clip, "expected >= 0 (0 disables clipping)")
    _require(0.0 <= t.ema_decay < 1.0, "train.ema_decay", t.ema_decay, "expected a value in [0, 1)")
    _require(t.precision in PRECISIONS, "train.precision", t.precision, f"choose one of {', '.join(PRECISIONS)}")
    _require(t.cfg_scale >= 0, "train.cfg_scale", t.cfg_scale, "expected >= 0 (1 means no guidance)")
    _require(cfg.flow.t_sampling in T_SAMPLINGS, "flow.t_sampling", cfg.flow.t_sampling,
             f"choose one of {', '.join(T_SAMPLINGS)}")
    _require(cfg.flow.t_std > 0, "flow.t_std", cfg.flow.t_std, "expected > 0")
    _require(cfg.flow.shift > 0, "flow.shift", cfg.flow.shift, "expected > 0")
    _require(cfg.optimizer.lr > 0, "optimizer.lr", cfg.optimizer.lr, "expected a learning rate > 0")
    _require(cfg.optimizer.get("weight_decay", 0) >= 0, "optimizer.weight_decay",
             cfg.optimizer.get("weight_decay"), "expected >= 0")

    # model vs data: the model must consume what the dataset produces
    _require(m.image_size % m.patch_size == 0, "model.patch_size", m.patch_size,
             f"must divide model.image_size={m.image_size}")
    _require(m.hidden_size % m.num_heads == 0, "model.num_heads", m.num_heads,
             f"must divide model.hidden_size={m.hidden_size}")
    _require(m.hidden_size % 4 == 0, "model.hidden_size", m.hidden_size, "must be divisible by 4 (2-D positions)")
    if not t.dry_run:
        _require(m.in_channels == d.channels, "model.in_channels", m.in_channels,
                 f"must equal data.channels={d.channels}")
        _require(m.image_size == d.image_size, "model.image_size", m.image_size,
                 f"must equal data.image_size={d.image_size}")
        if m.num_classes:
            _require(d.get("num_classes") in (None, "???") or m.num_classes >= d.num_classes, "model.num_classes",
                     m.num_classes, f"must be >= data.num_classes={d.get('num_classes')}")

    from .data import DATASETS

    _require(d.name in DATASETS, "data.name", d.name, f"choose one of {', '.join(sorted(DATASETS))}")
    _check_optimizer(cfg.optimizer)

    ev = cfg.eval
    if ev.get("every_n_steps", 0):
        _require(ev.num_samples >= 2, "eval.num_samples", ev.num_samples, "expected >= 2 (a covariance needs 2)")

    resume = t.resume
    if resume not in (None, "auto"):
        _require(os.path.exists(str(resume)), "train.resume", resume,
                 "expected null, 'auto' or an existing run folder / checkpoint file")


def _check_optimizer(opt_cfg) -> None:
    """The registry validates every optimizer key (name, lr, K, scale, patterns, ...); building the optimizer on a
    one-layer meta model runs that validation now instead of after the data and model are built."""
    import torch

    from .optim.registry import build_optimizer

    try:
        build_optimizer(torch.nn.Linear(2, 2, device="meta"), opt_cfg)
    except ValueError as e:
        raise ConfigError(str(e)) from None
