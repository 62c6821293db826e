"""`python -m dit_train ARGS` checked before Hydra runs: Hydra makes the run folder (hydra.run.dir) before the
task function starts, so a bad config found there would leave a folder behind. Here the overrides are composed
the way Hydra will compose them (each job of a --multirun sweep) and validated; an error is one line on stderr
and exit status 2."""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import os
import re
import shutil
import sys

from dit_train.config.data_shapes import apply_data_shapes
from dit_train.config.errors import ConfigError
from dit_train.config.paths import check_paths
from dit_train.config.files import CONF_DIR, GROUPS, group_options, is_group, shadowed_preset
from dit_train.config.override_text import shell_override
from dit_train.config.search_path import (config_name, is_searchpath, primary_folder, searchpath_entries,
                                          searchpath_override, user_folders)
from dit_train.config.validate import validate
from dit_train.plain_text import print_error

MULTIRUN_FLAGS = ("-m", "--multirun")
CONFIG_DIR_FLAGS = ("--config-dir", "-cd")


def split_config_dir(argv: list[str]) -> tuple[str | None, list[str]]:
    """Hydra's `--config-dir DIR` (`-cd DIR`, `--config-dir=DIR`; the last one counts, as in Hydra): a user's own
    config folder, whose groups join ours (their experiment/mine.yaml is experiment=mine), and argv without it."""
    config_dir, rest, i = None, [], 0
    while i < len(argv):
        flag, eq, value = argv[i].partition("=")
        if flag in CONFIG_DIR_FLAGS:
            if not eq:
                if i + 1 == len(argv):
                    raise ConfigError(f"{flag} needs a folder: {flag} DIR")
                i, value = i + 1, argv[i + 1]
            config_dir = value
        else:
            rest.append(argv[i])
        i += 1
    return config_dir, rest


def check_group_overrides(overrides: list[str], folders: list[str] = (), own_primary: bool = True) -> None:
    """`group=option` names against our config folder and the user's `folders`: Hydra's own message spans several
    lines. Top-level keys are checked against ours only under our primary config (a user's --config-path primary
    may declare its own)."""
    for arg in overrides:
        if "=" not in arg:
            continue
        key, value = arg.split("=", 1)
        key = key.lstrip("+~")
        if "/" in key:
            continue
        if "." in key:  # a key of a section or group; a misspelt section (`trian.steps=3`) is named as typed
            head = key.split(".", 1)[0]
            if (own_primary and head != "hydra" and not is_group(head)
                    and not any(os.path.isdir(os.path.join(d, head)) for d in folders)):
                check_top_level_key(key, value)
            continue
        if not is_group(key):
            if own_primary and not any(os.path.isdir(os.path.join(d, key)) for d in folders):  # not the user's
                check_top_level_key(key, value)
            continue
        valid = group_options(key, folders)
        for option in value.split(","):  # --multirun lists
            if option not in valid:
                raise ConfigError(f"{key}={option!r} is not a known {key}; valid: {', '.join(valid)}")
            mine = shadowed_preset(key, option, folders)
            if mine is not None:
                raise ConfigError(f"{key}={option}: {mine} is never read: dit_train's own {key}/{option}.yaml is "
                                  f"searched first and wins; give yours another name")


def check_top_level_key(key: str, value: str) -> None:
    """A name that is neither a group nor a top-level key (`optimzer=muon`, or a dotted `trian.steps=3`, which
    composed to a one-line `config.trian={'steps': 3}`): Hydra's own first line, `Could not
    override 'optimzer'.`, named neither what was meant nor what exists. A section of keys given one value as if it
    were a group (`train=x`): a traceback, or Hydra's line about another override."""
    from dataclasses import fields

    from dit_train.config.files import GROUPS
    from dit_train.config.schema import SECTIONS, RunConfig

    keys = [f.name for f in fields(RunConfig) if f.name not in GROUPS]
    if key.split(".", 1)[0] not in keys:  # `optimzer=muon`, `trian.steps=3`
        raise ConfigError(f"{key}={value!r} is not valid: not a config group or key; groups: {', '.join(GROUPS)}; "
                          f"keys: {', '.join(keys)}")
    is_mapping = value.lstrip().startswith("{")  # `train={steps: 3}` merges into the section
    if key in SECTIONS and not is_mapping:
        raise ConfigError(f"{key}={value!r} is not valid: {key} is a section of keys, not a config group with "
                          f"options; set its keys one by one ({key}.<key>=VALUE), its keys: "
                          f"{', '.join(f.name for f in fields(SECTIONS[key]))}")
    if key == "study" and not is_mapping:  # Hydra: `Could not override 'study'.`
        raise ConfigError(f"study={value!r} is not valid: an experiment's grid for dit-study, set in its yaml "
                          f"(dit_train/conf/experiment/), e.g. study.seeds=[0,1] under experiment=smoke")


