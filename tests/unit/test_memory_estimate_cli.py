"""dit-estimate-memory's arguments and output, without estimating (the estimate itself, on fake process groups, is
tests/integration/test_memory_estimate.py's): the batch it estimates is the trainer's, what the trainer refuses is
one line, --table passes its flags and overrides to every row and keys its cache by them, and an estimate that
does not fit says what would. Found by a new-user trial."""

import json
import subprocess

import pytest

from dit_train.parallel import memory_estimate as estimator
from dit_train.parallel import memory_estimate_cli as em
from dit_train.parallel import memory_formula

GIB = 2**30


def fake_result(peak_gib: float = 1.0, persistent_gib: float = 0.5) -> dict:
    keys = [k for k, _ in em.ROWS]
    persistent = {k: 0 for k in keys} | {"total": int(persistent_gib * GIB)}
    peak = {k: 0 for k in keys} | {"total": int(peak_gib * GIB)}
    return {"persistent": persistent, "peak": peak, "steps": 2, "seconds": 1.0}


@pytest.fixture
def estimates(monkeypatch):
    """The (world size, images per forward, forwards per step) of each estimate main() asks for; none is run."""
    calls = []

    def estimate(cfg, world_size, micro_batch, fake=True, micro_batches=1):
        calls.append((world_size, micro_batch, micro_batches))
        assert cfg.train.batch_size == world_size * micro_batch * micro_batches  # the trainer's split of it
        return fake_result()

    monkeypatch.setattr(estimator, "estimate", estimate)
    return calls


def test_micro_batches_split_the_global_batch_and_the_header_says_so(estimates, capsys):
    """--micro-batches 4 on 8 ranks: 4 forwards of 1024 / 8 / 4 = 32 images (were 4 of 128: 4x the batch)."""
    assert em.main(["--preset", "dit_xs", "--world-size", "8", "--micro-batches", "4"]) == 0
    assert estimates == [(8, 32, 4)]
    head = capsys.readouterr().out.splitlines()[0]
    assert "global batch 1024 = 4 micro-batches of 32 images/rank x 8 ranks" in head


def test_an_explicit_micro_batch_states_the_global_batch_it_makes(estimates, capsys):
    assert em.main(["--preset", "dit_xs", "--world-size", "32", "--micro-batch", "7"]) == 0
    assert estimates == [(32, 7, 1)]
    assert "global batch 224 = micro-batch 7 images/rank x 32 ranks" in capsys.readouterr().out.splitlines()[0]


def test_a_train_micro_batch_size_override_is_the_trainers_accumulation(estimates):
    assert em.main(["--preset", "dit_xs", "--world-size", "8", "train.micro_batch_size=16"]) == 0
    assert estimates == [(8, 16, 8)]


@pytest.mark.parametrize("argv, message", [
    (["--world-size", "0"], "error: --world-size 0: must be an integer >= 1"),
    (["--world-size", "-4"], "error: --world-size -4: must be an integer >= 1"),
    (["--micro-batch", "0"], "error: --micro-batch 0: must be an integer >= 1"),
    (["--table", "--world-sizes", "8", "0"], "error: --world-sizes 0: must be an integer >= 1"),
    (["--world-size", "3"], "error: train.batch_size=1024 is not valid: must be divisible by the world size 3"),
    (["--world-size", "100000"],  # a per-rank batch of 0: hung
     "error: train.batch_size=1024 is not valid: must be divisible by the world size 100000"),
    (["--world-size", "8", "--micro-batches", "3"],
     "error: --micro-batches 3: must divide the per-rank batch 128 (train.batch_size=1024 over 8 ranks)"),
    (["--world-size", "8", "--micro-batches", "2", "train.micro_batch_size=16"],
     "error: train.micro_batch_size=16 disagrees with --micro-batch/--micro-batches (micro_batch_size 64 on 8 "
     "ranks): give one of them"),
    (["--table", "--optimizers", "adamw", "--world-sizes", "8", "3"],  # before the first row's minutes
     "error: train.batch_size=1024 is not valid: must be divisible by the world size 3"),
])
def test_what_the_trainer_refuses_is_one_line_and_exit_status_2_before_any_work(argv, message, estimates,
                                                                                monkeypatch, capsys):
    monkeypatch.setattr(em.subprocess, "run", lambda *a, **k: pytest.fail("a --table row ran"))
    assert em.main(["--preset", "dit_xs", "--presets", "dit_xs", *argv]) == 2
    assert capsys.readouterr().err.splitlines() == [message]
    assert estimates == []


@pytest.mark.parametrize("argv, flag", [(["--world-sizes", "0"], "--world-sizes 0"),
                                        (["--world-sizes", "8", "-4"], "--world-sizes -4"),
                                        (["--micro-batch", "0"], "--micro-batch 0")])
def test_the_formula_refuses_a_count_below_one_in_one_line(argv, flag, capsys):
    """Was a ZeroDivisionError traceback (argparse takes --world-size for --world-sizes)."""
    assert memory_formula.main(["--presets", "dit_1b3", *argv]) == 2
    assert capsys.readouterr().err.splitlines() == [f"error: {flag}: must be an integer >= 1"]


