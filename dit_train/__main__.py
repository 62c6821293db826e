"""`python -m dit_train [overrides]` — the Hydra entry point, nothing else."""

import logging
import sys

import hydra

from .config import ConfigError, check_command_line, remove_stray_hydra_dir
from .preemption import Preempted, Preemption


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg) -> None:
    from .parallel import CollectiveTimeout
    from .train import TrainingStopped, run  # torch is imported only once the command line is known to be good

    try:
        run(cfg)
    except (ConfigError, FileNotFoundError, FileExistsError, ValueError) as e:
        # bad input: one line, no traceback, and no run folder holding only Hydra's own files
        from hydra.core.hydra_config import HydraConfig

        remove_stray_hydra_dir(HydraConfig.get().runtime.output_dir)
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except (TrainingStopped, CollectiveTimeout) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    except Preempted as e:
        Preemption.ignore_further_signals()
        print(f"preempted: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
    except OSError as e:  # full disk, read-only or unwritable folder: the path and the operation, one line
        print(f"error: {describe_os_error(e)}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:  # Ctrl-C before training started (once it has, it checkpoints: Preempted above)
        print("interrupted before training started; nothing to checkpoint", file=sys.stderr)
        sys.exit(130)


def describe_os_error(e: OSError) -> str:
    import errno
    import traceback

    where = traceback.extract_tb(e.__traceback__)[-1].name if e.__traceback__ else "?"
    code = errno.errorcode.get(e.errno, "") if e.errno else ""
    path = f" {e.filename!r}" if e.filename else ""
    return f"{e.strerror or e}{f' ({code})' if code else ''}:{path} (in {where})"


if __name__ == "__main__":
    logging.getLogger("dit_train").setLevel(logging.INFO)
    check_command_line(sys.argv[1:])  # before Hydra makes the run folder: a bad config leaves nothing behind
    main()