def parse_overrides(overrides: list[str]) -> list:
    """Hydra's parse of each override; a syntax error in one line naming the argument, and where a value holding
    Hydra's own characters (`=`, `,`, `[`, a quote) was meant as one string, how to write it."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    parsed = []
    for text in overrides:
        try:
            parsed.append(parser.parse_override(text))
        except Exception as e:  # noqa: BLE001 - a syntax error: Hydra's first line, and the argument it is in
            key, sep, value = text.partition("=")
            try:
                hint = f"; a value meant as one string is written {shell_override(key, value)}"
            except ValueError:
                hint = ""
            raise ConfigError(f"{text}: {_one_line(e)}{hint if sep else ''}") from None
    return parsed


def job_overrides(overrides: list[str]) -> list[list[str]]:
    """The override list of every job, sweeps expanded as Hydra's basic sweeper expands them (the product of the
    sweeps in command-line order; a key given twice keeps its place and its last value)."""
    parsed = parse_overrides(overrides)
    if not any(o.is_sweep_override() for o in parsed):
        return [overrides]
    choices: dict[str, list[str]] = {}
    for o in parsed:
        key = o.get_key_element()
        if not o.is_sweep_override():
            choices[key] = [f"{key}={o.get_value_element_as_str()}"]
        elif o.is_discrete_sweep():
            choices[key] = [f"{key}={value}" for value in o.sweep_string_iterator()]
        else:
            raise ConfigError(f"{key}: only lists of values (a,b,c) can be swept here, not {o.value_type.name}")
    return [list(job) for job in itertools.product(*choices.values())]


def compose(overrides: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return hydra_compose(config_name="config", overrides=list(overrides))


def compose_checked(job: list[str]):
    """The config of one job's overrides, or a ConfigError whose one line names the bad override."""
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


def check_sweep_needs_multirun(flags: list[str], overrides: list[str]) -> None:
    """A list of values (`a,b`) is a sweep, which Hydra runs only under --multirun; without it Hydra stops in a
    traceback, after this command line's run folder was made."""
    if flags or any(o.startswith("hydra.mode=") for o in overrides):
        return
    for text, o in zip(overrides, parse_overrides(overrides)):
        if o.is_sweep_override():
            key, value = text.split("=", 1)
            raise ConfigError(f"{text} is a sweep (several values): add --multirun to run one job per value, or "
                              f"quote it to mean one string: {shell_override(key, value)}")


# Hydra's flags whose next word is their value (`-sc query=bash`, `--cfg job`), not an override
HYDRA_FLAGS_WITH_VALUE = ("-sc", "--shell-completion", "-c", "--cfg", "-p", "--package", "-i", "--info", "-cp",
                          "--config-path", "-cn", "--config-name")


def check_command_line(argv: list[str], world_size: int | None = None) -> list:
    """Exit 2 with `error: ...` on stderr if any job of this command line has a bad config, composed with the
    user's --config-dir if any. Command lines with other Hydra flags (--cfg, --help, ...) are left to Hydra.
    Returns the checked config of each job (check_jobs)."""
    try:
        return check_jobs(argv, world_size)
    except ConfigError as e:
        print_error(str(e))
        sys.exit(2)


