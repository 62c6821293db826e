"""`python -m dit_train ARGS` checked before Hydra runs: Hydra makes the run folder (hydra.run.dir) before the
task function starts, so a bad config found there would leave a folder behind. Here the overrides are composed
the way Hydra will compose them (each job of a --multirun sweep) and validated; an error is one line on stderr
and exit status 2."""

from __future__ import annotations

import contextlib
import os
import shutil
import sys

from dit_train.config.errors import ConfigError
from dit_train.config.files import CONF_DIR, group_options, is_group
from dit_train.config.validate import validate

MULTIRUN_FLAGS = ("-m", "--multirun")


def check_group_overrides(overrides: list[str]) -> None:
    """`group=option` names against the config folders: Hydra's own message spans several lines."""
    for arg in overrides:
        if "=" not in arg:
            continue
        key, value = arg.split("=", 1)
        key = key.lstrip("+~")
        if "." in key or "/" in key or not is_group(key):
            continue
        valid = group_options(key)
        for option in value.split(","):  # --multirun lists
            if option not in valid:
                raise ConfigError(f"{key}={option!r} is not a known {key}; valid: {', '.join(valid)}")


def job_overrides(overrides: list[str]) -> list[list[str]]:
    """The override list of every job, sweeps expanded as Hydra's basic sweeper expands them."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except Exception as e:  # noqa: BLE001 - a syntax error: Hydra's first line
        raise ConfigError(_one_line(e)) from None
    if not any(o.is_sweep_override() for o in parsed):
        return [overrides]
    return [job for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]


def compose(overrides: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return hydra_compose(config_name="config", overrides=list(overrides))


def _compose_job(job: list[str]):
    try:
        return compose(job)
    except Exception as e:  # noqa: BLE001 - Hydra's composition errors (unknown key, bad syntax), several lines
        error = ConfigError(_one_line(e))
    # an unknown key (`optimizer.foo=1`) is refused by struct mode in several lines; added with ++ instead, the
    # schema refuses it in one line that lists the valid keys
    forced = [f"++{o}" if "." in o.split("=", 1)[0] and o[0] not in "+~" and not o.startswith("hydra.") else o
              for o in job]
    try:
        cfg = compose(forced)
    except Exception:  # noqa: BLE001 - not an unknown key: Hydra's own first line
        raise error from None
    validate(cfg)
    raise error


def _one_line(e: Exception) -> str:
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    return lines[0] if lines else type(e).__name__


def check_slurm_needs_multirun(flags: list[str], overrides: list[str]) -> None:
    """Hydra's launchers run only under --multirun: without it launcher=slurm would train here, on this machine."""
    if "launcher=slurm" in overrides and not flags and not any(o.startswith("hydra.mode=") for o in overrides):
        raise ConfigError("launcher=slurm submits jobs to Slurm only under --multirun (without it the run would "
                          "train here, on this machine): python -m dit_train --multirun launcher=slurm "
                          + " ".join(o for o in overrides if o != "launcher=slurm"))


def check_command_line(argv: list[str], world_size: int | None = None) -> None:
    """Exit 2 with `error: ...` on stderr if any job of this command line has a bad config. Command lines with
    other Hydra flags (--cfg, --config-dir, --help, ...) are left to Hydra."""
    flags = [a for a in argv if a.startswith("-")]
    overrides = [a for a in argv if not a.startswith("-")]
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        check_group_overrides(overrides)
        if any(f not in MULTIRUN_FLAGS for f in flags):
            return
        from dit_train.extras import check_extras, check_launcher

        check_launcher(overrides)  # a missing plugin first: it is needed with --multirun too
        check_slurm_needs_multirun(flags, overrides)
        for job in job_overrides(overrides):
            cfg = _compose_job(job)
            if cfg.train.get("resume") is not None or cfg.train.get("init_from") is not None:
                from dit_train.runs.resume_config import continue_saved_config  # reads the checkpoint: only for resumes

                cfg = continue_saved_config(cfg, job)
            validate(cfg, world_size)
            check_extras(cfg)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def remove_stray_hydra_dir(path: str) -> None:
    """Remove a Hydra output folder that holds only Hydra's own files (.hydra/, *.log), and its date folder if
    that is then empty: what a job that failed before writing anything leaves behind."""
    try:
        entries = os.listdir(path)
    except OSError:
        return
    if all(e == ".hydra" or e.endswith(".log") for e in entries):
        shutil.rmtree(path, ignore_errors=True)
        with contextlib.suppress(OSError):
            os.rmdir(os.path.dirname(path))
