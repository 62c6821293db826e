"""`python -m dit_train [overrides]` — the Hydra entry point, nothing else."""

import logging
import sys

import hydra

from .config import ConfigError, check_command_line, remove_stray_hydra_dir
from .preemption import EXIT_PREEMPTED, Preempted


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg) -> None:
    from .train import TrainingStopped, run  # torch is imported only once the command line is known to be good

    try:
        run(cfg)
    except (ConfigError, FileNotFoundError, FileExistsError, ValueError) as e:
        # bad input: one line, no traceback, and no run folder holding only Hydra's own files
        from hydra.core.hydra_config import HydraConfig

        remove_stray_hydra_dir(HydraConfig.get().runtime.output_dir)
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except TrainingStopped as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    except Preempted as e:
        print(f"preempted: {e}", file=sys.stderr)
        sys.exit(EXIT_PREEMPTED)


if __name__ == "__main__":
    logging.getLogger("dit_train").setLevel(logging.INFO)
    check_command_line(sys.argv[1:])  # before Hydra makes the run folder: a bad config leaves nothing behind
    main()
