"""Per-GPU memory of a training step, measured by running the trainer's code on fake tensors under a fake process
group (dit_train/parallel/memory_estimate.py: FSDP2 plan, sharded optimizer, EMA, FSDPMemTracker). Runs on a CPU.

    dit-estimate-memory --preset dit_15b --world-size 32 --optimizer periodic_rowwise --micro-batch 8 \\
        [--activation-checkpointing] [--json] [hydra overrides, e.g. model.depth=2 optimizer.K=5]
    dit-estimate-memory --table [--presets ...] [--optimizers ...] [--world-sizes 8 16 32] \\
        [--micro-batch N] [--activation-checkpointing] [--results grid.jsonl]

The config is the scaling study's (experiment=scaling_study: bf16 autocast, global batch train.batch_size=1024)
with bf16 compute weights and fp32 gradient reduction (parallel.mixed_precision=bf16, as on CUDA).
The batch, by the trainer's rule: each rank takes train.batch_size / W images (which must divide) in N forwards
(--micro-batches N) of train.batch_size / W / N images each; so by default 1024 / W images per GPU in one forward
(dit-memory-formula assumes 32 images per GPU unless told: the same at W = 32). An explicit --micro-batch M
estimates M images per forward and a global batch of M x N x W instead; the first line of the output states the
global batch. --table runs each configuration in a fresh subprocess (no state carried between them), with the same
--micro-batch, --micro-batches and overrides in every row, appends each result to --results as it finishes
(configurations already there are not rerun) and prints a markdown table with the hand formula of
dit-memory-formula beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from dit_train.config.errors import ConfigError
from dit_train.config.files import group_options
from dit_train.trainer.preemption import ctrl_c_exits
from dit_train.plain_text import print_error


GIB = 1024**3
USABLE_80GB_GIB = 74.5  # what an 80 GB GPU leaves to tensors (80e9 bytes = 74.5 GiB, before the CUDA context)
PRESETS = ("dit_1b3", "dit_4b", "dit_9b", "dit_15b")
OPTIMIZERS = ("adamw", "muon", "periodic_rowwise", "mud")
ROWS = (("parameters", "parameters (fp32 shards)"), ("gradients", "gradients"),
        ("optimizer_state", "optimizer state"), ("optimizer_workspace", "optimizer workspace / step temporaries"),
        ("ema", "EMA (fp32 shards)"), ("activations", "activations"),
        ("gathered_and_comm", "gathered weights, all-gather / reduce-scatter buffers"),
        ("other", "temporary / other (backward temporaries, inputs, buffers)"), ("total", "total"))


def compose(preset: str, optimizer: str, checkpointing: bool, overrides=()):
    """The estimated config; a bad override (`model.depht=2`) is a ConfigError of one line, as in dit-train."""
    import dit_train  # noqa: F401  registers the config schemas that conf/config.yaml names
    from dit_train.config.command_line import compose_checked

    return compose_checked([
        "experiment=scaling_study", f"model={preset}", f"optimizer={optimizer}", "run_dir=unused",
        "parallel.mixed_precision=bf16", f"parallel.activation_checkpointing={str(checkpointing).lower()}",
        # plain FSDP over --world-size: the study's own layout (HSDP for multi-node presets) only when asked
        "parallel.replicate=1", *overrides])


def _overridden(overrides, key: str) -> bool:
    return any(o.lstrip("+").split("=", 1)[0] == key for o in overrides)


def batch_plan(cfg, world_size: int, micro_batch: int | None = None, micro_batches: int | None = None,
               overrides=()) -> tuple[int, int, int]:
    """(global batch, images per rank per forward, forwards per step) of the estimate, set in cfg.train as the
    trainer would run it and checked by the trainer's own check (config.validate.check_train: train.batch_size
    divisible by the world size, train.micro_batch_size dividing the per-rank batch), split by its rule
    (config.validate.split_batch). Without --micro-batch the global batch is train.batch_size and --micro-batches N
    splits each rank's share in N; with --micro-batch M it is M x N x W. A train.batch_size or
    train.micro_batch_size override that says otherwise than the flags is a ConfigError, as is what the trainer
    refuses."""
    from dit_train.config.validate import check_train, split_batch

    tc = cfg.train
    if micro_batch is not None:
        want = {"batch_size": micro_batch * (micro_batches or 1) * world_size, "micro_batch_size": micro_batch}
    else:
        check_train(tc, world_size)  # train.batch_size over the world size first: its own message
        per_rank = tc.batch_size // world_size
        if micro_batches is None:
            want = {}
        elif per_rank % micro_batches:
            raise ConfigError(f"--micro-batches {micro_batches}: must divide the per-rank batch {per_rank} "
                              f"(train.batch_size={tc.batch_size} over {world_size} ranks)")
        else:
            want = {"micro_batch_size": per_rank // micro_batches}
    for key, value in want.items():
        if _overridden(overrides, f"train.{key}") and tc[key] is not None and tc[key] != value:
            raise ConfigError(f"train.{key}={tc[key]} disagrees with --micro-batch/--micro-batches "
                              f"({key} {value} on {world_size} ranks): give one of them")
        tc[key] = value
    check_train(tc, world_size)
    micro, n = split_batch(tc, world_size)
    return tc.batch_size, micro, n


def run_one(args) -> dict:
    cfg = compose(args.preset, args.optimizer, args.activation_checkpointing, args.overrides)
    batch, micro, n = batch_plan(cfg, args.world_size, args.micro_batch, args.micro_batches, args.overrides)
    import torch

    from dit_train.parallel.memory_estimate import estimate

    torch.set_num_threads(1)  # fake tensors do no arithmetic
    out = estimate(cfg, args.world_size, micro, fake=not args.real_tensors, micro_batches=n)
    out.update(preset=args.preset, optimizer=args.optimizer, world_size=args.world_size, micro_batch=micro,
               micro_batches=n, global_batch=batch, blocks_per_unit=cfg.parallel.blocks_per_fsdp_unit,
               activation_checkpointing=args.activation_checkpointing, overrides=list(args.overrides))
    return out


def _batch_words(r: dict) -> str:
    n = r.get("micro_batches", 1)
    batch = r.get("global_batch", r["micro_batch"] * n * r["world_size"])
    forwards = f"{n} micro-batches of {r['micro_batch']}" if n > 1 else f"micro-batch {r['micro_batch']}"
    return f"global batch {batch} = {forwards} images/rank x {r['world_size']} ranks"


def advice(r: dict) -> str:
    """What would fit, for an estimate that does not: images per forward (largest_fitting_micro_batch, kept to a
    divisor of the rank's batch so that the global batch stays, as train.micro_batch_size must), activation
    checkpointing, more GPUs."""
    n = r.get("micro_batches", 1)
    per_rank, fit = r["micro_batch"] * n, largest_fitting_micro_batch(r)
    ways = []
    divisor = max((d for d in range(1, min(fit, per_rank) + 1) if per_rank % d == 0), default=0)
    if divisor:
        ways.append(f"about {fit} images per forward fit: --micro-batches {per_rank // divisor} "
                    f"(train.micro_batch_size={divisor}) keeps the global batch")
    else:
        ways.append("not even one image per forward fits beside the state and gathered weights")
    if not r["activation_checkpointing"]:
        ways.append("--activation-checkpointing")
    ways.append(f"more GPUs (the {r['persistent']['total'] / GIB:.1f} GiB persistent state is sharded over W)")
    return "to fit: " + "; or ".join(ways)


def describe(r: dict) -> str:
    head = (f"{r['preset']} on {r['world_size']} ranks, {r['optimizer']}, {_batch_words(r)}, "
            f"activation checkpointing {'on' if r['activation_checkpointing'] else 'off'}"
            f"{' ' + ' '.join(r['overrides']) if r['overrides'] else ''}; {r['steps']} steps in {r['seconds']:.0f} s")
    lines = [head, f"{'GiB per rank (rank 0)':<60}{'persistent':>11}{'at peak':>11}"]
    for key, label in ROWS:
        p = r["persistent"].get(key)
        lines.append(f"  {label:<58.58}{'' if p is None else f'{p / GIB:.2f}':>11}{r['peak'][key] / GIB:11.2f}")
    fits = r["peak"]["total"] / GIB <= USABLE_80GB_GIB
    lines.append(f"peak {r['peak']['total'] / GIB:.1f} GiB: {'fits' if fits else 'does not fit'} an 80 GB GPU "
                 f"({USABLE_80GB_GIB} GiB) before the CUDA context, NCCL buffers and fragmentation")
    if not fits:
        lines.append(advice(r))
    return "\n".join(lines)


# ---- the grid -------------------------------------------------------------------------------------------------
def _key(r: dict) -> tuple:
    """What makes a row: rows written before micro_batches and overrides were recorded ran 1 and none."""
    return (r["preset"], r["optimizer"], r["world_size"], r["micro_batch"], r.get("micro_batches", 1),
            r["activation_checkpointing"], tuple(r.get("overrides", ())))


def _load(path: str | None) -> list[dict]:
    if not path or not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def grid_plan(args) -> list[tuple]:
    """Every row of the grid as (preset, optimizer, W, images per forward, forwards per step), each batch by
    batch_plan with the command's --micro-batch, --micro-batches and overrides: a ConfigError (a world size the
    batch does not divide) before any row runs."""
    rows = []
    for preset in args.presets:
        for w in args.world_sizes:
            for opt in args.optimizers:
                cfg = compose(preset, opt, args.activation_checkpointing, args.overrides)
                _, micro, n = batch_plan(cfg, w, args.micro_batch, args.micro_batches, args.overrides)
                rows.append((preset, opt, w, micro, n))
    return rows


def run_grid(args) -> list[dict]:
    results = _load(args.results)
    done = {_key(r) for r in results}
    for preset, opt, w, micro, n in grid_plan(args):
        if (preset, opt, w, micro, n, args.activation_checkpointing, tuple(args.overrides)) in done:
            continue
        cmd = [sys.executable, "-m", "dit_train.parallel.memory_estimate_cli", "--preset", preset, "--optimizer", opt,
               "--world-size", str(w), "--micro-batch", str(micro), "--micro-batches", str(n), "--json"]
        if args.activation_checkpointing:
            cmd.append("--activation-checkpointing")
        cmd += args.overrides
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            print(f"FAILED {' '.join(cmd[1:])}\n{proc.stderr[-3000:]}", file=sys.stderr)
            continue
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        r["wall_seconds"] = time.perf_counter() - t0
        results.append(r)
        print(f"{preset} W={w} {opt} mb={micro}x{n}: peak {r['peak']['total'] / GIB:.1f} GiB "
              f"({r['wall_seconds']:.0f} s)", file=sys.stderr, flush=True)
        if args.results:
            with open(args.results, "a") as f:
                f.write(json.dumps(r) + "\n")
    return results


def formula_total(r: dict, counts_cache: dict) -> float:
    """dit-memory-formula's hand formula for the same row (AdamW or the Muon family), in bytes."""
    from dit_train.parallel import memory_formula

    if r["preset"] not in counts_cache:
        counts_cache[r["preset"]] = memory_formula.counts(r["preset"])
    c = counts_cache[r["preset"]]
    parts = memory_formula.memory(c, r["world_size"], r["micro_batch"], r["optimizer"], r["activation_checkpointing"],
                                  r.get("blocks_per_unit", 1))  # rows written before it was recorded: 1
    return sum(parts.values())


