"""`dit-torchrun --help` (docs/scaling_out.md's Slurm launcher): it printed torchrun's help alone, with no word on
what the command adds (the exit codes 75 and 130, the signals passed on)."""

from dit_train import torchrun


def test_help_says_what_the_command_adds_then_torchruns_options(capsys):
    try:
        code = torchrun.main(["--help"])
    except SystemExit as stop:  # argparse's exit, where torchrun lets it through
        code = stop.code
    assert code in (0, None)
    out = capsys.readouterr().out
    assert out.startswith("`dit-torchrun [torchrun options] -m dit_train [overrides]`: torchrun with the trainer's")
    assert "-> 75 (EX_TEMPFAIL" in out and "SIGINT (Ctrl-C) -> 130" in out
    assert out.index("torchrun's options, taken as torchrun takes them:") < out.index("--nproc-per-node")


def test_a_help_after_the_training_script_is_the_trainers():
    assert torchrun.asks_for_help(["--standalone", "-h"]) and torchrun.asks_for_help(["--help"])
    assert not torchrun.asks_for_help(["--nproc-per-node=2", "-m", "dit_train", "--help"])
    assert not torchrun.asks_for_help(["train.py", "--help"])
