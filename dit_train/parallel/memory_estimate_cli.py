"""Per-GPU memory of a training step, measured by running the trainer's code on fake tensors under a fake process
group (dit_train/parallel/memory_estimate.py: FSDP2 plan, sharded optimizer, EMA, FSDPMemTracker). Runs on a CPU.

    dit-estimate-memory --preset dit_15b --world-size 32 --optimizer periodic_rowwise --micro-batch 8 \\
        [--activation-checkpointing] [--json] [hydra overrides, e.g. model.depth=2 optimizer.K=5]
    dit-estimate-memory --table [--presets ...] [--optimizers ...] [--world-sizes 8 16 32] \\
        [--micro-batch N] [--activation-checkpointing] [--results grid.jsonl]

The config is the scaling study's (experiment=scaling_study: bf16 autocast, global batch 1024) with bf16 compute
weights and fp32 gradient reduction (parallel.mixed_precision=bf16, as on CUDA). --micro-batch defaults to
train.batch_size / world size. --table runs each configuration in a fresh subprocess (no state carried between
them), appends each result to --results as it finishes (configurations already there are not rerun) and prints a
markdown table with the hand formula of dit-memory-formula beside it.
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


def run_one(args) -> dict:
    import torch

    from dit_train.parallel.memory_estimate import estimate

    torch.set_num_threads(1)  # fake tensors do no arithmetic
    cfg = compose(args.preset, args.optimizer, args.activation_checkpointing, args.overrides)
    micro = args.micro_batch or cfg.train.batch_size // args.world_size
    out = estimate(cfg, args.world_size, micro, fake=not args.real_tensors, micro_batches=args.micro_batches)
    out.update(preset=args.preset, optimizer=args.optimizer, world_size=args.world_size, micro_batch=micro,
               micro_batches=args.micro_batches, blocks_per_unit=cfg.parallel.blocks_per_fsdp_unit,
               activation_checkpointing=args.activation_checkpointing, overrides=list(args.overrides))
    return out


def describe(r: dict) -> str:
    head = (f"{r['preset']} on {r['world_size']} ranks, {r['optimizer']}, micro-batch {r['micro_batch']} images/rank, "
            f"activation checkpointing {'on' if r['activation_checkpointing'] else 'off'}"
            f"{' ' + ' '.join(r['overrides']) if r['overrides'] else ''}; {r['steps']} steps in {r['seconds']:.0f} s")
    lines = [head, f"{'GiB per rank (rank 0)':<60}{'persistent':>11}{'at peak':>11}"]
    for key, label in ROWS:
        p = r["persistent"].get(key)
        lines.append(f"  {label:<58.58}{'' if p is None else f'{p / GIB:.2f}':>11}{r['peak'][key] / GIB:11.2f}")
    fits = r["peak"]["total"] / GIB <= USABLE_80GB_GIB
    lines.append(f"peak {r['peak']['total'] / GIB:.1f} GiB: {'fits' if fits else 'does not fit'} an 80 GB GPU "
                 f"({USABLE_80GB_GIB} GiB) before the CUDA context, NCCL buffers and fragmentation")
    return "\n".join(lines)


# ---- the grid -------------------------------------------------------------------------------------------------
def _key(r: dict) -> tuple:
    return (r["preset"], r["optimizer"], r["world_size"], r["micro_batch"], r["activation_checkpointing"])


def _load(path: str | None) -> list[dict]:
    if not path or not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def run_grid(args) -> list[dict]:
    results = _load(args.results)
    done = {_key(r) for r in results}
    for preset in args.presets:
        for w in args.world_sizes:
            for opt in args.optimizers:
                micro = args.micro_batch or 1024 // w
                if (preset, opt, w, micro, args.activation_checkpointing) in done:
                    continue
                cmd = [sys.executable, "-m", "dit_train.parallel.memory_estimate_cli", "--preset", preset, "--optimizer", opt,
                       "--world-size", str(w), "--micro-batch", str(micro), "--json"]
                if args.activation_checkpointing:
                    cmd.append("--activation-checkpointing")
                t0 = time.perf_counter()
                proc = subprocess.run(cmd, capture_output=True, text=True)
                if proc.returncode != 0:
                    print(f"FAILED {' '.join(cmd[1:])}\n{proc.stderr[-3000:]}", file=sys.stderr)
                    continue
                r = json.loads(proc.stdout.strip().splitlines()[-1])
                r["wall_seconds"] = time.perf_counter() - t0
                results.append(r)
                print(f"{preset} W={w} {opt} mb={micro}: peak {r['peak']['total'] / GIB:.1f} GiB "
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
            f"| {r['preset']} | {r['world_size']} | {r['optimizer']} | {r['micro_batch']} | "
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
    ap.add_argument("--micro-batch", type=int, default=None, help="images per rank (default batch_size / W)")
    ap.add_argument("--micro-batches", type=int, default=1,
                    help="forwards per step (gradient accumulation: train.batch_size / W / train.micro_batch_size)")
    ap.add_argument("--activation-checkpointing", action="store_true")
    ap.add_argument("--json", action="store_true", help="print the result as one JSON line (bytes)")
    ap.add_argument("--real-tensors", action="store_true",
                    help="allocate and compute for real (small models only): checks the fake run against a real one")
    ap.add_argument("--table", action="store_true", help="run the grid, one subprocess per configuration")
    ap.add_argument("--presets", nargs="+", default=list(PRESETS), choices=models, metavar="PRESET")
    ap.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS), choices=optimizers, metavar="NAME")
    ap.add_argument("--world-sizes", type=int, nargs="+", default=[8, 16, 32])
    ap.add_argument("--results", help="--table: JSON lines file, appended to and reused")
    ap.add_argument("overrides", nargs="*", help="hydra overrides for the one configuration")
    args = ap.parse_args(argv)
    if args.table:
        folder = os.path.dirname(os.path.abspath(args.results)) if args.results else None
        if folder and not os.path.isdir(folder):  # was a traceback after the first configuration's minutes
            print(f"error: --results {args.results}: the folder {folder} does not exist", file=sys.stderr)
            return 2
        try:
            print(markdown(run_grid(args)))
        except OSError as e:  # --results unreadable or unwritable: the path and the operation
            from dit_train.runs.atomic_io import describe_os_error

            print(f"error: {describe_os_error(e)}", file=sys.stderr)
            return 1
        return 0
    try:
        r = run_one(args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(r) if args.json else describe(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
