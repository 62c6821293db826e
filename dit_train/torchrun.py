"""`dit-torchrun [torchrun options] -m dit_train [overrides]`: torchrun with the trainer's exit codes.

torchrun exits 1 whenever it is signalled or a worker exits non-zero, so a preempted job whose ranks all wrote
their checkpoint and exited 75 looked like a failure to a batch script or wrapper that requeues on 75. This runs
torchrun itself (torch.distributed.run, in this process, every option as torchrun takes it) and changes only its
exit status:

- torchrun received SIGTERM, SIGUSR1 or SIGUSR2 (scancel, Slurm's --signal warning): it has passed the signal on
  to the workers, which checkpoint and exit -> 75 (EX_TEMPFAIL, requeue-able; train.resume=auto continues);
  SIGINT (Ctrl-C) -> 130;
- every failed worker exited 75 (or every one 130): that code.

Anything else keeps torchrun's own status and output. SIGUSR1 and SIGUSR2 are added to the signals torchrun passes
on (its default: SIGTERM, SIGINT, SIGHUP, SIGQUIT) unless --signals-to-handle is given.
"""

from __future__ import annotations

import signal
import sys

from dit_train.trainer.preemption import EXIT_INTERRUPTED, EXIT_PREEMPTED, SIGNALS

PASSED_ON = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1,SIGUSR2"


def exit_code(signal_name: str) -> int:
    return EXIT_INTERRUPTED if signal_name == "SIGINT" else EXIT_PREEMPTED


def asks_for_help(argv: list[str]) -> bool:
    """-h/--help before the training script: this command's help (after `-m dit_train` it is the trainer's)."""
    for arg in argv:
        if arg in ("-h", "--help"):
            return True
        if arg == "-m" or not arg.startswith("-"):
            return False
    return False


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    argv = list(sys.argv[1:] if argv is None else argv)
    if asks_for_help(argv):  # torchrun's help alone never said what this command adds
        print(f"{__doc__.strip()}\n\ntorchrun's options, taken as torchrun takes them:\n")
    if not any(a.startswith(("--signals-to-handle", "--signals_to_handle")) for a in argv):
        argv = [f"--signals-to-handle={PASSED_ON}", *argv]
    try:
        torchrun(argv)
    except SignalException as e:
        name = signal.Signals(e.sigval).name
        if name not in {s.name for s in SIGNALS}:
            raise
        print(f"torchrun: received {name} and passed it on to the workers (a checkpoint, then exit): exit "
              f"{exit_code(name)}", file=sys.stderr)
        return exit_code(name)
    except ChildFailedError as e:
        codes = {failure.exitcode for failure in e.failures.values()}
        if len(codes) != 1 or not codes <= {EXIT_PREEMPTED, EXIT_INTERRUPTED}:
            raise
        code = codes.pop()
        print(f"torchrun: every worker that stopped exited {code} (a stop signal, checkpointed): exit {code}",
              file=sys.stderr)
        return code
    return 0


if __name__ == "__main__":
    sys.exit(main())