def child(cmd, **kwargs):
    """A --table row's subprocess, instantly: the JSON line the child would print for its argv."""
    i = cmd.index
    row = fake_result() | {
        "preset": cmd[i("--preset") + 1], "optimizer": cmd[i("--optimizer") + 1],
        "world_size": int(cmd[i("--world-size") + 1]), "micro_batch": int(cmd[i("--micro-batch") + 1]),
        "micro_batches": int(cmd[i("--micro-batches") + 1]) if "--micro-batches" in cmd else 1,
        "activation_checkpointing": "--activation-checkpointing" in cmd,
        "overrides": [a for a in cmd if "=" in a]}
    child.cmds.append(cmd)
    return subprocess.CompletedProcess(cmd, 0, json.dumps(row) + "\n", "")


def test_the_table_passes_micro_batches_and_overrides_to_every_row_and_caches_by_them(tmp_path, monkeypatch,
                                                                                       capsys):
    """--table ignored --micro-batches and the overrides (rows said micro_batches 1, overrides []), and its cache
    key left them out: an HSDP grid reused the FSDP rows of the same --results."""
    child.cmds = []
    monkeypatch.setattr(em.subprocess, "run", child)
    results = str(tmp_path / "rows.jsonl")
    grid = ["--table", "--presets", "dit_xs", "--optimizers", "adamw", "muon", "--world-sizes", "8", "16",
            "--results", results]
    assert em.main(grid) == 0  # plain FSDP, one forward of 1024 / W
    assert [(c[c.index("--world-size") + 1], c[c.index("--micro-batch") + 1]) for c in child.cmds] == [
        ("8", "128")] * 2 + [("16", "64")] * 2
    child.cmds = []
    assert em.main([*grid, "parallel.replicate=4"]) == 0  # the same batches, HSDP
    assert len(child.cmds) == 4 and all(c[-1] == "parallel.replicate=4" for c in child.cmds)  # no FSDP row reused
    child.cmds = []
    assert em.main([*grid, "--micro-batches", "4", "parallel.replicate=4"]) == 0
    assert len(child.cmds) == 4
    for c in child.cmds:
        w = int(c[c.index("--world-size") + 1])
        assert c[c.index("--micro-batch") + 1] == str(1024 // w // 4) and c[c.index("--micro-batches") + 1] == "4"
        assert c[-1] == "parallel.replicate=4"
    rows = [json.loads(line) for line in open(results)]
    assert len(rows) == 12 and sum(r["overrides"] == ["parallel.replicate=4"] for r in rows) == 8
    child.cmds = []
    assert em.main([*grid, "--micro-batches", "4", "parallel.replicate=4"]) == 0
    assert child.cmds == []  # the same grid again: every row from --results
    table = capsys.readouterr().out
    assert "| dit_xs parallel.replicate=4 | 8 | adamw | 32 x 4 |" in table


def not_fitting(micro_batch: int, micro_batches: int = 1, checkpointing: bool = False) -> dict:
    """Persistent 10 GiB, gradients and gathered weights 1 GiB each at peak, 1 GiB per image of the micro-batch:
    74.5 GiB leave room for 62 images per forward."""
    r = fake_result(peak_gib=12 + micro_batch, persistent_gib=10)
    r["peak"] |= {"gradients": GIB, "gathered_and_comm": GIB}
    return r | {"preset": "dit_xs", "optimizer": "adamw", "world_size": 8, "micro_batch": micro_batch,
                "micro_batches": micro_batches, "activation_checkpointing": checkpointing, "overrides": []}


def test_an_estimate_that_does_not_fit_says_what_would():
    """The largest divisor of the rank's 128 images that fits (62 fit) keeps the global batch: 4 forwards of 32."""
    out = em.describe(not_fitting(128)).splitlines()
    assert "does not fit" in out[-2]
    assert out[-1] == ("to fit: about 62 images per forward fit: --micro-batches 4 (train.micro_batch_size=32) keeps "
                       "the global batch; or --activation-checkpointing; or more GPUs (the 10.0 GiB persistent state "
                       "is sharded over W)")
    # already 2 forwards of 64 images: the same 128 per rank
    assert "--micro-batches 4 (train.micro_batch_size=32)" in em.describe(not_fitting(64, 2)).splitlines()[-1]
    assert "--activation-checkpointing" not in em.describe(not_fitting(128, checkpointing=True))


def test_an_estimate_that_fits_gives_no_advice():
    assert "to fit" not in em.describe(not_fitting(60))


def test_each_help_says_which_batch_it_assumes(capsys):
    """dit-memory-formula defaults to 32 images per GPU, dit-estimate-memory to the study's 1024 / W: each says so."""
    for main in (em.main, memory_formula.main):
        with pytest.raises(SystemExit):
            main(["--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert "32 images per GPU" in text and "1024 / W" in text, main.__module__
