"""`python -m dit_train [overrides]` — the Hydra entry point, nothing else."""

import logging
import sys

import hydra

from .cli_check import check_group_overrides
from .config_check import ConfigError
from .preemption import EXIT_PREEMPTED, Preempted
from .train import TrainingStopped


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg) -> None:
    from .train import run

    try:
        run(cfg)
    except (ConfigError, FileNotFoundError, FileExistsError, ValueError) as e:
        # bad input: one line, no traceback
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
    check_group_overrides(sys.argv[1:])
    main()
