#!/usr/bin/env python
"""One stage of the GPU check (benchmarks/gpu_check.sh runs each in its own process under `timeout`, in the order of
STAGES; the stages are in gpu_check_stages.py, the table in gpu_check_table.py).

    python -m benchmarks.gpu_check --plan [--cpu-smoke] [--only env,ns5]   # "name<TAB>timeout s" per stage
    python -m benchmarks.gpu_check --estimates [--cpu-smoke]               # "key<TAB>dit-estimate-memory arguments"
    python -m benchmarks.gpu_check --predictions --device-name NAME --results DIR [--cpu-smoke]  # in the background
    python -m benchmarks.gpu_check --device-name-of DIR/nvidia-smi.txt     # the GPU's name, or an empty line
    python -m benchmarks.gpu_check --stage NAME --results DIR --timeout S [--cpu-smoke]

A stage appends one JSON line to DIR/results.jsonl when it finishes, whatever happened inside it (an exception is
its FAIL line); gpu_check.sh writes the line of a stage that was killed or died without one. A stage sizes its
work to its timeout (it stops taking steps before it), so the timeout only stops a hang.

This module imports neither torch nor the package at its top: --plan and --estimates answer at once.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import shutil
import sys
import tempfile
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# a stage's process started about now (this module is its entry point and imports nothing heavy): main() counts
# its deadline, phase times and stack dump from here, as `timeout` counts
STARTED = time.monotonic()

# (name, GPU timeout s, CPU smoke timeout s, what it checks), in the order they run: what decides the most first
# (env with room for a first CUDA initialisation, slow on a GPU without persistence mode), compile + activation
# checkpointing before the checkpoint. GPU: their sum, with a kill grace each and SETUP_S, is at most 9 minutes by
# construction (tests/integration/test_gpu_check.py). The GPU timeouts after the first H200 run (2026-12-04,
# docs/gpu_check.md): the four stages that finished (env 12 s, ns5 12 s, compile + AC 46 s, checkpoint 48 s) keep
# ~1.3-2x their time; the rest went to the six that were killed, each of which takes its first RowNorm step in a
# new process, where the RowNorm passes compile cold (optim/fused_rownorm.py; the finished compiled stage's first
# RowNorm step took 13.9 s against 0.2-0.3 s for the next ones). The passes now compile for chunks of at most 8
# matrices (fused_rownorm.MAX_MATRICES_PER_CALL: dit_15b's 50-matrix buckets compiled whole before), so a cold stage
# compiles two small variants per bucket shape. An ac stage follows its plain twin, whose finished compile it finds
# in inductor's on-disk cache (the same shard shapes). checkpoint's 8 blocks have dit1b3_eager's 8-matrix chunk, but
# it runs under deterministic algorithms, which are in inductor's FX-graph and AOTAutograd cache keys (and dynamo's
# global-state guard): its passes go through inductor again, only Triton's binaries (cached by kernel source) may be
# reused; the first run's 48 s was such a compile (docs/gpu_check.md says which stages compile cold). CPU smoke:
# only a hang's limit (a loaded 2-core host runs the stages 5x slower than an idle one; the compile stage is a cold
# inductor compile). Rebalanced after the second run (2026-12-04 17:40, docs/gpu_check.md): the first RowNorm step
# compiled cold for 29-35 s in each stage with new shapes (optimizers twice: one process, then rank 0 of 8; dit15b_w32,
# dit15b_w8, dit1b3_eager), 7-15 s warm; dit15b_w32 and dit15b_w8 were left no time for a timed step and optimizers
# was killed in its rank-0-of-8 compile; those three get the time the finished stages did not use.
STAGES = (
    ("env", 18, 240, "versions, SDPA backend at head dim 128, bf16 GEMM rate"),
    ("ns5", 23, 240, "NS5 at dit_15b's and dit_1b3's matrix shapes, batch 1 and 8, Gram vs plain"),
    ("optimizers", 75, 300, "every optimizer's refresh and RowNorm steps at dit_15b's shapes, 1 and 8 ranks"),
    ("dit15b_w32", 70, 300, "dit_15b as rank 0 of 32, periodic_rowwise K=3, no activation checkpointing"),
    ("dit15b_w32_ac", 38, 300, "the same with activation checkpointing"),
    ("dit15b_w8", 62, 300, "dit_15b as rank 0 of 8, no activation checkpointing"),
    ("dit15b_w8_ac", 50, 300, "the same with activation checkpointing"),
    ("dit1b3_eager", 62, 300, "dit_1b3 through the trainer, eager"),
    ("dit1b3_compile_ac", 52, 900, "dit_1b3 through the trainer, compiled, activation checkpointing"),
    ("checkpoint", 60, 400, "asynchronous DCP save + resume through the trainer (dit_1b3, 8 blocks)"),
)
PHASE_MARK = "[gpu_check +"  # a stage's phase lines (Context.phase), read back by gpu_check_table.where_killed
STACK_BEFORE_KILL_S = 1.0  # the stacks are written this long before the timeout (a stage that ends later)
SETUP_S = 10  # gpu_check.sh before and after the stages: device query (5 s at most), plan, one line per stage, table
KILL_GRACE_S = 2  # a stage that outlives its timeout by this much is killed (SIGKILL after the SIGTERM)
GPU_BUDGET_S = 540  # 9 minutes
ESTIMATE_TIMEOUT_S = 300  # each background memory estimate (CPU, one thread)

# dit_15b as rank 0 of W ranks: (stage, W, activation checkpointing, images per rank on the GPU). 1024 / W is the
# scaling study's; without checkpointing at W = 8 that is 423 GiB (docs/memory_estimate.jsonl), so 16 (~75 GiB).
# Plain FSDP over all W (1/W of every parameter per rank), whatever the study's HSDP layout: its 4 x 8 job keeps
# rank 0 of 8's state with 32 images per GPU, between the W = 32 and W = 8 runs here.
SHARD_OVERRIDES = ["optimizer.K=3", "parallel.replicate=1"]
SHARD_RUNS = {"dit15b_w32": (32, False, 32), "dit15b_w32_ac": (32, True, 32),
              "dit15b_w8": (8, False, 16), "dit15b_w8_ac": (8, True, 128)}
SMOKE_SHARD_BATCH = 2
OPTIMIZER = "periodic_rowwise"  # the optimizer of the sharded and trainer stages (K=3: refresh and RowNorm steps)
TRAINER_BATCH = {"gpu": 32, "smoke": 4}
# the smoke test's model: the preset's block structure at 64 wide and 2 deep (seconds on a CPU)
SMOKE_MODEL = ["model.hidden_size=64", "model.num_heads=2", "model.depth=2"]
SMOKE_TRAINER = [*SMOKE_MODEL, "model.patch_size=8"]


def estimate_jobs(smoke: bool) -> dict[str, list[str]]:
    """dit-estimate-memory's arguments for the configuration of every stage that compares a peak with it
    (the trainer stages' config differs from the scaling study's only where memory does not depend on it)."""
    jobs = {}
    for stage, (world, ac, batch) in SHARD_RUNS.items():
        jobs[stage] = ["--preset", "dit_15b", "--world-size", str(world), "--optimizer", OPTIMIZER,
                       "--micro-batch", str(SMOKE_SHARD_BATCH if smoke else batch),
                       *(["--activation-checkpointing"] if ac else []), *SHARD_OVERRIDES,
                       *(SMOKE_MODEL if smoke else [])]
    trainer = [*SMOKE_TRAINER, "train.precision=fp32", "parallel.mixed_precision=fp32"] if smoke else []
    for stage, ac in (("dit1b3_eager", False), ("dit1b3_compile_ac", True)):
        jobs[stage] = ["--preset", "dit_1b3", "--world-size", "1", "--optimizer", OPTIMIZER, "--micro-batch",
                       str(TRAINER_BATCH["smoke" if smoke else "gpu"]),
                       *(["--activation-checkpointing"] if ac else []), "optimizer.K=3", "parallel.fsdp=true",
                       *trainer]
    return jobs


def plan(smoke: bool, only: list[str] | None) -> list[tuple[str, float]]:
    names = [s[0] for s in STAGES]
    unknown = [n for n in only or () if n not in names]
    if unknown:
        raise SystemExit(f"gpu_check: --only {','.join(unknown)} is not a stage; valid: {','.join(names)}")
    return [(name, smoke_s if smoke else gpu_s) for name, gpu_s, smoke_s, _ in STAGES if not only or name in only]


class Context:
    """What a stage knows: its device, deadline, the results of the stages before it, and where to write."""

    def __init__(self, name: str, results_dir: str, timeout_s: float, smoke: bool, work_dir: str | None = None,
                 started: float | None = None):
        self.name, self.results_dir, self.smoke = name, results_dir, smoke
        self.started = time.monotonic() if started is None else started
        # the stage ends its own work before this; the rest of the timeout is for writing its line
        self.deadline = self.started + timeout_s - min(10.0, 0.15 * timeout_s)
        self.notes: list[str] = []
        self.prediction: dict | None = None  # the cost model's, once counted (gpu_check_stages.prediction)
        # run folders (a checkpoint of ~4 GB among them) go to a temporary folder, removed with the stage (and by
        # gpu_check.sh, whose --work-dir it is in, after a stage that was killed), never to the results folder:
        # that stays small enough to be copied back from a GPU machine
        self.work_dir = tempfile.mkdtemp(prefix=f"{name}_", dir=work_dir)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def phase(self, text: str) -> None:
        """A line in the stage's log as each part starts: a stage killed by its timeout is said to have been in
        the last one (gpu_check_table.where_killed). The first GPU run's stages printed nothing but warnings before
        their kill, and the table could not say where their time went."""
        print(f"{PHASE_MARK}{time.monotonic() - self.started:.1f} s] {text}", flush=True)

    def record(self, check: dict) -> dict:
        """A check as it is made, also appended to <results>/<stage>.checks.jsonl at once: a stage killed by its
        timeout later keeps the checks it had finished in the line gpu_check.sh writes for it
        (gpu_check_table.ensure); before, its line had none (the first GPU run's optimizers stage)."""
        from benchmarks.gpu_check_table import append_partial

        append_partial(self.results_dir, self.name, check)
        return check

    def previous(self, stage: str) -> dict | None:
        """The last line another stage wrote, or None."""
        from benchmarks.gpu_check_table import read_results

        return read_results(self.results_dir).get(stage)


def run_stage(name: str, results_dir: str, timeout_s: float, smoke: bool, work_dir: str | None = None,
              started: float | None = None) -> int:
    # a watchdog thread writes every thread's Python stack into the log just before `timeout` stops the stage (no
    # signal handler: the trainer's own SIGTERM handler would replace one): the table then names the code the
    # stage was in when its time ran out (a compile, a collective, a copy)
    ctx = Context(name, results_dir, timeout_s, smoke, work_dir, started)
    faulthandler.dump_traceback_later(max(ctx.started + timeout_s - STACK_BEFORE_KILL_S - time.monotonic(), 0.1),
                                      exit=False)
    ctx.phase("started (imports next)")
    row = {"stage": name, "ok": False, "checks": [], "values": {}}
    from benchmarks.gpu_check_table import append_row, passed

    try:
        from benchmarks import gpu_check_stages

        result = gpu_check_stages.STAGE_FUNCTIONS[name](ctx)
        row.update(result)
        row["ok"] = passed(row)
    except BaseException as e:  # noqa: BLE001 - any failure is the stage's FAIL line; the traceback goes to its log
        traceback.print_exc()
        text = str(e).strip().splitlines()
        row["error"] = f"{type(e).__name__}: {text[0][:300] if text else ''}".rstrip(": ")
    finally:
        shutil.rmtree(ctx.work_dir, ignore_errors=True)
    faulthandler.cancel_dump_traceback_later()
    row["seconds"] = round(time.monotonic() - ctx.started, 1)
    if ctx.notes:
        row["notes"] = ctx.notes
    append_row(results_dir, row)
    return 0 if row["ok"] else 1


def smi_device_name(text: str) -> str:
    """The first GPU's name from what gpu_check.sh's `nvidia-smi --query-gpu=name,memory.total,driver_version,
    clocks.max.sm --format=csv,noheader` wrote (stdout and stderr), or "" where that is not such a line: nvidia-smi
    absent ("timeout: failed to run command 'nvidia-smi': ..."), failing ("NVIDIA-SMI has failed because it
    couldn't communicate with the NVIDIA driver..."), "No devices were found", nothing. Its first comma-separated
    field was taken as the name whatever the line was, and the background job counted every prediction under it."""
    import re

    lines = text.splitlines()
    fields = [f.strip() for f in lines[0].split(",")] if lines else []
    if len(fields) != 4 or not fields[0] or not re.fullmatch(r"\d+(\.\d+)+", fields[2]):
        return ""
    return fields[0]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu-smoke", action="store_true", help="the CPU version of every stage: a tiny model, gloo")
    ap.add_argument("--plan", action="store_true", help="print the stages to run and their timeouts")
    ap.add_argument("--only", default=None, help="comma-separated stages (with --plan, --estimates)")
    ap.add_argument("--estimates", action="store_true", help="print the memory estimates to start")
    ap.add_argument("--budget", action="store_true",
                    help="print the seconds the whole check and each estimate may take, and the kill grace")
    ap.add_argument("--predictions", action="store_true",
                    help="count the stages' cost-model predictions on the CPU into DIR/predictions.jsonl")
    ap.add_argument("--device-name", default=None, help="with --predictions: the GPU's name, as torch gives it")
    ap.add_argument("--device-name-of", default=None, metavar="FILE",
                    help="print the first GPU's name in nvidia-smi's CSV FILE (nothing where it holds none)")
    ap.add_argument("--stage", default=None, help="run this stage")
    ap.add_argument("--results", default=None, help="the results folder (results.jsonl, estimates)")
    ap.add_argument("--timeout", type=float, default=None, help="the stage's timeout in seconds")
    ap.add_argument("--work-dir", default=None, help="where the stage's temporary run folders go")
    args = ap.parse_args(argv)
    if args.device_name_of is not None:
        try:
            with open(args.device_name_of, errors="replace") as f:
                print(smi_device_name(f.read()))
        except OSError:
            print("")
        return 0
    if args.plan:
        for name, t in plan(args.cpu_smoke, args.only.split(",") if args.only else None):
            print(f"{name}\t{t:g}")
        return 0
    if args.budget:  # the GPU's 9 minutes (on CPU: the stages' timeouts), and each estimate's timeout
        total = GPU_BUDGET_S if not args.cpu_smoke else SETUP_S + sum(s[2] + KILL_GRACE_S for s in STAGES)
        print(total, ESTIMATE_TIMEOUT_S, KILL_GRACE_S)
        return 0
    if args.estimates:
        stages = [name for name, _ in plan(args.cpu_smoke, args.only.split(",") if args.only else None)]
        for key, est_args in estimate_jobs(args.cpu_smoke).items():
            if key in stages:
                print(f"{key}\t{' '.join(est_args)}")
        return 0
    names = [s[0] for s in STAGES]
    if args.predictions:
        if not args.results or not os.path.isdir(args.results) or not args.device_name:
            ap.error("--predictions needs --results FOLDER and --device-name NAME")
        from benchmarks.gpu_check_stages import predict_in_background

        stages = [name for name, _ in plan(args.cpu_smoke, args.only.split(",") if args.only else None)]
        predict_in_background(args.results, args.device_name, stages, args.cpu_smoke)
        return 0
    if args.stage not in names:
        ap.error(f"--stage {args.stage!r} is not a stage; valid: {', '.join(names)}")
    if not args.results or not os.path.isdir(args.results):
        ap.error(f"--results {args.results!r} is not a folder")
    timeout = args.timeout or dict(plan(args.cpu_smoke, None))[args.stage]
    return run_stage(args.stage, args.results, timeout, args.cpu_smoke, args.work_dir, started=STARTED)


if __name__ == "__main__":
    sys.exit(main())
