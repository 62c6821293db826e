"""The config a resume (or a fork) continues with: the run's own saved config, with only what the command line set
on top. `dit-train run_dir=X train.resume=auto` then continues any run however it was started, and
`... train.steps=2000` extends it, without repeating the original command.

What the command line set: the keys it names, and every key its group choices (`optimizer=muon`,
`experiment=...`) change: the saved run's own options (it names its data, model and optimizer) are composed
with and without the command's overrides, and the keys that differ are the command's. The
command's run_dir, train.resume and train.init_from always hold, and so does eval.trust_encoder_code: a grant to run
the code of a torch.hub checkout comes from the user, never from a checkpoint (a run folder from elsewhere named a
checkout it shipped, and its hubconf.py ran on resume). So do the keys that say where data leaves the run folder,
WHERE_DATA_GOES: logger.wandb.mode, .entity and .project (a received run saved with mode online uploaded the
user's run to the entity it named) and eval.cache_dir (reference statistics were written, and read back, where the
folder chose); a saved value they replace is named in one warning line, as the override that keeps it. A key the
checkpoint's config lacks (added to dit_train later) takes its default, or the value that reproduces earlier runs
(its schema's recorded_before); keys only the checkpoint has are dropped. resume_policy.check_resume then judges
the result against the saved config, so a change outside the resume policy is refused in one line as before, now
naming only what the user asked for.
"""

from __future__ import annotations

import logging
import re
import shlex

from omegaconf import OmegaConf

from dit_train.runs.absent import ABSENT

log = logging.getLogger("dit_train")
# where data leaves the run folder: uploads (wandb) and files written and read outside it (the FD reference cache)
WHERE_DATA_GOES = ("logger.wandb.mode", "logger.wandb.entity", "logger.wandb.project", "eval.cache_dir")
# the user's word only, never a checkpoint's: where the run is, a grant to run code, where data goes
ALWAYS_FROM_COMMAND = ("run_dir", "train.resume", "train.init_from", "eval.trust_encoder_code", *WHERE_DATA_GOES)
# a fork is a new run: its wandb run is its own, never named as its parent's (its id is its folder's wandb_run.json)
NEW_RUN_KEYS = ("logger.wandb.name",)
SAVED_CHOICES = ("data", "model", "optimizer")  # groups whose option a saved config names (its `name` key)
# a preset's file name in its group folder: nothing Hydra reads as a path (`../../x`) or an interpolation
PRESET_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