def largest_fitting_micro_batch(r: dict, budget_gib: float = USABLE_80GB_GIB) -> int:
    """Images per GPU that keep the peak under `budget_gib`, scaling linearly what grows with the micro-batch
    (the peak less the persistent state, the gathered weights and communication buffers and the gradients)."""
    k = r["peak"]
    fixed = r["persistent"]["total"] + k["gathered_and_comm"] + k["gradients"]
    per_image = (k["total"] - fixed) / r["micro_batch"]
    return max(0, int((budget_gib * GIB - fixed) // per_image))


def markdown(results: list[dict]) -> str:
    g = lambda b: f"{b / GIB:.1f}"
    lines = ["| preset | W | optimizer | images/GPU | AC | params | optimizer state | optimizer workspace | EMA | "
             "persistent | activations at peak | peak | formula (dit-memory-formula) | fits 80 GB | images/GPU that fit | s |",
             "| --- | ---: | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: |"]
    counts: dict = {}
    order = {p: i for i, p in enumerate(PRESETS)}
    oorder = {o: i for i, o in enumerate(OPTIMIZERS)}
    for r in sorted(results, key=lambda r: (order.get(r["preset"], 99), r["activation_checkpointing"],
                                            r["world_size"], r["micro_batch"], oorder.get(r["optimizer"], 99))):
        p, k = r["persistent"], r["peak"]
        fits = "yes" if k["total"] / GIB <= USABLE_80GB_GIB else "no"
        lines.append(
            f"| {' '.join([r['preset'], *r.get('overrides', [])])} | {r['world_size']} | {r['optimizer']} | "
            f"{r['micro_batch']}{' x ' + str(r['micro_batches']) if r.get('micro_batches', 1) > 1 else ''} | "
            f"{'on' if r['activation_checkpointing'] else 'off'} | {g(p['parameters'])} | {g(p['optimizer_state'])} | "
            f"{g(p['optimizer_workspace'])} | {g(p['ema'])} | {g(p['total'])} | {g(k['activations'])} | "
            f"**{g(k['total'])}** | {g(formula_total(r, counts))} | {fits} | {largest_fitting_micro_batch(r)} | "
            f"{r.get('wall_seconds', r['seconds']):.0f} |")
    return "\n".join(lines)


@ctrl_c_exits("dit-estimate-memory: interrupted; with --table --results FILE, the rows finished are in FILE and "
              "the same command continues from them")
def main(argv=None) -> int:
    """The command: a bad preset, optimizer or override is one line and exit status 2 (was a traceback)."""
    models, optimizers = group_options("model"), group_options("optimizer")
    ap = argparse.ArgumentParser(prog="dit-estimate-memory", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="dit_1b3", choices=models, metavar="PRESET", help=", ".join(models))
    ap.add_argument("--optimizer", default="adamw", choices=optimizers, metavar="NAME", help=", ".join(optimizers))
    ap.add_argument("--world-size", type=int, default=8)
    ap.add_argument("--micro-batch", type=int, default=None,
                    help="images per rank per forward (default train.batch_size / W / N: 1024 / W / N); given, the "
                         "global batch is M x N x W")
    ap.add_argument("--micro-batches", type=int, default=None, metavar="N",
                    help="forwards per step, gradient accumulation (default: train.batch_size / W / "
                         "train.micro_batch_size, 1 unless an override sets train.micro_batch_size)")
    ap.add_argument("--activation-checkpointing", action="store_true")
    ap.add_argument("--json", action="store_true", help="print the result as one JSON line (bytes)")
    ap.add_argument("--real-tensors", action="store_true",
                    help="allocate and compute for real (small models only): checks the fake run against a real one")
    ap.add_argument("--table", action="store_true", help="run the grid, one subprocess per configuration")
    ap.add_argument("--presets", nargs="+", default=list(PRESETS), choices=models, metavar="PRESET")
    ap.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS), choices=optimizers, metavar="NAME")
    ap.add_argument("--world-sizes", type=int, nargs="+", default=[8, 16, 32], metavar="W")
    ap.add_argument("--results", help="--table: JSON lines file, appended to and reused")
    ap.add_argument("overrides", nargs="*", help="hydra overrides (with --table: of every row)")
    args = ap.parse_args(argv)
    # before any work: 0 ranks divided by zero, a negative count failed an assert, a rank batch of 0 hung
    for flag, values in (("--world-size", [args.world_size]), ("--world-sizes", args.world_sizes),
                         ("--micro-batch", [args.micro_batch]), ("--micro-batches", [args.micro_batches])):
        bad = [v for v in values if v is not None and v < 1]
        if bad:
            print_error(f"{flag} {bad[0]}: must be an integer >= 1")
            return 2
    if args.table:
        folder = os.path.dirname(os.path.abspath(args.results)) if args.results else None
        if folder and not os.path.isdir(folder):  # was a traceback after the first configuration's minutes
            print_error(f"--results {args.results}: the folder {folder} does not exist")
            return 2
        try:
            print(markdown(run_grid(args)))
        except ConfigError as e:  # a batch the trainer refuses, found before the first row runs
            print_error(str(e))
            return 2
        except OSError as e:  # --results unreadable or unwritable: the path and the operation
            from dit_train.runs.atomic_io import describe_os_error

            print_error(describe_os_error(e))
            return 1
        return 0
    try:
        r = run_one(args)
    except ConfigError as e:
        print_error(str(e))
        return 2
    print(json.dumps(r) if args.json else describe(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
