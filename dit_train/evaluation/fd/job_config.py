"""The evaluation jobs' configuration (dit-reference-stats, dit-fd): eval and data configs loaded from
the package's config options (so the jobs resolve from any working directory) and their command-line flags. The process
group is parallel.init_distributed, as for training."""

from __future__ import annotations

import argparse
import re

from omegaconf import DictConfig, OmegaConf

from dit_train.config import group_options, load_option
from dit_train.config.schema import ParallelConfig


def _load(group: str, option: str, overrides: list[str] | None, what: str) -> DictConfig:
    if option not in group_options(group):
        raise FileNotFoundError(f"{what} {option!r} not found; choose one of {group_options(group)}")
    return OmegaConf.merge(load_option(group, option), dotlist(overrides))


def dotlist(items: list[str] | None, flag: str = "--data-set") -> DictConfig:
    """KEY=VALUE items as OmegaConf reads them (each value YAML: 16 an int, true a bool), refused in one line where
    YAML reads a folder otherwise than it was typed: after ` #` it drops the rest as a comment
    (`root=/data/run #2` read /data/run, silently another folder), and `a: b` is a mapping. Quoted, it is one
    string: root='/data/run #2'."""
    import json

    import yaml
    from omegaconf._utils import get_yaml_loader

    from dit_train.config.errors import ConfigError

    for item in items or []:
        key, sep, text = item.partition("=")
        if not sep:
            continue
        read = yaml.load(text, Loader=get_yaml_loader())
        typed = text.strip()
        if isinstance(read, dict) or isinstance(read, str) and read != typed and not typed.startswith(("'", '"')):
            raise ConfigError(f"{flag} {item}: YAML reads {key}={read!r}, not the text typed; a value meant as one "
                              f"string is written in YAML quotes: {key}={json.dumps(typed, ensure_ascii=False)}")
    return OmegaConf.from_dotlist(list(items or []))


def load_eval_cfg(preset: str = "default", overrides: list[str] | None = None) -> DictConfig:
    """The eval option `preset` (EvalConfig's defaults, or conf/eval/<preset>.yaml on them), then dotlist
    overrides."""
    return _load("eval", preset, overrides, "eval preset")


def load_data_cfg(name: str, overrides: list[str] | None = None) -> DictConfig:
    """The data option `name` plus dotlist overrides (e.g. ["root=/data/fmnist"])."""
    return _load("data", name, overrides, "data config")


def add_eval_args(ap: argparse.ArgumentParser) -> None:
    """Command-line flags for every eval key; unset flags keep the preset's value."""
    ap.add_argument("--eval-preset", default="default", help="an eval option: default, ci, dinov2, dinov2_tracking")
    ap.add_argument("--encoder", help="dinov2 | dinov2_vitb14 | inception | dinov2_random ...")
    ap.add_argument("--encoder-path", help="local encoder weights (see dit_train/evaluation/fd/features.py)")
    ap.add_argument("--trust-encoder-code", action="store_true", default=None,
                    help="allow a torch.hub checkout as the encoder (its hubconf.py runs as Python)")
    ap.add_argument("--num-samples", type=int)
    ap.add_argument("--batch-size", type=int)
    ap.add_argument("--sample-steps", type=int)
    ap.add_argument("--cfg-scale", type=float)
    ap.add_argument("--reference-split", choices=["train", "val"])
    ap.add_argument("--reference-num", type=int,
                    help="how many real images of --reference-split make the reference statistics (<= 0: all of it; "
                         "default: the eval preset's reference_num, e.g. 128 for ci, 50000 for dinov2)")
    ap.add_argument("--cache-dir")
    ap.add_argument("--seed", type=int)
    ap.add_argument("--device", default=None, help="cpu | cuda (default: cuda:LOCAL_RANK when available)")
    ap.add_argument("--timeout-minutes", type=float, default=training_timeout_minutes(),
                    help="a collective waiting longer (a dead or hung rank) ends the job (default: training's "
                         "parallel.timeout_minutes, %(default)g)")


def training_timeout_minutes() -> float:
    """parallel.timeout_minutes's default: the jobs wait for peers as long as training does."""
    return float(ParallelConfig.timeout_minutes)


# the eval keys that have a flag of their own (add_eval_args): --num-samples sets eval.num_samples
FLAG_KEYS = ("encoder", "encoder_path", "trust_encoder_code", "num_samples", "batch_size", "sample_steps", "cfg_scale",
             "reference_split", "reference_num", "cache_dir", "seed")


def eval_cfg_from_args(args) -> DictConfig:
    """The eval config of the preset and flags, checked (one line naming the flag) before any heavy work."""
    from dit_train.config import check_eval

    cfg = load_eval_cfg(args.eval_preset)
    for k in FLAG_KEYS:
        v = getattr(args, k, None)
        if v is not None:
            cfg[k] = v
    check_eval(cfg)
    return cfg


def in_flag_terms(text: str) -> str:
    """A line of the eval code, which names config keys (training's words: `eval.num_samples=16`), in the words
    the user of dit-fd / dit-reference-stats typed: `--num-samples=16`, `--trust-encoder-code`."""
    text = text.replace("eval.trust_encoder_code=true", "--trust-encoder-code")
    return re.sub(rf"\beval\.({'|'.join(FLAG_KEYS)})\b", lambda m: "--" + m.group(1).replace("_", "-"), text)
