"""scripts/gpu_check.py: its CPU smoke test runs every stage of the GPU check (tiny model, fp32, gloo group of one)
and each passes; a stage that fails, hangs or finds no time left is a FAIL row and the table keeps the others."""

import os
import subprocess
import sys
import time

import pytest

from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "scripts"))

import gpu_check  # noqa: E402
from gpu_check_table import Row, markdown, run_stage  # noqa: E402

STAGES = ["gemm", "ns5 (bf16)", "train adamw", "train muon", "train periodic_rowwise", "train rownorm", "train mud",
          "checkpoint (DCP save + resume)", "compile + AC (adamw)"]
COLUMNS = ["stage", "result", "step ms", "TFLOP/s", "MFU", "peak GiB", "estimate GiB", "peak / estimate", "s",
           "detail"]


def table_rows(text: str) -> dict[str, dict[str, str]]:
    rows = [line.strip("|").split(" | ") for line in text.splitlines() if line.startswith("| ")]
    assert [c.strip() for c in rows[0]] == COLUMNS
    return {cells[0].strip(): dict(zip(COLUMNS, (c.strip() for c in cells))) for cells in rows[2:]}


def test_cpu_smoke_runs_every_stage_and_each_passes(tmp_path):
    out = tmp_path / "gpu_check.md"
    env = {**os.environ, "PYTHONPATH": ROOT}
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "gpu_check.py"), "--cpu-smoke",
                           "--out", str(out)], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = out.read_text()
    assert text in proc.stdout  # printed and written alike
    rows = table_rows(text)
    assert list(rows) == STAGES
    assert {name: row["result"] for name, row in rows.items()} == {name: "PASS" for name in STAGES}
    for name in STAGES[2:7] + STAGES[8:]:  # training stages: timed, MFU against the gemm row, an estimate
        assert float(rows[name]["step ms"]) > 0 and rows[name]["MFU"].endswith("%")
        assert float(rows[name]["estimate GiB"]) > 0
    assert "bit-identical" in rows["checkpoint (DCP save + resume)"]["detail"]
    assert "within" in rows["compile + AC (adamw)"]["detail"]
    assert f"{len(STAGES)} of {len(STAGES)} stages passed" in text


def test_a_failing_slow_or_late_stage_is_a_fail_row():
    cleaned = []
    cleanup = lambda: cleaned.append(True)  # noqa: E731
    far = time.monotonic() + 60

    def boom():
        raise torch_like_oom()

    def slow():
        time.sleep(5)
        return Row("slow", True)

    rows = [run_stage("ok", lambda: Row("ok", True, detail="fine"), 10, far, cleanup),
            run_stage("boom", boom, 10, far, cleanup),
            run_stage("slow", slow, 0.2, far, cleanup),
            run_stage("late", lambda: Row("late", True), 10, time.monotonic(), cleanup)]
    assert [r.ok for r in rows] == [True, False, False, False]
    assert rows[1].detail == "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
    assert rows[2].detail == "stopped: over its 0.2 s budget" and rows[2].seconds < 2
    assert rows[3].detail.startswith("not run")
    assert len(cleaned) == 3  # after every stage that ran, whatever happened
    text = markdown(rows, ["# header"])
    assert list(table_rows(text)) == ["ok", "boom", "slow", "late"]
    assert text.count("**FAIL**") == 3 and "1 of 4 stages passed" in text


class OutOfMemoryError(RuntimeError):
    pass


def torch_like_oom():
    return OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore text")


@pytest.mark.parametrize("argv,message", [
    (["--batch-size", "0"], "--batch-size=0 is not valid: it must be positive"),
    (["--checkpoint-optimizer", "sgd"], "invalid choice: 'sgd'"),
])
def test_bad_arguments_are_one_line_errors(argv, message, capsys):
    with pytest.raises(SystemExit):
        gpu_check.parse(argv)
    assert message in capsys.readouterr().err


def test_the_device_is_checked_before_anything_is_built(monkeypatch):
    import torch

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit, match="WORLD_SIZE=2 is not valid: the check runs as one process"):
        gpu_check.check_device(gpu_check.parse([]))
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="no CUDA device is visible .* or --cpu-smoke"):
        gpu_check.check_device(gpu_check.parse([]))
    gpu_check.check_device(gpu_check.parse(["--cpu-smoke"]))  # no GPU needed