def check_jobs(argv: list[str], world_size: int | None = None, decide_resume: bool = True) -> list:
    """check_command_line's checks, raising the ConfigError; the config of each job, checked ([] for a command line
    left to Hydra). dit-study checks its groups' command lines with it before it writes or runs anything, without
    `decide_resume` (reading each job's run folder: a finished run it will not start, and each trainer decides
    again)."""
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    config_dir, argv = split_config_dir(argv)
    if config_dir is not None and not os.path.isdir(config_dir):
        raise ConfigError(f"--config-dir {config_dir}: no such folder (it holds your own config groups, e.g. "
                          f"{os.path.join(config_dir, 'experiment', 'mine.yaml')} for experiment=mine)")
    flags = [a for a in argv if a.startswith("-")]
    overrides = [a for i, a in enumerate(argv) if not a.startswith("-")
                 and not (i and argv[i - 1] in HYDRA_FLAGS_WITH_VALUE)]  # `-sc query=bash` is no override
    for i, a in enumerate(argv):
        if a.startswith("-") and not (i and argv[i - 1] in HYDRA_FLAGS_WITH_VALUE):
            check_flag(a)
    primary_dir = primary_folder(argv)  # ours, or the user's --config-path
    entries = searchpath_entries(overrides, config_dir, config_name(argv), primary_dir)
    check_group_overrides(overrides, user_folders(config_dir, entries, primary_dir), primary_dir == CONF_DIR)
    if any(f not in MULTIRUN_FLAGS for f in flags):
        return []
    from dit_train.extras import check_extras, check_launcher, check_slurm_here

    check_launcher(overrides)  # a missing plugin first: it is needed with --multirun too
    check_slurm_needs_multirun(flags, overrides)
    check_slurm_here(overrides)
    check_sweep_needs_multirun(flags, overrides)
    # the user's folders where Hydra puts them, after ours, as one override
    searchpath = searchpath_override(config_dir, entries)
    jobs = [searchpath + job for job in job_overrides([o for o in overrides if not is_searchpath(o)])]
    folders = None
    if decide_resume:  # dit-study's check leaves the folders Hydra writes to each group's trainer, which checks them
        first = hydra_config(jobs[0])  # composed once for both checks below
        check_hydra_folder(first, multirun=bool(flags))
        # a sweep's jobs' folders (a too-long name refused): a single run's folder is made by the command
        folders = sweep_job_folders(jobs, first) if flags else None
    configs, run_dirs = [], {}
    for num, job in enumerate(jobs):
        cfg = compose_checked(job)
        if flags:
            refuse_a_shared_run_dir(cfg, num, run_dirs)
        # the checkpoint's train state, read once for both the config it continues and the resume decision
        read_state = functools.cache(read_saved_state)
        if folders is not None:  # each job's resume is decided now, not after Hydra rewrote
            cfg = in_its_sweep_folder(cfg, folders[num])  # multirun.yaml
        composed = cfg
        if decide_resume and (cfg.train.get("resume") is not None or cfg.train.get("init_from") is not None):
            from dit_train.runs.resume_config import continue_saved_config  # reads the checkpoint: only for resumes

            with quiet_log():
                cfg = continue_saved_config(cfg, job, read_state)
        cfg = apply_data_shapes(cfg, job, continued=cfg is not composed)
        # a Slurm job's ranks are its own shape's, not this login node's: checked there, it was submitted and refused
        validate(cfg, slurm_world_size(cfg, world_size) if "launcher=slurm" in overrides else world_size)
        check_paths(cfg)
        check_extras(cfg)
        if decide_resume:
            with quiet_log():
                check_run_folder(cfg, read_state)
        configs.append(cfg)
    return configs


@functools.cache
def hydra_flags() -> tuple[str, ...]:
    from hydra._internal.utils import get_args_parser

    return tuple(sorted(o for action in get_args_parser()._actions for o in action.option_strings))


def check_flag(arg: str) -> None:
    """A flag Hydra's parser does not know (`--dry-run`, `--multirum`): Hydra printed its 7-line usage and
    `__main__.py: error: unrecognized arguments`. One line naming the flag, the flags there are, and the config key
    it may have meant (`--dry-run`: train.dry_run=true). argparse's prefixes (`--multi`) too: the checks here know
    the flags by their names (`--multi` skipped every check, and a dry run wrote a multirun/ folder)."""
    from dataclasses import fields

    from dit_train.config.schema import SECTIONS

    name, given, value = arg.partition("=")
    known = hydra_flags()
    if name in known:
        return
    key = name.lstrip("-").replace("-", "_")
    meant = [f"{section}.{f.name}={value if given else 'true' if f.type in (bool, 'bool') else 'VALUE'}"
             for section, schema in SECTIONS.items() for f in fields(schema) if f.name == key]
    hint = f"; did you mean the override {meant[0]}?" if meant else ""
    raise ConfigError(f"{name} is not a flag of dit-train (flags: {', '.join(f for f in known if f.startswith('--'))}; "
                      f"everything else is an override key=value){hint}")


