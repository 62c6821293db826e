"""`dit-train [overrides]` / `python -m dit_train [overrides]` — the Hydra entry point, nothing else.
Tab completion: `eval "$(dit-train -sc install=bash)"` (the console script; Hydra's completion script cannot call
`python -m`)."""

import logging
import os
import sys

import hydra

from dit_train.runs.atomic_io import describe_os_error
from dit_train.config import CONF_DIR, ConfigError, check_command_line, remove_stray_hydra_dir
from dit_train.config.command_line import MULTIRUN_FLAGS, split_config_dir
from dit_train.config.override_text import override, parsed_value, shell_override
from dit_train.runs.hydra_files import defer_hydra_files
from dit_train.runs.lock import EXIT_RUN_FOLDER_BUSY, RunFolderBusy
from dit_train.trainer.preemption import UNDER_STUDY_ENV, Preempted, Preemption, exit_interrupted
from dit_train.parallel.launch_rank import launch_rank
from dit_train.plain_text import print_error

INTERRUPTED = "interrupted before training started; nothing to checkpoint"


# an absolute path: imported by the console script, a relative one would be looked up as the module dit_train.conf
BUSY_JOBS: list[str] = []  # the jobs of a local --multirun skipped because their run folder was in use


def in_local_sweep() -> bool:
    """A --multirun whose jobs run one after another in this process (Hydra's basic launcher): one job's refusal
    need not end the others. (A Slurm job is a process of its own: its exit status is its job's.)"""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hc = HydraConfig.get()
    return hc.mode == RunMode.MULTIRUN and str(hc.launcher.get("_target_", "")).endswith("BasicLauncher")


def sweep_continuation() -> str:
    """What to type after a local --multirun stopped at one of its jobs (Ctrl-C, SIGTERM): the job's own hint
    (`train.resume=auto run_dir=<sweep>/N`) continues that job alone, and the sweep's later jobs were never run."""
    from hydra.core.hydra_config import HydraConfig

    from dit_train.config.override_text import shell_command

    hc = HydraConfig.get()
    kept = [a for a in sys.argv[1:] if a not in MULTIRUN_FLAGS
            and not a.startswith(("hydra.sweep.dir=", "train.resume=", "+train.resume="))]
    command = shell_command(["python", "-m", "dit_train", "--multirun",
                             override("hydra.sweep.dir", os.path.abspath(hc.sweep.dir)), "train.resume=auto", *kept])
    return (f"the --multirun sweep stopped at its job {hc.job.num}; the jobs after it did not run: continue the whole "
            f"sweep (each job from its own checkpoint, finished jobs skipped) with: {command}")


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
def main(cfg) -> None:
    from dit_train.parallel.fsdp import CollectiveTimeout
    from dit_train.trainer.loop import TrainingStopped, run  # torch is imported only once the command line is known to be good

    try:
        from hydra.core.hydra_config import HydraConfig

        from dit_train.config.data_shapes import apply_data_shapes
        from dit_train.config.search_path import is_searchpath
        from dit_train.runs.resume_config import continue_saved_config

        overrides = list(HydraConfig.get().overrides.task)
        # the command line's hydra.searchpath (not a task override): a resume composes its options with it too
        searchpath = [o for o in HydraConfig.get().overrides.hydra if is_searchpath(o)]
        continued = continue_saved_config(cfg, searchpath + overrides)
        run(apply_data_shapes(continued, overrides, continued=continued is not cfg))
        if cfg.train.dry_run:  # it writes nothing: no run folder holding only Hydra's own files either
            from hydra.core.hydra_config import HydraConfig

            remove_stray_hydra_dir(HydraConfig.get().runtime.output_dir)
    except (ConfigError, FileNotFoundError, FileExistsError, ValueError) as e:
        # bad input: one line, no traceback, and no run folder holding only Hydra's own files
        from hydra.core.hydra_config import HydraConfig

        remove_stray_hydra_dir(HydraConfig.get().runtime.output_dir)
        if isinstance(e, RunFolderBusy) and in_local_sweep():
            # one job's folder in use (a second process on the same sweep): the others still run; the sweep ends
            # with the busy status (start), so the same command, rerun later, finishes it
            print_error(f"{e}; this job is skipped, the sweep goes on")
            BUSY_JOBS.append(str(e))
            return
        if not getattr(e, "quiet", False):  # a refusal rank 0 says for every rank (runs/folder.py)
            print_error(str(e))
        sys.exit(EXIT_RUN_FOLDER_BUSY if isinstance(e, RunFolderBusy) else 2)  # busy: the same command works later
    except (TrainingStopped, CollectiveTimeout) as e:
        from hydra.core.hydra_config import HydraConfig

        # a process group that never formed: nothing written yet, no folder of Hydra's files alone left behind
        remove_stray_hydra_dir(HydraConfig.get().runtime.output_dir)
        print_error(str(e))
        sys.exit(1)
    except Preempted as e:
        Preemption.ignore_further_signals()
        if e.announce:  # rank 0's line, not one per rank (preemption.py)
            print(f"preempted: {e}", file=sys.stderr)
            if in_local_sweep() and not os.environ.get(UNDER_STUDY_ENV):  # the sweep ends here: its later jobs
                # never started (a dit-study group's sweep: dit-study says to rerun the study)
                print(sweep_continuation(), file=sys.stderr)
        sys.exit(e.exit_code)
    except OSError as e:  # full disk, read-only or unwritable folder: the path and the operation, one line
        print_error(describe_os_error(e))
        sys.exit(1)
    except KeyboardInterrupt:  # Ctrl-C before training started (once it has, it checkpoints: Preempted above)
        exit_interrupted(INTERRUPTED)


