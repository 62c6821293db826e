"""benchmarks/calibration_round.py, shortened (--tiny: the committed profile copied, the benchmarks on a tiny model):
every round's three files saved in its folder, one table with a column per round, the range and the count within
+-25% per round; bad arguments are one-line errors before anything is written. The rounds run as the real command (a
process whose stages are processes); the refusals, which are argparse's exit 2 before any stage, run its main() in
this process (run_entry_in_process: the same exit code and stderr, without ~3.5 s of a new interpreter importing
torch each)."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys

import pytest

from conftest import ROOT, run_entry_in_process

PROFILE = os.path.join(ROOT, "docs", "cost_model", "idle_host_profile_1634.json")


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "benchmarks.calibration_round", *args], capture_output=True,
                          text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})


def refuse(*args: str):
    """calibration_round's main() with `args` in this process, as `python -m benchmarks.calibration_round` runs it."""
    from benchmarks import calibration_round

    return run_entry_in_process(calibration_round.main, *args, prog="calibration_round.py")


def test_two_tiny_rounds_give_one_table_with_a_column_per_round(tmp_path):
    out = tmp_path / "rounds"
    proc = run("--rounds", "2", "--out", str(out), "--tiny", "--profile-from", PROFILE)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for i in (1, 2):
        assert sorted(os.listdir(out / f"round_{i}")) == ["bench_distributed.txt", "bench_optimizer.txt",
                                                          "host_profile.json"]
        assert "### 2 process(es)" in (out / f"round_{i}" / "bench_distributed.txt").read_text()
    lines = proc.stdout.splitlines()
    assert lines[0] == "| benchmark | processes | line | round 1 | round 2 | range |"
    rows = {tuple(c.strip() for c in line.split("|")[1:4]): line for line in lines[2:] if line.startswith("| bench")}
    assert ("bench_distributed", "2", "rownorm") in rows and ("bench_optimizer", "1", "muon") in rows
    for line in rows.values():  # two ratios and their range
        r1, r2, span = (c.strip() for c in line.split("|")[4:7])
        assert span == f"{min(float(r1), float(r2)):.2f}-{max(float(r1), float(r2)):.2f}"
    assert lines[-1].startswith("within +-25%: round 1: ") and f"of {len(rows)}" in lines[-1]
    assert (out / "table.md").read_text().strip() == proc.stdout.strip()
    assert "expected ~" in proc.stderr and "round 2: bench_optimizer done" in proc.stderr


@pytest.mark.parametrize("args, message", [(["--rounds", "0"], "--rounds 0"),
                                           (["--tiny"], "--tiny and --profile-from go together"),
                                           (["--tiny", "--profile-from", "nope.json"], "nope.json does not exist")])
def test_bad_arguments_are_one_line_errors_and_write_nothing(tmp_path, args, message):
    out = tmp_path / "rounds"
    proc = refuse("--out", str(out), *args)
    assert proc.returncode == 2 and message in proc.stderr and not out.exists()
    assert len([line for line in proc.stderr.splitlines() if "error" in line]) == 1


def test_an_existing_out_folder_is_refused(tmp_path):
    proc = refuse("--out", str(tmp_path))
    assert proc.returncode == 2 and "exists" in proc.stderr


def test_a_full_rounds_commands_are_the_docs_and_their_programs_accept_them(monkeypatch):
    from types import SimpleNamespace

    from benchmarks import bench_distributed, bench_optimizer, calibration_round
    from benchmarks.cost_model import cli

    stages = dict(calibration_round.stages(SimpleNamespace(tiny=False), "round_1"))
    assert cli.parse(stages["measure-host"][3:]).measure_host
    assert bench_distributed.parse(stages["bench_distributed"][3:]).nproc == [2, 4]
    monkeypatch.setattr(sys, "argv", ["bench_optimizer", *stages["bench_optimizer"][3:]])
    assert bench_optimizer.parse().quick
    text = open(os.path.join(ROOT, "docs", "cost_model.md")).read().replace("\\\n", " ")
    documented = [shlex.split(line.strip()) for line in text.splitlines() if line.startswith("    python -m ")]
    for stage in ("bench_distributed", "bench_optimizer"):
        assert ["python", *stages[stage][1:]] in documented, stage


def test_each_stage_is_announced_as_the_command_it_runs(tmp_path, monkeypatch, capsys):
    """The announced command names --out's folder (any name: a space, `=`, a quote) and the contender names with
    spaces ("periodic_rowwise K=3 gather"): pasted after `python`, it is the stage's own argv."""
    from types import SimpleNamespace

    from benchmarks import calibration_round

    ran = []
    monkeypatch.setattr(calibration_round.subprocess, "run",
                        lambda cmd, **kw: ran.append(cmd) or SimpleNamespace(returncode=0))
    args = SimpleNamespace(tiny=False, out=str(tmp_path / "rounds a=1,b it's ü"))
    os.makedirs(args.out)
    calibration_round.run_round(args, 1)
    announced = [line.split("): ", 1)[1] for line in capsys.readouterr().err.splitlines() if " min idle): " in line]
    assert [shlex.split(a) for a in announced] == [cmd[1:] for cmd in ran] and len(ran) == 3
