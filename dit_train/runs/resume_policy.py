"""What a run continues from, and whether it may: decided before anything is written to the run folder.

`train.resume=null` starts fresh and refuses a folder that already has checkpoints; `auto` continues from the
newest complete checkpoint (falling back past damaged ones); a path continues from that checkpoint or run folder.
A resumed run must be the same experiment: its resolved config is compared key by key with the one the checkpoint
was trained with, and only the keys declared with resume=True in their schemas (dit_train/config/) may differ
(cadence, lengths, paths, logging, how checkpoints are written, parallel layout, the Slurm job shape, and how
sharded optimizers exchange whole matrices, which does not change the maths). Anything else is refused in one line naming each key with both values;
a deliberate change is
a fork (`train.init_from=RUN`: the weights, a fresh optimizer and step 0, in a new run folder). With
`train.resume=auto` a fork can be requeued: the run's own checkpoints win, the fork source is used only while the run
has none. A fork keeps the model's architecture (its weights must fit), which is checked before the folder is used.
The parallel keys that change the numbers (the dtypes of FSDP's gathered weights and gradient reductions) may not
change, like train.precision. `data.root` is a path, but what matters is the data behind it: checkpoints record a
fingerprint of the data (data/datasets.py), and a resume whose data has another fingerprint is refused, wherever
the folder now lives; a checkpoint without one (written by an earlier version) keeps its data.root.
"""

from __future__ import annotations

import fnmatch
import json
import logging
import os
from dataclasses import asdict

from omegaconf import OmegaConf

from dit_train.runs import checkpoint as ckpt
from dit_train.runs.absent import ABSENT
from dit_train.config import ConfigError
from dit_train.config.override_text import shell_override
from dit_train.config.schemas import may_change_on_resume, recorded_before
from dit_train.data.datasets import data_fingerprint, describe_fingerprint

log = logging.getLogger("dit_train")

# model keys a fork may change: they are not part of the weights' shapes or meaning
FORK_MAY_CHANGE = ("class_dropout_prob",)


def resume_candidates(cfg, remove_partial: bool = False) -> list[str]:
    """Checkpoints to try, newest first ([] for a fresh run)."""
    resume, run_dir = cfg.train.resume, cfg.run_dir
    existing = ckpt.list_checkpoints(run_dir, remove_partial=remove_partial, legacy=True)
    if resume is None:
        if existing:
            raise FileExistsError(f"run folder {run_dir} already has checkpoints ({os.path.basename(existing[-1])}); "
                                  f"pass train.resume=auto to continue it, or choose a new run_dir")
        return []
    if resume == "auto":
        return list(reversed(existing))
    return [ckpt.resolve_checkpoint(str(resume))]


def flatten(tree: dict, prefix: str = "") -> dict:
    """{"a": {"b": 1}} -> {"a.b": 1}; lists and empty dicts are values."""
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict) and v:
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def config_changes(saved: dict, now: dict) -> list[tuple[str, object, object]]:
    """(key, saved value, new value) for every key that differs and may not change on resume."""
    a, b = flatten(saved), flatten(now)
    # a key added after the checkpoint was written: it ran under the value its schema records (recorded_before)
    a.update({k: v for k, v in recorded_before().items() if k not in a and k in b})
    may_change = may_change_on_resume()  # read each time: a schema registered later counts
    return [(k, a.get(k, ABSENT), b.get(k, ABSENT)) for k in sorted(set(a) | set(b))
            if a.get(k, ABSENT) != b.get(k, ABSENT)
            and not any(fnmatch.fnmatchcase(k, p) for p in may_change)]


def shown(value) -> str:
    return repr(value) if value is ABSENT else json.dumps(value)


def describe_changes(changes: list[tuple[str, object, object]]) -> str:
    """The changes for the one-line refusal: where a config group itself changed (its `name`: another optimizer,
    model, data set), that name change comes first and stands for the group's other keys, which follow from it and
    are only counted; every other change is listed with both values."""
    swapped = {k[: -len(".name")] for k, _, _ in changes if k.endswith(".name")}
    group_of = {k: k.rsplit(".", 1)[0] if "." in k else "" for k, _, _ in changes}
    follow = {g: sum(group_of[k] == g and not k.endswith(".name") for k, _, _ in changes) for g in swapped}
    first, rest = [], []
    for k, old, new in changes:
        line = f"{k}: {shown(old)} -> {shown(new)}"
        if k.endswith(".name") and group_of[k] in swapped:
            n = follow[group_of[k]]
            first.append(line + (f" (and {n} other key{'s' * (n != 1)} of {group_of[k]})" if n else ""))
        elif group_of[k] not in swapped:
            rest.append(line)
    return "; ".join(first + rest)


