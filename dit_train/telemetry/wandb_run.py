"""One wandb run per run folder. Its id and name are stored in the run folder (wandb_run.json) when the run
starts, so a resumed run (preemption, train.resume=auto) logs into the same wandb run instead of a second one;
offline, each process start writes its own offline-run-*-<id> folder, and `wandb sync` merges them by id.
The group is the study (study.name) unless logger.wandb.group says otherwise; the tags name the model, the
optimizer, K and the lr, so runs of a study can be filtered without reading their configs."""

from __future__ import annotations

import json
import os
import re
import secrets

from dit_train.runs.atomic_io import atomic_write_bytes
from dit_train.runs.json_file import DamagedJSONFile, read_json

RECORD = "wandb_run.json"
# overrides that say where or how a run is executed, not what it trains: left out of its name
VALID_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
NOT_IN_NAME = ("run_dir", "train.resume", "train.progress", "launcher", "hydra.", "logger.")


def hydra_override_dirname() -> str:
    """hydra.job.override_dirname of this process ('' outside a Hydra job)."""
    try:
        from hydra.core.hydra_config import HydraConfig

        return HydraConfig.get().job.override_dirname if HydraConfig.initialized() else ""
    except Exception:  # noqa: BLE001 - no Hydra runtime (tests, notebooks)
        return ""


def name_from_overrides(override_dirname: str) -> str:
    """`model=dit_s,optimizer=muon,run_dir=x` -> `model=dit_s,optimizer=muon`."""
    kept = [o for o in override_dirname.split(",") if o and not o.lstrip("+~").startswith(NOT_IN_NAME)]
    return ",".join(kept)


def tags(config: dict) -> list[str]:
    opt, model = config.get("optimizer", {}), config.get("model", {})
    out = [f"model={model.get('name')}", f"optimizer={opt.get('name')}"]
    if "K" in opt:
        out.append(f"K={opt['K']}")
    if "lr" in opt:
        out.append(f"lr={opt['lr']:g}")
    return out


def identity(run_dir: str, wandb_cfg) -> dict:
    """{id, name} of this run folder's wandb run: the stored one, or a new one written before wandb starts."""
    path = os.path.join(run_dir, RECORD)
    if os.path.exists(path):
        return read_identity(path)
    name = wandb_cfg.get("name") or name_from_overrides(hydra_override_dirname()) or \
        os.path.basename(os.path.abspath(run_dir))
    record = {"id": secrets.token_hex(4), "name": name}
    atomic_write_bytes(json.dumps(record).encode(), path)
    return record


def read_identity(path: str) -> dict:
    """The stored {id, name}; a damaged or hand-edited record is refused in one line naming the file."""
    fix = "delete it to start a new wandb run for this folder, or write the wandb run id into it"
    record = read_json(path, ("id", "name"), fix=fix)
    if not isinstance(record["id"], str) or not VALID_ID.fullmatch(record["id"]):
        raise DamagedJSONFile(f"{path}: id {record['id']!r} is not a valid wandb run id (letters, digits, '-' and "
                              f"'_', at most 64; wandb refuses / \\ # ? % :); {fix}")
    return record


def init_kwargs(run_dir: str, wandb_cfg, config: dict) -> dict:
    record = identity(run_dir, wandb_cfg)
    study = (config.get("study") or {}).get("name")
    return {"project": wandb_cfg.project, "entity": wandb_cfg.get("entity"), "mode": wandb_cfg.mode,
            "dir": run_dir, "id": record["id"], "name": record["name"], "resume": "allow",
            "group": wandb_cfg.get("group") or study, "tags": tags(config), "config": config}


def start(run_dir: str, wandb_cfg, config: dict):
    """The wandb run of this run folder (wandb imported only here: it is an optional extra)."""
    from dit_train.extras import require

    require("wandb", "wandb", f"logger.wandb.mode={wandb_cfg.mode}")
    import wandb

    return wandb.init(**init_kwargs(run_dir, wandb_cfg, config))