def check_writable(run_dir: str) -> None:
    """Exit 1 with one line if nothing can be written into the run folder (a read-only file system, a folder of
    another user): Hydra's log file there would fail first, in a traceback."""
    import errno
    import tempfile

    checkpoints = os.path.join(run_dir, "checkpoints")  # read-only alone (a mount): found only at the first save
    for folder in (run_dir, *([checkpoints] if os.path.isdir(checkpoints) else [])):
        try:
            with tempfile.TemporaryFile(dir=folder):
                pass
        except OSError as e:
            code = errno.errorcode.get(e.errno, "?") if e.errno else "?"
            what = "run folder" if folder == run_dir else "the run folder's"
            print_error(f"{what} {folder} is not writable ({e.strerror}, {code}): a run writes its checkpoints "
                        f"and metrics there; copy it to a writable place, or fork it with "
                        f"{shell_override('train.init_from', run_dir)} into a new run_dir")
            sys.exit(1)


def explicit_run_dir(argv: list[str]) -> str | None:
    """`run_dir=X` of a single run (no sweep, --help, completion or other flag than --config-dir; no
    hydra.run.dir), else None."""
    _, argv = split_config_dir(argv)
    if any(a.startswith("-") or a.startswith("hydra.run.dir=") for a in argv):
        return None
    run_dirs = [a for a in argv if a.startswith("run_dir=")]
    return str(parsed_value(run_dirs[-1])) if run_dirs else None


def dry_run_kind(argv: list[str], configs: list) -> str | None:
    """"run" for one job, "sweep" for a local --multirun, whose every job is a dry run; else None (a command left
    to Hydra, --help, completion; a Slurm sweep, whose jobs' logs need the shared sweep folder)."""
    _, argv = split_config_dir(argv)
    flags = [a for a in argv if a.startswith("-")]
    if not configs or not all(c.train.get("dry_run") for c in configs) or "launcher=slurm" in argv:
        return None
    if not flags:
        return "run" if len(configs) == 1 else None
    return "sweep" if all(f in MULTIRUN_FLAGS for f in flags) else None


def dry_run_without_folder(kind: str) -> None:
    """A dry run writes nothing: Hydra always makes its output folder (and opens dit_train.log there; a sweep also
    writes multirun.yaml), so it gets a temporary one, removed after, with no `.hydra/` in it. Even a killed dry
    run leaves no runs/ or multirun/ in the cwd. The user's own hydra.run.dir / hydra.sweep.dir /
    hydra.output_subdir are replaced: nothing is written there either."""
    import shutil
    import tempfile

    folder = tempfile.mkdtemp(prefix="dit-train-dry-run-")
    sys.argv[1:] = [a for a in sys.argv[1:]
                    if not a.startswith(("hydra.run.dir=", "hydra.sweep.dir=", "hydra.output_subdir="))]
    sys.argv += [override(f"hydra.{kind}.dir", folder), "hydra.output_subdir=null"]
    try:
        main()
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def cli() -> None:
    """The `dit-train` console script and `python -m dit_train`: Ctrl-C before training starts is one line and exit
    130 (once training has started, the run checkpoints and says so: trainer/preemption.py)."""
    try:
        start()
    except KeyboardInterrupt:  # the command line's check (composing every job, reading checkpoints) takes seconds
        exit_interrupted(INTERRUPTED)


def start() -> None:
    # every rank composes the config and resumes, but only the first says so: the others log warnings and errors
    logging.getLogger("dit_train").setLevel(logging.INFO if launch_rank() == 0 else logging.WARNING)
    BUSY_JOBS.clear()  # this command's sweep only (a caller may run several in one process)
    # before Hydra makes the run folder: a bad config leaves nothing behind
    configs = check_command_line(sys.argv[1:])
    kind = dry_run_kind(sys.argv[1:], configs)
    if kind is not None:
        return dry_run_without_folder(kind)
    run_dir = explicit_run_dir(sys.argv[1:])
    if run_dir is not None:
        # Hydra's own files (.hydra/, dit_train.log) go into the run folder too: otherwise every such run, and every
        # resume, leaves a runs/<date>/<time>/ folder holding only them. Made here: Hydra's error would be a traceback
        if "${" not in run_dir:  # an interpolation (`runs/${now:%H-%M}`) is Hydra's to resolve, not a folder name
            try:
                os.makedirs(run_dir, exist_ok=True)
            except OSError as e:
                print_error(describe_os_error(e))
                sys.exit(1)
            check_writable(run_dir)
        sys.argv.append(override("hydra.run.dir", run_dir))
        if not any(a.startswith("hydra.output_subdir=") for a in sys.argv[1:]):
            # ... but `.hydra/` only once the run is accepted: a refused resume or second writer would overwrite the
            # run's record of its command (run_folder.py writes them after its checks)
            sys.argv.append(defer_hydra_files())
    main()
    if BUSY_JOBS:
        print_error(f"{len(BUSY_JOBS)} job(s) of this sweep skipped: their run folders were in use by another "
                    f"process; rerun the same command when it has finished (finished runs are not rerun)")
        sys.exit(EXIT_RUN_FOLDER_BUSY)


if __name__ == "__main__":
    cli()
