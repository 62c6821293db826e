"""Hydra's record of a command (`.hydra/config.yaml`, `hydra.yaml`, `overrides.yaml`) in an explicit run folder,
written only once the run has been accepted.

Hydra writes these files into its output folder before the task starts. With `run_dir=X`, that folder is the run
folder (`__main__.py` points Hydra there), so a resume that the config check then refuses, or a second writer that the
one-writer lock refuses, would already have overwritten the run's record with the refused command. Such commands
run with `hydra.output_subdir=null` (Hydra writes nothing there) and rank 0 writes the same three files, as Hydra's
run_job does, after the checks (run_folder.py). Writing them ourselves, rather than letting Hydra write them to a
temporary folder and moving that in, leaves nothing to clean up when a refused or killed command never gets that far.
(Its log file, dit_train.log, is only appended to.)"""

from __future__ import annotations

import os

SUBDIR = ".hydra"
_deferred = False  # this process's explicit run folder gets its Hydra files from write_hydra_files


def defer_hydra_files() -> str:
    """The override that stops Hydra writing `.hydra/` before the task starts; write_hydra_files writes it later."""
    global _deferred
    _deferred = True
    return "hydra.output_subdir=null"


def write_hydra_files(cfg, run_dir: str) -> None:
    """`<run_dir>/.hydra/` as Hydra would have written it, for a command whose Hydra files were deferred."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    from dit_train.runs.atomic_io import atomic_write_bytes

    if not (_deferred and HydraConfig.initialized()):
        return
    hydra_cfg = HydraConfig.instance().cfg  # {"hydra": ...}, as Hydra saves it
    folder = os.path.join(run_dir, SUBDIR)
    os.makedirs(folder, exist_ok=True)
    for name, node in (("config.yaml", cfg), ("hydra.yaml", hydra_cfg),
                       ("overrides.yaml", hydra_cfg.hydra.overrides.task)):
        atomic_write_bytes(OmegaConf.to_yaml(node).encode(), os.path.join(folder, name))
