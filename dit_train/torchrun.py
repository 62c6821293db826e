"""`dit-torchrun [torchrun options] -m dit_train [overrides]`: torchrun with the trainer's exit codes.

torchrun exits 1 whenever it is signalled or a worker exits non-zero, so a preempted job whose ranks all wrote
their checkpoint and exited 75 looked like a failure to a batch script or wrapper that requeues on 75. This runs
torchrun itself (torch.distributed.run, in this process, every option as torchrun takes it) and changes only its
exit status:

- torchrun received SIGTERM, SIGUSR1 or SIGUSR2 (scancel, Slurm's --signal warning): it has passed the signal on
  to the workers, which checkpoint and exit -> 75 (EX_TEMPFAIL, requeue-able; train.resume=auto continues);
  SIGINT (Ctrl-C) -> 130;
- every failed worker exited 75 (or every one 130): that code.

Anything else keeps torchrun's own status and output, except a refusal: the trainer's command line (`-m dit_train`
or `--no-python dit-train`) is checked here first, at the job's world size, so a bad value is one line and exit 2
before any worker starts (each worker printed it, then torchrun's traceback, exit 1), as is a GLOO_SOCKET_IFNAME or
NCCL_SOCKET_IFNAME naming no interface of this host; where every worker exited 2 (a refusal only a worker can make;
torchrun stops the others), exit 2 with one line; where they exited 73 (the run folder is in use by another
process), exit 73 with one line; a rendezvous port already in use on this host (`--master-port`, another job's
store) is one line naming it and exit 2, not torchrun's 40-line traceback. SIGUSR1 and SIGUSR2 are added to the
signals torchrun passes on (its default: SIGTERM, SIGINT, SIGHUP, SIGQUIT) unless --signals-to-handle is given.
"""

from __future__ import annotations

import re
import signal
import sys

from dit_train.runs.lock import EXIT_RUN_FOLDER_BUSY
from dit_train.trainer.preemption import EXIT_INTERRUPTED, EXIT_PREEMPTED, SIGNALS

PASSED_ON = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1,SIGUSR2"
EXIT_REFUSED = 2  # the trainer's exit status for a refused command line or run folder


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


def trainer_command_line(argv: list[str]) -> tuple[list[str], int | None] | None:
    """(the trainer's overrides, the job's world size or None where torchrun decides it: `--nproc-per-node gpu`, an
    elastic `--nnodes 1:4`), or None when the training script is not dit_train's trainer."""
    from torch.distributed.run import get_args_parser

    try:
        args = get_args_parser().parse_args(argv)
    except SystemExit:  # torchrun's own usage error: torchrun says it
        return None
    script = args.training_script
    if not ((args.module and script == "dit_train") or (args.no_python and script.rsplit("/", 1)[-1] == "dit-train")):
        return None
    low, _, high = str(args.nnodes).partition(":")
    nodes = int(low) if low.isdigit() and (not high or high == low) else None
    per_node = int(args.nproc_per_node) if str(args.nproc_per_node).isdigit() else None
    return list(args.training_script_args), (nodes * per_node if nodes and per_node else None)


def port_in_use(error: Exception) -> str | None:
    """The line for torchrun's rendezvous store failing to listen on a port another process holds, else None."""
    if "EADDRINUSE" not in str(error):
        return None
    port = re.search(r"port: (\d+)", str(error))
    where = f"port {port.group(1)}" if port else "the rendezvous port"
    return (f"torchrun: {where} is in use on this host (another job's rendezvous?): pass a free port with "
            f"--master-port (or --rdzv-endpoint HOST:PORT), or --standalone on one node")


def main(argv: list[str] | None = None) -> int:
    from torch.distributed import DistNetworkError
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    argv = list(sys.argv[1:] if argv is None else argv)
    if asks_for_help(argv):  # torchrun's help alone never said what this command adds
        print(f"{__doc__.strip()}\n\ntorchrun's options, taken as torchrun takes them:\n")
    trainer = None if asks_for_help(argv) else trainer_command_line(argv)
    if trainer is not None and trainer[1] is not None:
        from dit_train.config import check_command_line

        check_command_line(trainer[0], world_size=trainer[1])  # a refusal: its one line, exit 2
    if trainer is not None:  # the workers inherit this node's variables: a bad interface name, once, not per rank
        from dit_train.parallel.backend_env import check_socket_interfaces
        from dit_train.plain_text import print_error

        try:
            check_socket_interfaces()
        except ValueError as e:
            print_error(str(e))
            return EXIT_REFUSED
    if not any(a.startswith(("--signals-to-handle", "--signals_to_handle")) for a in argv):
        argv = [f"--signals-to-handle={PASSED_ON}", *argv]
    try:
        torchrun(argv)
    except DistNetworkError as e:  # before any worker started: torchrun's store could not listen
        line = port_in_use(e)
        if line is None:
            raise
        from dit_train.plain_text import print_error

        print_error(line)
        return EXIT_REFUSED
    except SignalException as e:
        name = signal.Signals(e.sigval).name
        if name not in {s.name for s in SIGNALS}:
            raise
        print(f"torchrun: received {name} and passed it on to the workers (a checkpoint, then exit): exit "
              f"{exit_code(name)}", file=sys.stderr)
        return exit_code(name)
    except ChildFailedError as e:
        codes = {failure.exitcode for failure in e.failures.values()}
        # a refusal (every rank makes it; torchrun stops those still running with a signal: a negative code)
        for refusal, what in ((EXIT_REFUSED, "the workers were refused"),
                              (EXIT_RUN_FOLDER_BUSY, "the run folder is in use by another process")):
            if refusal in codes and all(c == refusal or c < 0 for c in codes):
                print(f"torchrun: {what} (the error line is above): exit {refusal}", file=sys.stderr)
                return refusal
        if len(codes) != 1 or not codes <= {EXIT_PREEMPTED, EXIT_INTERRUPTED}:
            raise
        code = codes.pop()
        print(f"torchrun: every worker that stopped exited {code} (a stop signal, checkpointed): exit {code}",
              file=sys.stderr)
        return code
    return 0


if __name__ == "__main__":
    sys.exit(main())