def refuse_a_shared_run_dir(cfg, num: int, seen: dict) -> None:
    """Two jobs of one --multirun with one run folder (`--multirun run_dir=runs/x optimizer=adamw,muon`): the
    first trained there and the second was refused after it (the folder had checkpoints), or with
    train.resume=auto continued the first's run under its own config. `seen`: folder -> the job that has it."""
    from omegaconf import OmegaConf

    from dit_train.config.schema import HYDRA_OUTPUT_DIR

    raw = OmegaConf.to_container(cfg, resolve=False).get("run_dir")
    if raw == HYDRA_OUTPUT_DIR or not isinstance(raw, str):
        return
    try:
        folder = os.path.abspath(str(cfg.run_dir))
    except Exception:  # noqa: BLE001 - ${hydra:...}, ${now:...}: Hydra's to resolve, job by job
        return
    if folder in seen:
        raise ConfigError(f"run_dir={raw} is the run folder of jobs #{seen[folder]} and #{num} of this --multirun: "
                          f"each job needs its own; leave run_dir out and give "
                          f"{shell_override('hydra.sweep.dir', raw)} (each job then has a folder of its own in it)")
    seen[folder] = num


def slurm_world_size(cfg, default: int) -> int:
    """A launcher=slurm job's world size: model.launch.nodes x gpus_per_node, one task (rank) per GPU
    (conf/launcher/slurm.yaml); `default` where they are not positive integers (validate's own line names them)."""
    launch = cfg.model.get("launch") or {}
    nodes, gpus = launch.get("nodes"), launch.get("gpus_per_node")
    if all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in (nodes, gpus)):
        return nodes * gpus
    return default


def hydra_config(job: list[str]):
    """The job's config with Hydra's own (hydra.*) composed as Hydra composes it, or None where it does not compose
    (a bad override, which the job's own check says; ${now:...})."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    try:
        with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
            return hydra_compose(config_name="config", overrides=list(job), return_hydra_config=True)
    except Exception:  # noqa: BLE001 - see above
        return None


def groups_of(job: list[str]) -> tuple:
    """The job's choices of config groups (`model=dit_s`, a group of the user's own): they set the keys a sweep's
    folder names leave out. A top-level value (`seed=3`, `run_dir=X`) is no choice of group: counted as one, each
    seed of a sweep was composed again."""
    import dataclasses

    from dit_train.config.schema import RunConfig

    values = {f.name for f in dataclasses.fields(RunConfig)} - set(GROUPS)
    return tuple(o for o in job if "=" in o and "." not in (key := o.split("=", 1)[0])
                 and key.lstrip("+~") not in values)


def check_hydra_folder(cfg, multirun: bool) -> None:
    """The folder Hydra itself will write into (a sweep's hydra.sweep.dir, from the command line or a preset such as
    an experiment's `sweeps/<name>`; a single run's hydra.run.dir) of the first job's `cfg` (hydra_config), checked
    for links and FIFOs before Hydra writes its files there (runs/in_place_files.py). One that does not resolve
    yet, or does not exist, is new."""
    from omegaconf import OmegaConf

    from dit_train.runs.in_place_files import refuse_hydra_writes_outside

    key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
    try:
        folder = None if cfg is None else OmegaConf.select(cfg, key)
    except Exception:  # noqa: BLE001 - ${now:...} and the like: a new folder
        return
    if folder is not None and os.path.isdir(str(folder)):
        refuse_hydra_writes_outside(str(folder), key)


def in_its_sweep_folder(cfg, folder: str):
    """The job's config with run_dir its sweep folder where run_dir is Hydra's output folder (the default), so
    that the job's resume is checked before the sweep starts: a refused job used to be refused only once Hydra
    had replaced the sweep folder's multirun.yaml with the refused command."""
    from omegaconf import OmegaConf, open_dict

    from dit_train.config.schema import HYDRA_OUTPUT_DIR

    if OmegaConf.to_container(cfg, resolve=False).get("run_dir") != HYDRA_OUTPUT_DIR:
        return cfg
    cfg = cfg.copy()
    with open_dict(cfg):
        cfg.run_dir = folder
    return cfg


