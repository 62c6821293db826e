"""Schemas of the run config groups (conf/config.yaml and conf/<group>/*.yaml): types and ranges only. The values,
defaults included, live in the yamls; every field here is required unless the yaml may leave it out."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional, Union

from dit_train.config.fields import choice, int_at_least, key, number

DTYPE_NAMES = ("bf16", "fp32", "fp64")  # the one spelling of a dtype in every config key
T_SAMPLINGS = ("logit_normal", "uniform")
LR_SCHEDULES = ("cosine", "constant", "linear")
WANDB_MODES = ("online", "offline", "disabled")


@dataclass
class TrainConfig:
    steps: int = int_at_least(1)
    batch_size: int = int_at_least(1)
    micro_batch_size: Optional[int] = key("null or an integer >= 1 that divides the per-rank batch", lambda v: v >= 1)
    warmup_steps: int = int_at_least(0)
    lr_schedule: str = choice(*LR_SCHEDULES)
    min_lr_ratio: float = number("expected a value in [0, 1]", lambda v: 0 <= v <= 1)
    grad_clip: float = number("expected >= 0 (0 disables clipping)", lambda v: v >= 0)
    ema_decay: float = number("expected a value in [0, 1)", lambda v: 0 <= v < 1)
    precision: str = choice("auto", "fp32", "bf16", valid="choose auto (bf16 on CUDA, fp32 on CPU), bf16 or fp32")
    log_every: int = int_at_least(1)
    val_every: int = int_at_least(0)
    val_samples: int = int_at_least(0)
    val_batch_size: int = int_at_least(1)
    val_t_points: int = int_at_least(1)
    sample_every: int = int_at_least(0)
    sample_steps: int = int_at_least(1)
    cfg_scale: float = number("expected >= 0 (1 means no guidance)", lambda v: v >= 0)
    samples_per_class: int = int_at_least(1)
    ckpt_every: int = int_at_least(0)
    keep_last: int = int_at_least(0)
    stop_grace_s: float = number("expected > 0 (seconds)", lambda v: v > 0)
    async_checkpoint: Any = choice("auto", True, False, valid="choose auto (on for CUDA, off on CPU), true or false")
    resume: Optional[str] = key("expected null, 'auto' or an existing run folder / checkpoint file")
    init_from: Optional[str] = key("expected null or an existing run folder / checkpoint")
    dry_run: bool = key()
    max_bad_steps: int = int_at_least(0)
    num_workers: Any = key("choose auto (4 for file-reading data on CUDA, else 0) or an integer >= 0",
                           lambda v: v == "auto" or (type(v) is int and v >= 0))
    progress: bool = key()
    timing: bool = key()


@dataclass
class FlowConfig:
    t_sampling: str = choice(*T_SAMPLINGS)
    t_mean: float = key()
    t_std: float = number("expected > 0", lambda v: v > 0)
    shift: float = number("expected > 0", lambda v: v > 0)


@dataclass
class ParallelConfig:
    fsdp: Any = choice("auto", True, False, valid="choose auto, true or false")
    mixed_precision: str = choice("auto", "bf16", "fp32", valid="choose auto (bf16 on CUDA, fp32 on CPU), bf16 or fp32")
    reduce_dtype: str = choice("fp32", "bf16")
    # true | false | an int (reshard to groups of that size): the int is checked against the world in validate.py
    reshard_after_forward: Union[bool, int] = key()
    replicate: int = int_at_least(1)
    activation_checkpointing: bool = key()
    compile: bool = key()
    timeout_minutes: float = number("expected minutes > 0", lambda v: v > 0)


@dataclass
class LaunchConfig:
    nodes: int = int_at_least(1)
    gpus_per_node: int = int_at_least(1)
    host_mem_gb: int = int_at_least(1)


@dataclass
class Architecture:
    """The DiT's own keys (dit_train.model.dit.DiTConfig holds the same fields)."""
    image_size: int = int_at_least(1)
    in_channels: int = int_at_least(1)
    patch_size: int = int_at_least(1)
    hidden_size: int = int_at_least(1)
    depth: int = int_at_least(1)
    num_heads: int = int_at_least(1)
    mlp_ratio: float = number("expected > 0", lambda v: v > 0)
    num_classes: int = int_at_least(0)
    class_dropout_prob: float = number("expected a value in [0, 1)", lambda v: 0 <= v < 1)
    qk_norm: bool = key()
    swiglu: bool = key()
    text_dim: int = int_at_least(0)


