"""benchmarks/gpu_check.sh: every stage in its own process under its own timeout, each stage's JSON line written as it
finishes (a killed, crashed or raising stage is a FAIL line and the others stay), the GPU plan under 9 minutes by
construction, and the CPU smoke test of every stage passing.

test_cpu_smoke_runs_every_stage_and_each_passes is the slow one: all ten stages and six memory estimates, each in
its own process, a cold CPU compile among them; 244-340 s measured on this 2-core host shared with four other jobs
(load ~10). The others take seconds."""

import json
import os
import subprocess

import pytest

from conftest import ROOT
from dit_train.optim.registry import OPTIMIZERS
from benchmarks import gpu_check, gpu_check_table

SCRIPT = os.path.join(ROOT, "benchmarks", "gpu_check.sh")
STAGES = [s[0] for s in gpu_check.STAGES]


def run_script(*args, timeout=3600):
    env = {**os.environ, "PYTHONPATH": ROOT}
    return subprocess.run(["bash", SCRIPT, *args], capture_output=True, text=True, env=env, timeout=timeout)


def lines(results_dir) -> list[dict]:
    with open(os.path.join(results_dir, "results.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_the_gpu_plan_fits_nine_minutes_and_compile_is_not_last():
    total = gpu_check.SETUP_S + sum(gpu_s + gpu_check.KILL_GRACE_S for _, gpu_s, _, _ in gpu_check.STAGES)
    assert total <= gpu_check.GPU_BUDGET_S == 540
    assert STAGES.index("dit1b3_compile_ac") < len(STAGES) - 1
    assert STAGES[:2] == ["env", "ns5"]  # what decides the most first
    from benchmarks import gpu_check_stages

    assert set(gpu_check_stages.STAGE_FUNCTIONS) == set(STAGES)
    # every stage comparing a peak with the estimate has one started for it, of its own configuration
    jobs = gpu_check.estimate_jobs(smoke=False)
    assert jobs["dit15b_w8_ac"][:8] == ["--preset", "dit_15b", "--world-size", "8", "--optimizer",
                                        "periodic_rowwise", "--micro-batch", "128"]
    assert "--activation-checkpointing" in jobs["dit15b_w8_ac"]
    assert "--activation-checkpointing" not in jobs["dit15b_w8"]


def test_cpu_smoke_runs_every_stage_and_each_passes(tmp_path):
    res = tmp_path / "results"
    proc = run_script("--cpu-smoke", "--results", str(res))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    rows = {r["stage"]: r for r in lines(res)}
    assert list(rows) == STAGES
    assert all(r["ok"] for r in rows.values()), {k: r.get("error") for k, r in rows.items() if not r["ok"]}
    table = (res / "gpu_check.md").read_text()
    assert table.startswith(gpu_check_table.BEGIN) and f"{len(STAGES)} of {len(STAGES)} stages passed" in table
    assert table.split(gpu_check_table.BEGIN)[1].split(gpu_check_table.END)[0].strip() in proc.stdout
    # what each stage measured, next to what it is held against
    checks = {(r["stage"], c["what"]): c for r in rows.values() for c in r["checks"]}
    assert checks[("env", "SDPA kernel at head dim 128 (forward + backward)")]["measured"] == "flash (CPU)"
    assert checks[("checkpoint", "model, optimizer and EMA tensors after resume")]["ok"] is True
    assert checks[("checkpoint", "model, optimizer and EMA tensors after those steps")]["ok"] is True
    assert any(k[0] == "dit1b3_compile_ac" and k[1].startswith("first loss vs eager") and c["ok"]
               for k, c in checks.items())
    # the estimate of every stage's own configuration ran; one still running at the stage's end is judged in the table
    estimates = [line for line in table.splitlines() if "| memory estimate of this configuration |" in line]
    assert len(estimates) == 6 and all(" GiB | it ran" in line and line.endswith("| ok |") for line in estimates)
    # the predictions were counted in the background, one per stage that compares a step time with one
    counted = gpu_check_table.json_lines(str(res / gpu_check_table.PREDICTIONS))
    assert [row["stage"] for row in counted] == [*gpu_check.SHARD_RUNS, "dit1b3_eager", "dit1b3_compile_ac"]
    optimizers = [c["what"] for c in rows["optimizers"]["checks"]]
    assert len(optimizers) == 13 and all(c["ok"] for c in rows["optimizers"]["checks"])
    assert {w.split(",")[0].split(" (")[0] for w in optimizers} == set(OPTIMIZERS)


def test_a_killed_stage_is_a_fail_line_and_the_next_stage_still_runs(tmp_path):
    """--timeout-scale 0.002: env is killed after 0.04 s (before it could import torch), ns5 likewise; each gets
    its FAIL line from the script, the table has both, the exit status is 1."""
    res = tmp_path / "results"
    proc = run_script("--cpu-smoke", "--only", "env,ns5", "--timeout-scale", "0.0002", "--results", str(res),
                      timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    rows = lines(res)
    assert [r["stage"] for r in rows] == ["env", "ns5"]
    assert all(not r["ok"] and r["error"].startswith("killed by its 0.048 s timeout") for r in rows), rows
    assert "0 of 2 stages passed" in proc.stdout and "env: FAIL" in proc.stdout


STUCK_STAGE = """
import sys, time
from benchmarks import gpu_check, gpu_check_stages


def stage(ctx):
    from dit_train.optim import fused_rownorm  # the imports are the stage's, inside its timeout, as in the check's

    ctx.phase("step 2 (the first RowNorm step: compiles its kernels)")
    fused_rownorm._kernel = lambda *a: (lambda *b: time.sleep(60))  # as a compile that outlives the timeout
    g = fused_rownorm.torch.ones(2, 2)
    fused_rownorm.momentum_pass([g], [g], g[None], 0.9, True, False, False)


gpu_check_stages.STAGE_FUNCTIONS["ns5"] = stage
gpu_check.run_stage("ns5", sys.argv[1], float(sys.argv[2]), smoke=True, started=gpu_check.STARTED)
"""


def test_a_stage_killed_by_its_timeout_is_said_to_be_where_it_was(tmp_path):
    """The first GPU run's stages printed only warnings before `timeout` killed them, so the table could not say
    where their time went. Now a stage's phase lines and the Python stack written just before the kill name it:
    the last phase, the innermost frame of our code, and the innermost frame of all."""
    script = tmp_path / "stuck.py"
    script.write_text(STUCK_STAGE)
    log = tmp_path / "ns5.log"
    timeout_s = 12
    with open(log, "w") as out:
        rc = subprocess.run(["timeout", "-k", "2", str(timeout_s), "python", str(script), str(tmp_path),
                             str(timeout_s)], stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": ROOT}, timeout=120).returncode
    assert rc == 124, log.read_text()
    row = gpu_check_table.ensure(str(tmp_path), "ns5", rc, timeout_s, str(log))
    error = row["error"]
    assert error.startswith(f"killed by its {timeout_s} s timeout (a hang, or fixed costs over the budget); in its "
                            "phase +"), error
    assert "s] step 2 (the first RowNorm step: compiles its kernels); at dit_train/optim/fused_rownorm.py:" in error
    assert "(momentum_pass); innermost " in error and "stuck.py:" in error and "(<lambda>)" in error


def test_a_raising_stage_writes_its_fail_line(tmp_path, monkeypatch):
    from benchmarks import gpu_check_stages

    def boom(ctx):
        raise MemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore text")

    monkeypatch.setitem(gpu_check_stages.STAGE_FUNCTIONS, "ns5", boom)
    assert gpu_check.run_stage("ns5", str(tmp_path), 10, smoke=True) == 1
    (row,) = lines(tmp_path)
    assert row["stage"] == "ns5" and not row["ok"]
    assert row["error"] == "MemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"


def write_estimate(folder, stage, rc, peak_bytes=None, log=""):
    base = os.path.join(folder, f"estimate_{stage}")
    with open(base + ".json", "w") as f:
        f.write(json.dumps({"peak": {"total": peak_bytes}}) + "\n" if peak_bytes else "")
    with open(base + ".log", "w") as f:
        f.write(log)
    with open(base + ".rc", "w") as f:
        f.write(f"{rc}\n")


def test_a_pending_peak_is_judged_against_the_estimate_when_the_table_is_made(tmp_path):
    memory = {"allocated_gib": 90.0, "reserved_gib": 96.0, "device_gib": 139.8}
    row = {"stage": "dit15b_w8", "ok": True, "values": {"memory": memory},
           "checks": [gpu_check_table.memory_check(str(tmp_path), "dit15b_w8", memory)]}
    assert row["checks"][0]["ok"] is None and row["checks"][0]["pending"]  # the estimate is still running
    write_estimate(tmp_path, "dit15b_w8", 0, peak_bytes=100 * gpu_check_table.GIB)
    settled = gpu_check_table.settle(str(tmp_path), json.loads(json.dumps(row)))
    assert settled["ok"] and settled["checks"][0]["measured"].startswith("90.0 / 100.0 GiB = 0.90; reserved 96.0")
    write_estimate(tmp_path, "dit15b_w8", 0, peak_bytes=50 * gpu_check_table.GIB)  # 1.8 x the estimate
    assert not gpu_check_table.settle(str(tmp_path), json.loads(json.dumps(row)))["ok"]
    write_estimate(tmp_path, "dit15b_w8", 1, log="Traceback ...\nValueError: the estimate is for FSDP2 runs\n")
    failed = gpu_check_table.settle(str(tmp_path), json.loads(json.dumps(row)))
    assert not failed["ok"] and failed["checks"][0]["measured"] == (
        "the estimate exited with status 1: ValueError: the estimate is for FSDP2 runs")


def test_a_torn_results_line_is_skipped_and_the_table_keeps_the_text_around_it(tmp_path):
    row = {"stage": "env", "ok": True, "seconds": 3.0, "values": {"device": "NVIDIA H200", "torch": "2.13"},
           "checks": [{"what": "w", "measured": "m | x", "expected": "e", "ok": True}]}
    with open(tmp_path / "results.jsonl", "w") as f:
        f.write(json.dumps(row) + "\n" + '{"stage": "ns5", "ok": tr')  # killed mid-write
    doc = tmp_path / "gpu_check.md"
    doc.write_text(f"# intro\n\n{gpu_check_table.BEGIN}\nold table\n{gpu_check_table.END}\n\n## after\n")
    rc = gpu_check_table.main(["--results", str(tmp_path), "--render", "--planned", "env,ns5", "--out", str(doc)])
    text = doc.read_text()
    assert rc == 1 and text.startswith("# intro\n\n" + gpu_check_table.BEGIN) and text.endswith("## after\n")
    assert "old table" not in text and "| ns5 | not run |" in text and "| env | PASS | 3 |" in text
    assert "m / x" in text and "NVIDIA H200" in text and "1 of 2 stages passed" in text
    # the line written for the stage that was killed while writing starts a line of its own
    gpu_check_table.ensure(str(tmp_path), "ns5", 137, 20, None)
    assert gpu_check_table.read_results(str(tmp_path))["ns5"]["error"].startswith("killed by its 20 s timeout")


@pytest.mark.parametrize("args, message", [
    (["--bogus"], "unknown argument '--bogus'"),
    (["--only", "env,nope"], "--only nope is not a stage"),
    (["--timeout-scale", "-1"], "--timeout-scale '-1' is not valid"),
])
def test_bad_arguments_are_one_line_errors_before_anything_runs(tmp_path, args, message):
    proc = run_script("--cpu-smoke", "--results", str(tmp_path / "r"), *args, timeout=120)
    assert proc.returncode == 2 and message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "r" / "results.jsonl").exists()


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_prints_the_usage_and_runs_nothing(tmp_path, flag):
    """`--help` was "unknown argument '--help'", exit 2."""
    proc = run_script(flag, "--results", str(tmp_path / "r"), timeout=60)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert proc.stdout.startswith("usage: bash benchmarks/gpu_check.sh [--cpu-smoke] [--only STAGES]")
    assert "Needs a visible CUDA device (or --cpu-smoke)" in proc.stdout
    listed = proc.stdout.split("stages (timeout in s, on a GPU):\n")[1].split()
    assert listed[::2] == STAGES  # every stage, from gpu_check.STAGES itself
    assert not (tmp_path / "r").exists()


def test_a_results_folder_is_never_appended_to(tmp_path):
    (tmp_path / "results.jsonl").write_text("{}\n")
    proc = run_script("--cpu-smoke", "--results", str(tmp_path), timeout=120)
    assert proc.returncode == 2 and "already holds a results.jsonl" in proc.stderr
    assert (tmp_path / "results.jsonl").read_text() == "{}\n"


def test_a_python_without_the_trainer_is_refused_in_one_line(tmp_path):
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho 'Traceback ...' >&2\necho \"ModuleNotFoundError: No module named 'hydra'\" >&2\n"
                    "exit 1\n")
    fake.chmod(0o755)
    env = {**os.environ, "PYTHON": str(fake)}
    proc = subprocess.run(["bash", SCRIPT, "--cpu-smoke", "--results", str(tmp_path / "r")], capture_output=True,
                          text=True, env=env, timeout=60)
    assert proc.returncode == 2 and proc.stderr == (
        f"gpu_check.sh: {fake} cannot import the trainer: ModuleNotFoundError: No module named 'hydra'; install what "
        "it names first (scripts/setup.sh keeps an installed torch)\n")
    assert not (tmp_path / "r").exists()


def test_host_syncs_are_counted_where_the_repository_made_them():
    """The dit_15b stages' sync count: each 'synchronizing CUDA operation' warning (what set_sync_debug_mode('warn')
    issues on CUDA) is one sync, located at this repository's innermost frame; other warnings pass through."""
    import warnings

    from benchmarks import gpu_check_stages

    sink = []
    with pytest.warns(UserWarning):
        with gpu_check_stages.sync_warnings(sink):
            for _ in range(2):
                warnings.warn("called a synchronizing CUDA operation", UserWarning)  # the line counted
            warnings.warn("something else", UserWarning)
            # setting the mode warns that it is a prototype: not a sync (the GPU runs counted it as one)
            warnings.warn("Synchronization debug mode is a prototype feature and does not yet detect all "
                          "synchronizing operations", UserWarning)
    assert len(sink) == 2 and sink[0] == sink[1] and sink[0].startswith("tests/integration/test_gpu_check.py:")


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a host without a visible GPU")
def test_without_a_gpu_the_check_says_so_in_one_line_before_anything_runs(tmp_path):
    proc = run_script("--results", str(tmp_path / "r"), timeout=120)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert "no CUDA device is visible" in proc.stderr and "--cpu-smoke" in proc.stderr
    assert not (tmp_path / "r").exists()


def test_the_trainer_stages_run_in_a_work_folder_of_any_name(tmp_path):
    """--work-dir is made under $TMPDIR, a path of the user's: written unescaped into run_dir=... (and the
    checkpoint stage's train.resume=...), a folder with `=`, `,` or a quote was a Hydra syntax error."""
    from types import SimpleNamespace

    from benchmarks import gpu_check_stages

    work = str(tmp_path / "t a=1,b it's ü")
    checkpoint = os.path.join(work, "checkpoint", "checkpoints", "step_00000002.dcp")
    cfg = gpu_check_stages.trainer_config(SimpleNamespace(smoke=True, work_dir=work), "checkpoint",
                                          extra=[gpu_check_stages.override("train.resume", checkpoint)])
    assert cfg.run_dir == os.path.join(work, "checkpoint") and cfg.train.resume == checkpoint


@pytest.mark.parametrize("smoke", [False, True])
@pytest.mark.parametrize("stage", ["dit1b3_eager", "dit1b3_compile_ac"])
def test_the_trainer_stages_are_compared_with_the_estimate_of_their_own_configuration(stage, smoke, tmp_path):
    """The estimate (dit-estimate-memory, the scaling study's config) and the trainer stage's config agree on
    everything the peak depends on."""
    from types import SimpleNamespace

    from dit_train.parallel import memory_estimate_cli as estimate_memory
    from benchmarks import gpu_check_stages

    args = gpu_check.estimate_jobs(smoke)[stage]
    flags = {a: args[i + 1] for i, a in enumerate(args) if a in ("--preset", "--world-size", "--optimizer",
                                                                  "--micro-batch")}
    overrides = [a for a in args if "=" in a]
    estimated = estimate_memory.compose(flags["--preset"], flags["--optimizer"], "--activation-checkpointing" in args,
                                        overrides)
    ctx = SimpleNamespace(smoke=smoke, work_dir=str(tmp_path))
    compiled = stage == "dit1b3_compile_ac"
    run = gpu_check_stages.trainer_config(ctx, stage, checkpointing=compiled, compiled=compiled)
    assert run.model == estimated.model and run.optimizer == estimated.optimizer
    for key in ("fsdp", "mixed_precision", "reduce_dtype", "reshard_after_forward", "replicate",
                "activation_checkpointing"):
        assert run.parallel[key] == estimated.parallel[key], key
    for key in ("precision", "grad_clip", "ema_decay", "micro_batch_size"):
        assert run.train[key] == estimated.train[key], key
    assert run.train.batch_size == int(flags["--micro-batch"]) and flags["--world-size"] == "1"


@pytest.mark.parametrize("stage", ["dit1b3_eager", "dit1b3_compile_ac"])
def test_the_trainer_stages_count_their_prediction_before_their_steps(stage, tmp_path, monkeypatch):
    """The cost model's prediction counts a step on fake tensors on the CPU: on a GPU (a device with a cost-model
    profile; on CPU it returns at once) that takes seconds, so it runs before the steps, in the part of the stage its
    deadline sizes. After the steps, only the margin for writing the line is left (Context.deadline: 10 s of a 70 s
    timeout), and a stage killed there loses every step it took."""
    import contextlib
    from types import SimpleNamespace

    import torch

    from benchmarks import gpu_check_stages

    events = []

    def predict(*args, **kwargs):
        events.append("prediction")
        return "cost model (test)"

    def steps(trainer, n, ctx=None, min_steps=2):
        events.append("steps")
        return [({"train/loss": 1.0, "train/skipped": 0.0, "train/grad_norm": 1.0}, 0.1) for _ in range(n)]

    monkeypatch.setattr(gpu_check_stages, "describe_prediction", predict)
    monkeypatch.setattr(gpu_check_stages, "run_steps", steps)
    monkeypatch.setattr(gpu_check_stages, "built_trainer", lambda cfg, dist: contextlib.nullcontext(None))
    monkeypatch.setattr(gpu_check_stages, "trainer_dist", lambda ctx: SimpleNamespace(device=torch.device("cpu")))
    ctx = gpu_check.Context(stage, str(tmp_path), 300, smoke=True, work_dir=str(tmp_path))
    row = gpu_check_stages.STAGE_FUNCTIONS[stage](ctx)
    assert events == ["prediction", "steps"]
    assert any(c["expected"] == "reported; cost model (test)" for c in row["checks"])


STAGE_WITH_LEFT = """
import json, sys
from benchmarks import gpu_check, gpu_check_stages

allowed = int(sys.argv[2])


class Timed(gpu_check.Context):
    calls = 0

    def left(self):  # time for `allowed` more steps, then none
        Timed.calls += 1
        return 1e9 if Timed.calls <= allowed else -1.0


ctx = Timed(sys.argv[1], sys.argv[3], 300, smoke=True, work_dir=sys.argv[3])
row = gpu_check_stages.stage_dit15b(ctx)
print(json.dumps({"step_s": row["values"]["step_s"], "notes": ctx.notes, "checks": row["checks"]}))
"""


@pytest.mark.parametrize("allowed", [0, 1])
def test_a_dit15b_stage_takes_only_the_timed_steps_its_deadline_leaves_and_says_how_many(allowed, tmp_path):
    """The dit_15b stages check, before every timed step, the first one too, that another fits before the deadline:
    on a GPU dit15b_w8_ac's steps of 128 images take seconds each, and a timed step taken past the deadline has the
    stage killed by its timeout with its measured peak unwritten. The note names the timed steps actually taken
    (it said one more). With none, the row still holds the memory check and the first RowNorm step."""
    env = {**os.environ, "PYTHONPATH": ROOT}
    proc = subprocess.run(["python", "-c", STAGE_WITH_LEFT, "dit15b_w8_ac", str(allowed), str(tmp_path)],
                          capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(out["step_s"]) == allowed
    assert out["notes"] == [f"took {allowed} of 3 timed steps: the stage's time was spent"]
    whats = [c["what"] for c in out["checks"]]
    assert "memory estimate of this configuration" in whats
    assert "first RowNorm step (its passes compile on CUDA, once per process)" in whats
    assert all(c["ok"] is not False for c in out["checks"])


KILLED_AT_MUON = """
import os, signal, sys
from benchmarks import gpu_check
from dit_train.optim import registry

build = registry.build_optimizer


def killed_at_muon(model, cfg):  # as `timeout` kills a stage mid-way (a cold compile past its budget)
    if cfg["name"] == "muon":
        os.kill(os.getpid(), signal.SIGKILL)
    return build(model, cfg)


registry.build_optimizer = killed_at_muon
gpu_check.run_stage("optimizers", sys.argv[1], 300.0, smoke=True, work_dir=sys.argv[1])
"""


def test_a_stage_killed_mid_way_keeps_the_checks_it_had_finished(tmp_path):
    """The first GPU run's optimizers stage was killed by its timeout and its line had no check at all, though
    some optimizers may have run. A stage's checks are recorded as they are made (Context.record), and the line
    written for a killed stage holds them; it still fails (it did not finish)."""
    log = tmp_path / "optimizers.log"
    with open(log, "w") as out:
        rc = subprocess.run(["python", "-c", KILLED_AT_MUON, str(tmp_path)], stdout=out, stderr=subprocess.STDOUT,
                            cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT}, timeout=600).returncode
    assert rc == -9, log.read_text()[-2000:]
    row = gpu_check_table.ensure(str(tmp_path), "optimizers", 137, 50, str(log))
    assert not row["ok"] and row["error"].startswith("killed by its 50 s timeout")
    assert [c["what"] for c in row["checks"]] == ["adamw, one process"]
    assert row["checks"][0]["ok"] is True and "weights finite" in row["checks"][0]["measured"]
    assert lines(tmp_path) == [row]  # the line written, as the table reads it


NO_COUNTING = """
import sys
from benchmarks import gpu_check, gpu_check_stages


def counted(*args, **kwargs):
    raise RuntimeError("the cost model counted again")


gpu_check_stages.describe_prediction = counted
sys.exit(gpu_check.run_stage(sys.argv[1], sys.argv[2], 300.0, smoke=True, work_dir=sys.argv[2]))
"""


def test_a_stage_records_the_prediction_it_counted_and_checkpointing_is_among_its_arguments(tmp_path):
    """A stage that finds no prediction counted for its arguments counts it and appends it to predictions.jsonl
    (what the table and a later stage read). Activation checkpointing is among the arguments: the H200 profile
    prices its recomputed forward (cost_model/compute.py), so an `_ac` stage no longer takes its plain twin's."""
    from types import SimpleNamespace

    from benchmarks import gpu_check_stages as stages
    from benchmarks.cost_model.predict import describe_prediction

    env = {**os.environ, "PYTHONPATH": ROOT}
    first = subprocess.run(["python", "-m", "benchmarks.gpu_check", "--stage", "dit15b_w32", "--results", str(tmp_path),
                            "--cpu-smoke", "--work-dir", str(tmp_path)], capture_output=True, text=True, env=env,
                           cwd=ROOT, timeout=600)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    counted = gpu_check_table.json_lines(str(tmp_path / gpu_check_table.PREDICTIONS))
    assert [(r["stage"], r["by"]) for r in counted] == [("dit15b_w32", "the dit15b_w32 stage")]
    assert {r["stage"]: r for r in lines(tmp_path)}["dit15b_w32"]["values"]["prediction"] == {
        "key": counted[0]["key"], "text": counted[0]["text"]}
    plain, ac = (stages.prediction_inputs(SimpleNamespace(name=n, smoke=True, work_dir=str(tmp_path)))
                 for n in ("dit15b_w32", "dit15b_w32_ac"))
    assert stages.prediction_key(plain[0], *plain[1:3], "NVIDIA H200", False) != stages.prediction_key(
        ac[0], *ac[1:3], "NVIDIA H200", False)
    texts = {flag: describe_prediction(ac[0].model, ac[0].optimizer, 32, 2, "NVIDIA H200", network=False,
                                       activation_checkpointing=flag) for flag in (False, True)}
    assert texts[False] != texts[True], texts


def test_the_background_job_counts_the_predictions_and_the_stages_take_them(tmp_path):
    """gpu_check.sh counts the stages' predictions in one background process on the CPU (no CUDA device visible to
    it) while the GPU runs the stages before them: a stage whose prediction is there takes it instead of spending
    seconds of its timeout counting it (each dit_15b stage counted its own before: 2-8 s of CPU each)."""
    env = {**os.environ, "PYTHONPATH": ROOT, "CUDA_VISIBLE_DEVICES": ""}
    job = subprocess.run(["python", "-m", "benchmarks.gpu_check", "--predictions", "--device-name", "CPU", "--results",
                          str(tmp_path), "--cpu-smoke", "--only", "env,dit15b_w32,dit15b_w32_ac,dit15b_w8"],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert job.returncode == 0, job.stderr[-2000:]
    counted = gpu_check_table.json_lines(str(tmp_path / gpu_check_table.PREDICTIONS))
    # one per stage that compares a step time with one (the _ac stage's arguments differ), none for env
    assert [row["stage"] for row in counted] == ["dit15b_w32", "dit15b_w32_ac", "dit15b_w8"]
    assert {row["by"] for row in counted} == {"the background job"}
    stage = subprocess.run(["python", "-c", NO_COUNTING, "dit15b_w8", str(tmp_path)], capture_output=True, text=True,
                           env=env, cwd=ROOT, timeout=600)
    row = {r["stage"]: r for r in lines(tmp_path)}["dit15b_w8"]
    assert stage.returncode == 0, row.get("error")
    assert "the cost model's prediction: counted by the background job" in stage.stdout
    assert row["values"]["prediction"] == {"key": counted[2]["key"], "text": counted[2]["text"]}
    missing = subprocess.run(["python", "-m", "benchmarks.gpu_check", "--predictions", "--results", str(tmp_path)],
                             capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert missing.returncode == 2 and "--predictions needs --results FOLDER and --device-name NAME" in missing.stderr


def test_a_host_sync_with_no_frame_of_ours_names_its_thread_and_callers():
    """A sync made where no frame of this repository is on the stack (a thread of torch's, as the first GPU runs'
    one unplaced sync at torch/cuda/__init__.py in the AC stages): the line names the thread and the innermost
    frames, not only torch's line (which said nothing about who called it)."""
    import threading

    from benchmarks import gpu_check_stages

    namespace = {}  # a thread whose every frame is outside the repository (torch's file names)
    exec(compile("import warnings\ndef run():\n    warnings.warn('called a synchronizing CUDA operation', "
                 "UserWarning)\n", "/opt/site-packages/torch/cuda/__init__.py", "exec"), namespace)
    sink = []
    with gpu_check_stages.sync_warnings(sink):
        worker = threading.Thread(target=namespace["run"], name="autograd-engine")
        worker.start()
        worker.join()
    assert len(sink) == 1, sink
    assert sink[0].startswith("/opt/site-packages/torch/cuda/__init__.py:3 (thread autograd-engine: "), sink[0]
    assert "__init__.py:3 run" in sink[0] and "threading.py" in sink[0], sink[0]


def test_on_a_machine_with_an_out_folder_it_leaves_three_files_there(tmp_path):
    """A lent GPU machine copies back at most 8 files of $OUT: the third H200 run wrote its results folder there and
    lost its results.jsonl. Without --results, $OUT gets results.jsonl (after each stage), the table and a tar of
    the results folder, and nothing else."""
    import tarfile

    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "PYTHONPATH": ROOT, "OUT": str(out)}
    proc = subprocess.run(["bash", SCRIPT, "--cpu-smoke", "--only", "env"], capture_output=True, text=True, env=env,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.md", "gpu_check_results.tgz", "results.jsonl"]
    assert [r["stage"] for r in lines(out)] == ["env"]
    with tarfile.open(out / "gpu_check_results.tgz") as tar:
        names = {os.path.basename(n) for n in tar.getnames()}
    assert {"results.jsonl", "env.log", "gpu_check.md"} <= names


@pytest.mark.parametrize("text, name", [
    ("NVIDIA H200, 143771 MiB, 570.124.06, 1980 MHz\nNVIDIA H200, 143771 MiB, 570.124.06, 1980 MHz\n", "NVIDIA H200"),
    ("timeout: failed to run command 'nvidia-smi': No such file or directory\n", ""),
    ("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. Make sure that the latest NVIDIA "
     "driver is installed and running.\n", ""),
    ("No devices were found\n", ""),
    ("", ""),
])
def test_the_background_predictions_take_the_gpu_name_only_from_a_line_nvidia_smi_printed_as_csv(text, name,
                                                                                                   tmp_path):
    """nvidia-smi absent or failing (a container without it, a driver it cannot reach) writes an error line to
    nvidia-smi.txt; its first comma-separated field was taken as the GPU's name, and the background job counted
    every prediction under "timeout: failed to run command 'nvidia-smi': No such file or directory" (the stages,
    keyed by torch's name, then each counted its own out of their timeouts). Only a CSV line of the query's four
    fields gives a name; otherwise nothing, and the script starts no background job."""
    smi = tmp_path / "nvidia-smi.txt"
    smi.write_text(text)
    got = subprocess.run(["python", "-m", "benchmarks.gpu_check", "--device-name-of", str(smi)], capture_output=True,
                         text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT}, timeout=120)
    assert got.returncode == 0 and got.stdout == f"{name}\n", got.stdout + got.stderr
    script = open(SCRIPT).read()
    assert 'DEVICE_NAME=$("$PY" -m benchmarks.gpu_check --device-name-of "$RESULTS/nvidia-smi.txt")' in script
