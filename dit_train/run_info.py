"""What a run folder records about how it was made: the resolved config, the git commit and package versions."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from importlib import metadata

from omegaconf import OmegaConf

PACKAGES = ("torch", "numpy", "hydra-core", "omegaconf", "safetensors", "transformers", "diffusers", "dit_train")


def git_commit(path: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", path, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", path, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "") if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def package_versions() -> dict[str, str]:
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return versions


def write_run_info(cfg, run_dir: str) -> None:
    from .checkpoint import atomic_write_bytes

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    info = {"git_commit": git_commit(repo), "packages": package_versions(), "python": sys.version.split()[0],
            "platform": platform.platform(), "argv": sys.argv}
    atomic_write_bytes(json.dumps(info, indent=2).encode(), os.path.join(run_dir, "run_info.json"))
    atomic_write_bytes(OmegaConf.to_yaml(cfg, resolve=True).encode(), os.path.join(run_dir, "config.yaml"))