@dataclass
class ModelConfig(Architecture):
    name: str = key()
    nominal_params: Optional[float] = key("null or the nominal parameter count (> 0)", lambda v: v > 0)
    launch: LaunchConfig = key()


@dataclass
class EvalConfig:
    every_n_steps: int = int_at_least(0)
    num_samples: int = key("expected >= 2 (a covariance needs 2)", lambda v: v >= 2)
    batch_size: int = int_at_least(1)
    sample_steps: int = int_at_least(1)
    cfg_scale: float = number("expected >= 0 (1 means no guidance)", lambda v: v >= 0)
    encoder: str = key()  # checked against the encoder registry (dit_train/evaluation/fd/features.py) in validate.py
    encoder_path: Optional[str] = key()
    reference_split: str = choice("train", "val")
    reference_num: int = key()  # <= 0: the whole split
    cache_dir: str = key()
    seed: int = key()


@dataclass
class WandbConfig:
    mode: str = choice(*WANDB_MODES)
    project: str = key()
    entity: Optional[str] = key()
    name: Optional[str] = key()
    group: Optional[str] = key()


@dataclass
class LoggerConfig:
    wandb: WandbConfig = key()


# ---- data: one schema per dataset (data.name picks it) ------------------------------------------------------
@dataclass
class FashionMNISTData:
    name: str = key()
    root: str = key()
    image_size: int = key("expected an integer >= 28 (Fashion-MNIST images are padded, not cut)", lambda v: v >= 28)
    channels: int = int_at_least(1)
    num_classes: int = int_at_least(0)


@dataclass
class ImageFolderData:
    name: str = key()
    root: str = key()
    image_size: int = int_at_least(1)
    channels: int = int_at_least(1)
    num_classes: Optional[int] = key("null or an integer >= 0", lambda v: v >= 0)
    skip_corrupt: bool = key()


@dataclass
class LatentsData:
    name: str = key()
    root: Optional[str] = key()  # checked with the VAE in latents.py, with a hint how to make latents
    image_size: int = int_at_least(1)
    channels: int = int_at_least(1)
    num_classes: int = int_at_least(0)
    skip_corrupt: bool = key()


@dataclass
class SyntheticData:
    name: str = key()
    image_size: int = int_at_least(1)
    channels: int = int_at_least(1)
    num_classes: int = int_at_least(0)
    num_samples: int = int_at_least(1)


DATA_SCHEMAS = {"fashion_mnist": FashionMNISTData, "image_folder": ImageFolderData, "latents": LatentsData,
                "synthetic": SyntheticData}


@dataclass
class VaeConfig:
    path: Optional[str] = key("expected null or a diffusers AutoencoderKL folder (config.json + weights)")
    decode_batch_size: int = int_at_least(1)


@dataclass
class RunConfig:
    """The top level; the groups are checked with their own schemas (data and optimizer by name)."""
    seed: int = key()
    run_dir: str = key()
    model: Any = key()
    optimizer: Any = key()
    data: Any = key()
    eval: Any = key()
    logger: Any = key()
    flow: Any = key()
    train: Any = key()
    parallel: Any = key()
    vae: Any = key()
    study: Optional[Dict[str, Any]] = key("null or the experiment's grid for scripts/run_study.py (free-form)",
                                          default=None)