def check_resume(cfg, read_state=ckpt.read_saved_state) -> str | None:
    """The checkpoint this run will continue from (None: fresh), after checking it is the same experiment.
    `read_state`: how a checkpoint's train state is read (the check before Hydra passes one that reads each once)."""
    candidates = resume_candidates(cfg)
    for i, path in enumerate(candidates):
        if not ckpt.is_complete(path):
            return path  # a read-only file of an earlier version: loading it says why it cannot resume
        try:
            state = read_state(path)
            saved = state["config"]
        except (OSError, ValueError, KeyError) as e:
            if cfg.train.resume != "auto":
                raise
            log.warning("checkpoint %s has no readable train state (%s); trying the previous one", path, e)
            continue
        recorded = state.get("data_fingerprint")
        changes = config_changes(saved, OmegaConf.to_container(cfg, resolve=True))
        if recorded is not None:  # the data is checked by its fingerprint below, wherever it lives now
            changes = [c for c in changes if c[0] != "data.root"]
        if changes:
            listed = describe_changes(changes)
            raise ConfigError(f"train.resume={cfg.train.resume}: {path} was trained with another config ({listed}); "
                              f"these keys cannot change on resume: start a fresh run in a new run_dir, or fork "
                              f"this one with {shell_override('train.init_from', cfg.run_dir)} (its weights, a fresh "
                              f"optimizer, step 0)")
        if recorded is not None:
            check_same_data(cfg, path, recorded, saved.get("data", {}).get("root"))
        check_model_fits(cfg, path, candidates[i + 1:])
        return path
    if cfg.train.init_from:
        check_fork(cfg)
    return None


def check_same_data(cfg, path: str, recorded: dict, saved_root) -> None:
    """Refuse, in one line, a resume whose data differs from the data the checkpoint was trained on."""
    now = data_fingerprint(cfg.data)
    root = cfg.data.get("root")
    if now != recorded:
        was = shell_override("data.root", saved_root) if isinstance(saved_root, str) else f"data.root={saved_root}"
        moved = f" (it was trained from {was})" if saved_root != root else ""  # pasted to resume with that data
        raise ConfigError(f"train.resume={cfg.train.resume}: data.root={root} holds other data than {path} was "
                          f"trained on{moved}: {describe_fingerprint(now)}, but the checkpoint recorded "
                          f"{describe_fingerprint(recorded)}; resume with that data, or fork with "
                          f"{shell_override('train.init_from', cfg.run_dir)} in a new run_dir to train on this data")
    if saved_root != root:
        log.info("data.root moved from %s to %s: the same data (%s)", saved_root, root, describe_fingerprint(now))


def check_fork(cfg) -> None:
    """A fork's source: a complete checkpoint whose model has this run's architecture (else one line)."""
    from dit_train.model.dit import DiTConfig

    source = ckpt.resolve_checkpoint(str(cfg.train.init_from))
    if not ckpt.is_complete(source):
        raise ckpt.CheckpointError(f"train.init_from={cfg.train.init_from}: {source} is a read-only single-file "
                                   f"checkpoint of an earlier version; a fork starts from a step_N.dcp checkpoint")
    saved = ckpt.read_train_state(source, ("config",))["config"].get("model") or {}
    old, new = asdict(DiTConfig.from_cfg(saved)), asdict(DiTConfig.from_cfg(cfg.model))
    changed = [f"{k}: {json.dumps(old[k])} -> {json.dumps(new[k])}" for k in old
               if k not in FORK_MAY_CHANGE and old[k] != new[k]]
    if changed:
        raise ConfigError(f"train.init_from={cfg.train.init_from}: {source} holds a model of another architecture "
                          f"({'; '.join(changed)}); a fork keeps the architecture: use the model it was trained with "
                          f"(model={saved.get('name')}) or start without train.init_from")
    check_model_fits(cfg, source)


def check_model_fits(cfg, path: str, fallbacks: list[str] = ()) -> None:
    """The model this run builds, against the shapes of the tensors `path` holds for it (its metadata only):
    a saved config from elsewhere declaring a huge model was allocated, and initialised, before the load found
    that the checkpoint's tensors do not fit it. A damaged `path` under resume=auto is left to the load, which falls
    back past it: the model is then checked against the first of `fallbacks` whose metadata reads."""
    for candidate in (path, *fallbacks):
        try:
            stored = ckpt.stored_shapes(candidate, "model")
        except ckpt.CheckpointError:
            if cfg.train.resume != "auto":
                raise
            continue
        ckpt.check_saved_model(candidate, {"model": OmegaConf.to_container(cfg.model, resolve=True)}, stored,
                               part="model")
        return