def continue_saved_config(cfg, overrides: list[str], read_state=None):
    """`cfg` (composed from the defaults and `overrides`) rebuilt on the saved config of the checkpoint it will
    resume (a fork: its source's, while the run has no checkpoint of its own, less its wandb run name); `cfg` itself for a fresh run or
    when no readable saved config exists (check_resume then says why, in its own words). `read_state`: how a
    checkpoint's train state is read (default checkpoint.read_saved_state)."""
    if cfg.train.get("resume") is None and cfg.train.get("init_from") is None:
        return cfg
    try:
        run_dir = cfg.run_dir  # the default ${hydra:runtime.output_dir} resolves only inside the Hydra app
    except Exception:  # noqa: BLE001 - checked before Hydra runs and no run_dir given: no run folder to read yet
        return cfg
    found = _saved(cfg, read_state)  # (checkpoint, its saved config, whether it is a fork's source)
    if found is None:
        return cfg
    path, saved, forked = found
    from dit_train.config.schemas import recorded_before
    from dit_train.runs.resume_policy import flatten
    from dit_train.runs.checkpoint import literal_config
    from dit_train.config.override_text import override, shell_override

    earlier = recorded_before()

    # the saved run's own group options (optimizer, model, data record their names) under the command's
    # overrides, against the same options without them: what differs is what the command line set
    own = [o for o in overrides if not o.startswith("hydra.")]
    searchpath = [o for o in overrides if o.startswith("hydra.searchpath=")]  # --config-dir, before Hydra runs
    chosen = {o.split("=", 1)[0].lstrip("+~") for o in own if "=" in o}
    options = {group: f"{group}={saved[group]['name']}" for group in SAVED_CHOICES
               if isinstance(saved.get(group), dict) and _preset_name(saved[group].get("name"))}
    unchosen = [o for group, o in options.items() if group not in chosen]
    try:
        now = flatten(OmegaConf.to_container(_compose(searchpath + unchosen + own + [override("run_dir", run_dir)]),
                                             resolve=True))
        base = flatten(OmegaConf.to_container(_compose([*searchpath, *options.values(), override("run_dir", run_dir)]),
                                              resolve=True))
    except Exception as e:  # noqa: BLE001 - e.g. a preset the saved run names no longer exists: judged as typed
        log.warning("cannot compose the saved run's own options (%s); the resume is judged as typed",
                    str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)
        return cfg
    named = _named_keys(own)
    kept = flatten(literal_config(saved))  # a crafted `${oc.env:...}` stays a string: nothing resolves
    merged, set_here, dropped = {}, [], []
    for key, value in now.items():
        typed = any(key == n or key.startswith(n + ".") for n in named) or value != base.get(key, ABSENT)
        from_command = typed or key in ALWAYS_FROM_COMMAND or (forked and key in NEW_RUN_KEYS)
        if from_command or key not in kept:  # set here, or added to dit_train after the checkpoint
            merged[key] = earlier[key] if not from_command and key in earlier else value
            if from_command and kept.get(key, ABSENT) != value and key not in ALWAYS_FROM_COMMAND:
                set_here.append(key)
            elif key in WHERE_DATA_GOES and not typed and kept.get(key, value) != value:
                dropped.append(shell_override(key, kept[key]) if isinstance(kept[key], str)
                               else shlex.quote(f"{key}={kept[key]}"))
        else:
            merged[key] = kept[key]
    out = OmegaConf.create(_unflatten(merged))
    OmegaConf.set_struct(out, True)
    log.info("continuing with the config saved in %s%s", path,
             f"; the command line changes {', '.join(set_here)}" if set_here else "")
    if dropped:  # for the shell and for Hydra: a saved value from elsewhere may hold spaces, a quote, `,` or `=`
        log.warning("not continued from the saved config (where data leaves the run folder is the command line's "
                    "word): %s; pass them to keep them", " ".join(dropped))
    return out


def _saved(cfg, read_state=None):
    from dit_train.runs import checkpoint as ckpt
    from dit_train.runs.resume_policy import resume_candidates

    read_state = read_state or ckpt.read_saved_state

    try:
        paths = resume_candidates(cfg)
        forked = not paths and bool(cfg.train.get("init_from"))
        if forked:
            paths = [ckpt.resolve_checkpoint(str(cfg.train.init_from))]
    except (OSError, ValueError):
        return None
    for path in paths:
        if ckpt.is_complete(path):
            try:
                return path, read_state(path)["config"], forked
            except (OSError, ValueError):
                continue
    return None


def _compose(overrides: list[str]):
    """The config `overrides` compose to (inside the Hydra app with its search path, else from conf/)."""
    from hydra import compose
    from hydra.core.global_hydra import GlobalHydra

    if GlobalHydra.instance().is_initialized():
        return compose(config_name="config", overrides=overrides)
    from dit_train.config.command_line import compose as compose_here

    return compose_here(overrides)


def _named_keys(overrides: list[str]) -> set[str]:
    """The config keys an override list sets by name (`a.b=1`, `+a.b=1`, `~a.b`), not its group choices."""
    from dit_train.config.files import is_group

    keys = set()
    for arg in overrides:
        key = arg.split("=", 1)[0].lstrip("+~")
        if key and not key.startswith("hydra.") and ("." in key or not is_group(key)):
            keys.add(key)
    return keys


def _unflatten(flat: dict) -> dict:
    out: dict = {}
    for key, value in flat.items():
        node = out
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


def _preset_name(name) -> bool:
    """Whether a saved group option may be composed: a checkpoint from elsewhere named its model
    `../../../<elsewhere>/evil`, and Hydra read evil.yaml from outside every config folder, which could set any key
    (resolvers included). Any other name is left out of the composition: the run continues its saved values."""
    return isinstance(name, str) and PRESET_NAME.fullmatch(name) is not None
