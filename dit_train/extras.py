"""Optional packages, named by the pyproject extra that installs them. A feature that needs one says so in one
line (`pip install 'dit_train[wandb]'`) instead of a traceback, and the command line checks this before any
heavy work whenever the config already asks for the feature."""

from __future__ import annotations

import importlib.util
import shutil
import sys

from dit_train.config.errors import ConfigError

# module -> the pyproject extra that installs it
EXTRA_OF = {"wandb": "wandb", "diffusers": "latents", "hydra_plugins.hydra_submitit_launcher": "slurm",
            "transformers": "eval"}


class MissingExtra(ConfigError):
    """A feature asked for whose optional package is not installed; the message names the extra."""


def installed(module: str) -> bool:
    if module in sys.modules:
        return sys.modules[module] is not None  # None: imports of it are blocked (tests do this)
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def require(module: str, extra: str, feature: str) -> None:
    """Raise MissingExtra (one line) unless `module` can be imported."""
    if not installed(module):
        raise MissingExtra(f"{feature} needs the package {module.split('.')[-1]!r}, which is not installed: "
                           f"pip install 'dit_train[{extra}]'")


def check_launcher(overrides: list[str]) -> None:
    """Before composing: without the plugin, Hydra's own error about hydra/launcher=submitit_slurm comes first."""
    if "launcher=slurm" in overrides:
        require("hydra_plugins.hydra_submitit_launcher", "slurm", "launcher=slurm")


def check_slurm_here(overrides: list[str]) -> None:
    """A sweep with launcher=slurm on a machine without Slurm's sbatch: submitit's traceback ("Could not detect
    srun"), after Hydra had made the sweep folder."""
    if "launcher=slurm" in overrides and shutil.which("sbatch") is None:
        raise ConfigError("launcher=slurm submits with Slurm's sbatch, which is not on this machine's PATH: run the "
                          "command on the cluster's login node (or drop launcher=slurm to train here)")


def check_extras(cfg) -> None:
    """The optional packages a composed run config asks for."""
    if cfg.logger.wandb.mode != "disabled":
        require("wandb", "wandb", f"logger.wandb.mode={cfg.logger.wandb.mode}")
    if cfg.eval.every_n_steps and cfg.eval.encoder.startswith("dinov2"):
        require("transformers", "eval", f"eval.encoder={cfg.eval.encoder}")