def sweep_job_folders(jobs: list[list[str]], first=None) -> list[str] | None:
    """Each sweep job's folder as Hydra will name it (None where the jobs do not compose: Hydra's to say), each name
    within the file system's limit (255 bytes on most). The experiments name a sweep's
    sub-folders by their overrides (hydra.sweep.subdir=${hydra.job.override_dirname}), which a dozen overrides
    exceed: Hydra's OSError would come after the sweep began, as a traceback. The folder is composed as Hydra
    composes it: once per choice of config groups (they set the excluded keys; `first` is the first job's,
    composed already), each job's overrides and number."""
    from hydra._internal.config_loader_impl import get_overrides_dirname
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import open_dict

    parser, composed = OverridesParser.create(), ({groups_of(jobs[0]): first} if first is not None else {})
    folders = []
    for num, job in enumerate(jobs):
        groups = groups_of(job)
        if groups not in composed:
            composed[groups] = hydra_config(job)
        cfg = composed[groups]
        if cfg is None:  # Hydra's to say
            return None
        try:
            naming = cfg.hydra.job.config.override_dirname
            with open_dict(cfg):
                cfg.hydra.job.num = num
                cfg.hydra.job.override_dirname = get_overrides_dirname(
                    [o for o in parser.parse_overrides(list(job)) if not o.is_hydra_override()],
                    exclude_keys=list(naming.exclude_keys), item_sep=naming.item_sep, kv_sep=naming.kv_sep)
            folder = os.path.join(str(cfg.hydra.sweep.dir), str(cfg.hydra.sweep.subdir))
        except Exception:  # noqa: BLE001 - a bad override (the job's own check says it) or ${now:...}: Hydra's
            return None
        folders.append(folder)
        limit = _name_limit(folder)
        long = next((part for part in folder.split(os.sep) if len(part.encode()) > limit), None)
        if long is not None:
            raise ConfigError(f"folder name of {len(long.encode())} bytes, more than this file system's {limit}: "
                              f"{os.path.join(os.path.dirname(folder), long[:50])}...; pass fewer overrides per job "
                              f"(shared ones can go in an experiment file), or name the jobs' folders by number: "
                              f"hydra.sweep.subdir='${{hydra.job.num}}'")
    return folders


def _name_limit(path: str) -> int:
    """The longest file name (bytes) of the file system that would hold `path`: its deepest existing folder's."""
    folder = os.path.abspath(path)
    while not os.path.isdir(folder):
        folder = os.path.dirname(folder)
    try:
        return os.pathconf(folder, "PC_NAME_MAX")
    except (OSError, ValueError):
        return 255


def read_saved_state(path: str) -> dict:
    from dit_train.runs.checkpoint import read_saved_state as read  # torch: only once a checkpoint is read

    return read(path)


def check_run_folder(cfg, read_state) -> None:
    """The resume decision (resume_policy.check_resume) before Hydra starts logging, so that a refused resume, or a
    fresh run into a folder that has checkpoints, is its one line and the run folder's dit_train.log is left as it
    was. A folder Hydra names (no run_dir=) is new: nothing to decide. The run decides again, under its lock."""
    from omegaconf.errors import InterpolationResolutionError

    from dit_train.runs.resume_policy import check_resume

    if cfg.train.get("dry_run"):  # it reads no run folder
        return
    try:
        check_resume(cfg, read_state)
    except InterpolationResolutionError:  # run_dir is ${hydra:runtime.output_dir}: known once Hydra runs
        return
    except (FileExistsError, FileNotFoundError, ValueError) as e:  # a CheckpointError is a ValueError
        raise ConfigError(str(e)) from None
    except OSError:  # an unreadable folder: the run says it, with the path and the operation
        return


@contextlib.contextmanager
def quiet_log():
    """Silences dit_train's log while the check repeats the run's own first steps: the run logs them once Hydra has
    set up its logging, and a warning here (printed bare, before Hydra) would come twice."""
    logger = logging.getLogger("dit_train")
    was, logger.disabled = logger.disabled, True
    try:
        yield
    finally:
        logger.disabled = was


def remove_stray_hydra_dir(path: str) -> None:
    """Remove a Hydra output folder that holds only Hydra's own files (.hydra/, *.log), and its date folder if
    that is then empty: what a job that failed before writing anything leaves behind. Only a folder named as
    Hydra's date level (`runs/${now:%Y-%m-%d}/...`) goes with it: the parent of a given `run_dir` is the user's
    (`mkdir /shared/runs`, then a run in it that failed) and was removed when empty."""
    try:
        entries = os.listdir(path)
    except OSError:
        return
    if all(e == ".hydra" or e.endswith(".log") for e in entries):
        shutil.rmtree(path, ignore_errors=True)
        parent = os.path.dirname(os.path.abspath(path))
        if re.fullmatch(r"\d{4}-\d{2}-\d{2}", os.path.basename(parent)):
            with contextlib.suppress(OSError):
                os.rmdir(parent)
