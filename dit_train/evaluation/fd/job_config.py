"""The evaluation jobs' configuration (eval/reference_stats.py, eval/fd_dino.py): eval and data configs loaded from
the package's conf/ (so the jobs resolve from any working directory) and their command-line flags. The process
group is parallel.init_distributed, as for training."""

from __future__ import annotations

import argparse
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from dit_train.config import files, load_option

CONF_DIR = Path(files.CONF_DIR)


def load_eval_cfg(preset: str = "default", overrides: list[str] | None = None) -> DictConfig:
    """conf/eval/<preset>.yaml with its `defaults` resolved, then dotlist overrides."""
    path = CONF_DIR / "eval" / f"{preset}.yaml"
    if not path.is_file():
        presets = sorted(p.stem for p in (CONF_DIR / "eval").glob("*.yaml"))
        raise FileNotFoundError(f"eval preset {preset!r} not found; choose one of {presets}")
    return OmegaConf.merge(load_option("eval", preset), OmegaConf.from_dotlist(list(overrides or [])))


def load_data_cfg(name: str, overrides: list[str] | None = None) -> DictConfig:
    """conf/data/<name>.yaml plus dotlist overrides (e.g. ["root=/data/fmnist"])."""
    path = CONF_DIR / "data" / f"{name}.yaml"
    if not path.is_file():
        names = sorted(p.stem for p in (CONF_DIR / "data").glob("*.yaml"))
        raise FileNotFoundError(f"data config {name!r} not found; choose one of {names}")
    return OmegaConf.merge(OmegaConf.load(path), OmegaConf.from_dotlist(list(overrides or [])))


def add_eval_args(ap: argparse.ArgumentParser) -> None:
    """Command-line flags for every eval key; unset flags keep the preset's value."""
    ap.add_argument("--eval-preset", default="default", help="conf/eval/<preset>.yaml (default: default)")
    ap.add_argument("--encoder", help="dinov2 | dinov2_vitb14 | inception | dinov2_random ...")
    ap.add_argument("--encoder-path", help="local encoder weights (see dit_train/evaluation/fd/features.py)")
    ap.add_argument("--num-samples", type=int)
    ap.add_argument("--batch-size", type=int)
    ap.add_argument("--sample-steps", type=int)
    ap.add_argument("--cfg-scale", type=float)
    ap.add_argument("--reference-split", choices=["train", "val"])
    ap.add_argument("--reference-num", type=int)
    ap.add_argument("--cache-dir")
    ap.add_argument("--seed", type=int)
    ap.add_argument("--device", default=None, help="cpu | cuda (default: cuda:LOCAL_RANK when available)")
    ap.add_argument("--timeout-minutes", type=float, default=training_timeout_minutes(),
                    help="a collective waiting longer (a dead or hung rank) ends the job (default: training's "
                         "parallel.timeout_minutes, %(default)g)")


def training_timeout_minutes() -> float:
    """parallel.timeout_minutes of conf/config.yaml: the jobs wait for peers as long as training does."""
    return float(OmegaConf.load(CONF_DIR / "config.yaml").parallel.timeout_minutes)


def eval_cfg_from_args(args) -> DictConfig:
    keys = ["encoder", "encoder_path", "num_samples", "batch_size", "sample_steps", "cfg_scale", "reference_split",
            "reference_num", "cache_dir", "seed"]
    cfg = load_eval_cfg(args.eval_preset)
    for k in keys:
        v = getattr(args, k, None)
        if v is not None:
            cfg[k] = v
    return cfg
