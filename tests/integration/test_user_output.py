"""What a user reads from the commands of docs/scaling_out.md and docs/data.md, run as typed (shortened): each line
says what happened, once, with the numbers of this run."""

import os
import re
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from conftest import ROOT, needs_fashion, run_cli_in_process

ENV = {**os.environ, "PYTHONPATH": ROOT}
TINY = ["model.hidden_size=32", "model.depth=2", "model.num_heads=1", "model.patch_size=8", "train.batch_size=4",
        "train.warmup_steps=0", "train.val_samples=8", "train.val_batch_size=8", "train.val_t_points=1",
        "train.sample_every=0", "train.progress=false", "train.val_every=2"]


def torchrun(*args, cwd):
    """`torchrun --standalone --nproc_per_node 2 -m dit_train ARGS` (torchrun's own module, this interpreter)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               "-m", "dit_train", *args]
    return subprocess.run(command, cwd=cwd, env=ENV, capture_output=True, text=True, timeout=300)


@needs_fashion
def test_a_one_process_run_resumed_on_two_ranks_says_each_thing_once(tmp_path):
    """The ranks all compose the config and load the checkpoint, but the log says so once (it said it on every
    rank); a small model's FSDP2 traffic is shown in KB, the unit that shows it (it read 0.00 GB, then 0.32 MB)."""
    # the one-process run only makes the checkpoint: in this process (a torchrun launch is ~3 interpreters already)
    first = run_cli_in_process(*TINY, "optimizer=muon", "train.steps=2", "run_dir=run", cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    out = torchrun(*TINY, "optimizer=muon", "train.steps=3", "run_dir=run", "train.resume=auto", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    said = out.stdout + out.stderr
    assert said.count("continuing with the config saved in run/checkpoints/step_00000002.dcp") == 1, said[-3000:]
    assert said.count("resumed from run/checkpoints/step_00000002.dcp at step 2") == 1, said[-3000:]
    traffic = re.search(r"FSDP2 traffic per rank per step: ([0-9.]+) KB, 0.00 KB of it between nodes "
                        r"\(1 node\(s\) of 2 ranks\)", said)
    assert traffic and float(traffic.group(1)) > 0, said[-3000:]
    # the owner exchange's size is the number of ranks, not the letter of the docs' formula
    assert ("sharded: whole-matrix directions in owner mode, U sent in bf16, up to 2 matrices per exchange (one per "
            "rank)") in said


def test_an_integer_reshard_size_that_no_shard_group_of_two_takes_is_refused_in_words(tmp_path):
    """2 ranks have no divisor between 2 and 1: the refusal says true or false, not an empty range."""
    out = torchrun("model=dit_xs", "parallel.reshard_after_forward=3", "run_dir=run", cwd=tmp_path)
    assert out.returncode != 0
    assert ("error: parallel.reshard_after_forward=3 is not valid: choose true or false: an integer must be a divisor "
            "of the shard group size 2 other than 1 and 2, and 2 has none") in out.stderr, out.stderr[-3000:]
    assert "between 2 and 1" not in out.stderr


def test_the_end_of_run_line_counts_the_validation_images_there_are(tmp_path):
    """An image folder whose val/ holds 3 images, with train.val_samples=8: the validation uses 3 and the
    end-of-run line says 3 (it said 8)."""
    rng = np.random.default_rng(0)
    for split, count in (("train", 8), ("val", 3)):
        for c in ("a", "b"):
            os.makedirs(tmp_path / "images" / split / c)
        for i in range(count):
            Image.fromarray(rng.integers(0, 255, (16, 16, 3), dtype=np.uint8)).save(
                tmp_path / "images" / split / "ab"[i % 2] / f"{i}.png")
    out = run_cli_in_process("data=image_folder", "data.root=images", *TINY, "train.steps=2", "run_dir=run",
                             cwd=tmp_path)  # what the command prints, without a new interpreter's start-up
    assert out.returncode == 0, out.stderr[-2000:]
    assert "end of run: checkpoint, validation loss (3 images x 1 t), summary ..." in out.stdout, out.stdout[-2000:]
