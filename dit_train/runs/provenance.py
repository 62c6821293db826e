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


CODE_PATHS = ("dit_train/", "pyproject.toml")  # what can change a run's numbers
# the folder that holds the dit_train package: the git checkout of an editable install
CHECKOUT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def modified_files(path: str) -> list[str]:
    """Tracked files with uncommitted changes (a run records them, so '-dirty' can be checked later)."""
    try:
        out = subprocess.run(["git", "-C", path, "status", "--porcelain", "--untracked-files=no"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return []
    return sorted(line[3:].split(" -> ")[-1] for line in out.stdout.splitlines() if line.strip())


def git_commit(path: str, modified: list[str] | None = None) -> str | None:
    """HEAD, with '-dirty' when uncommitted changes touch code (published reports under docs/ do not count:
    a study that publishes results as it goes would otherwise mark its own later runs dirty). `modified`:
    modified_files(path) when the caller already has it."""
    try:
        out = subprocess.run(["git", "-C", path, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    dirty = any(f.startswith(CODE_PATHS) for f in (modified_files(path) if modified is None else modified))
    return out.stdout.strip() + ("-dirty" if dirty else "")


def package_versions() -> dict[str, str]:
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return versions


def processor() -> dict[str, str]:
    """The CPU's model and the kernels torch picks on it (e.g. AVX512 vs AVX2): the same commit and seed give other
    bf16 results on another kind of CPU (AMX kernels against AVX2 emulation), so a bit-exact rerun needs the same
    kind; the GPU's name where one is visible."""
    import torch

    model = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    out = {"cpu": model, "cpu_capability": torch.backends.cpu.get_cpu_capability()}
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name()
    return out


def write_run_info(cfg, run_dir: str) -> None:
    from dit_train.runs.atomic_io import atomic_write_bytes

    modified = modified_files(CHECKOUT)
    info = {"git_commit": git_commit(CHECKOUT, modified), "git_modified": modified, "packages": package_versions(),
            "python": sys.version.split()[0], "platform": platform.platform(), **processor(), "argv": sys.argv}
    atomic_write_bytes(json.dumps(info, indent=2).encode(), os.path.join(run_dir, "run_info.json"))
    atomic_write_bytes(OmegaConf.to_yaml(cfg, resolve=True).encode(), os.path.join(run_dir, "config.yaml"))
