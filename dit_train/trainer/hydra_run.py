"""Hydra's per-process view of a run, made one: every rank continues with rank 0's resolved config, and a rank's
own output folder that Hydra created but nothing uses is removed."""

from __future__ import annotations

import os

from omegaconf import OmegaConf

from dit_train.config import remove_stray_hydra_dir
from dit_train.parallel.fsdp import DistInfo, broadcast_object


def hydra_output_dir() -> str | None:
    """The folder Hydra created for this process (None when composed without Hydra's runtime: tests, notebooks)."""
    try:
        from hydra.core.hydra_config import HydraConfig

        return HydraConfig.get().runtime.output_dir if HydraConfig.initialized() else None
    except Exception:  # noqa: BLE001 - no Hydra runtime
        return None


def agree_on_config(cfg, dist: DistInfo):
    """Every rank continues with rank 0's resolved config, so all ranks use one run folder (Hydra's ${now:...}
    is resolved per process and can differ by a second) and see the same values."""
    own = hydra_output_dir()
    payload = (OmegaConf.to_container(cfg, resolve=True), own) if dist.is_main else None
    container, main_dir = broadcast_object(payload)
    if not dist.is_main and own and main_dir and os.path.abspath(own) != os.path.abspath(main_dir):
        remove_stray_hydra_dir(own)
    agreed = OmegaConf.create(container)
    OmegaConf.set_struct(agreed, True)
    return agreed
