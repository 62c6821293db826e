#!/usr/bin/env python
"""One-GPU check of the trainer at full size, sized for about 6 minutes on one H100/H200 (at most 7: the budgets
below; not yet timed on a GPU) and for an 80 GB GPU. The stages are in gpu_check_stages.py; scripts/gpu_check.sh
runs this after printing the device:

- gemm: the GEMM rate in the compute dtype, the denominator of MFU;
- ns5 (bf16): the optimizer's NS5 over the model's matrices against the same-shape bf16 bmm and that rate;
- train <optimizer> for adamw, muon, periodic_rowwise, rownorm and mud, one trainer alive at a time (built by the
  trainer's own code, dit_1b3 under FSDP2 on a group of one, bf16, synthetic latents of the preset's shape): step
  time, MFU (model FLOPs per step, dit_train/model_flops.py, over step time and the gemm rate), peak memory
  (torch.cuda.max_memory_allocated) against dit_train/memory_estimate.py's estimate of the same configuration;
- checkpoint: DCP save and resume through the trainer, the next steps bit-identical;
- compile + AC: parallel.compile and parallel.activation_checkpointing, a few steps, first loss against eager.

Each stage runs under its own time budget (and all under --total-budget); a failure is a FAIL row, not a crash.
The markdown table is printed and written to --out after every stage. Exit status 0 only if every stage passed.

    python scripts/gpu_check.py [--out docs/gpu_check.md] [--batch-size 32] [hydra overrides, e.g. model.depth=8]
    python scripts/gpu_check.py --cpu-smoke --out /tmp/gpu_check.md   # the same stages on CPU: tiny model, fp32
"""

from __future__ import annotations

import argparse
import concurrent.futures
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
from functools import partial

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))

OPTIMIZERS = ("adamw", "muon", "periodic_rowwise", "rownorm", "mud")
# seconds each stage may take at most on the GPU (the whole check: --total-budget). A dit_1b3 trainer starts by
# drawing its 1.3B initial weights on the host (weight_init, one process: ~30 s); the checkpoint stage builds two. The CPU
# smoke test has SMOKE_BUDGET_SCALE times as long: there they only stop a hang (a cold CPU compile takes a minute).
BUDGET_S = {"gemm": 30, "ns5": 45, "train": 90, "checkpoint": 150, "compile": 180}
SMOKE_BUDGET_SCALE = 4
GPU_MODEL = ["model=dit_1b3"]
SMOKE_MODEL = ["model=dit_xs", "model.hidden_size=64", "model.num_heads=2", "model.depth=2", "model.patch_size=8"]


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="run every stage on CPU (gloo, fp32) with a tiny model: checks the check itself")
    ap.add_argument("--out", default=None, help="the markdown table's file (default docs/gpu_check.md; smoke: "
                                                "gpu_check_smoke.md in the temporary folder, not to replace a GPU's)")
    ap.add_argument("--batch-size", type=int, default=None, help="images per step (default 32; smoke: 4)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per training stage, after one warm-up step")
    ap.add_argument("--total-budget", type=float, default=None,
                    help="seconds for the whole check (default 420: with the host-sync benchmark after it, under 8 minutes; smoke: 900)")
    ap.add_argument("--checkpoint-optimizer", default="periodic_rowwise", choices=OPTIMIZERS)
    ap.add_argument("--compile-optimizer", default="adamw", choices=OPTIMIZERS)
    ap.add_argument("--work-dir", default=None, help="run folders and the checkpoint (default: a temporary folder, "
                                                     "removed afterwards)")
    ap.add_argument("overrides", nargs="*", help="hydra overrides for every stage's config, after the preset's")
    args = ap.parse_args(argv)
    args.out = args.out or (os.path.join(tempfile.gettempdir(), "gpu_check_smoke.md") if args.cpu_smoke
                            else os.path.join(ROOT, "docs", "gpu_check.md"))
    for key in ("batch_size", "steps", "total_budget"):
        value = getattr(args, key)
        if value is not None and value <= 0:
            ap.error(f"--{key.replace('_', '-')}={value} is not valid: it must be positive")
    return args


def check_device(args) -> None:
    """One-line errors before anything is built: one process, and a GPU unless --cpu-smoke."""
    import torch

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != 1:
        raise SystemExit(f"gpu_check: WORLD_SIZE={world} is not valid: the check runs as one process "
                         f"(python scripts/gpu_check.py, not torchrun)")
    if not args.cpu_smoke and not torch.cuda.is_available():
        raise SystemExit("gpu_check: no CUDA device is visible (torch.cuda.is_available() is False); "
                         "run it on a GPU, or --cpu-smoke to check the check on CPU")


def make_setup(args, work_dir: str):
    from dit_train.parallel import init_distributed
    from gpu_check_stages import Setup
    from estimate_memory import USABLE_80GB_GIB

    cuda = not args.cpu_smoke
    if cuda:  # deterministic cuBLAS for the checkpoint stage; read once, before the first GEMM
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    dist = init_distributed(single_process_group=True, device="cuda" if cuda else "cpu")
    return Setup(dist=dist, precision="bf16" if cuda else "fp32",
                 overrides=[*(GPU_MODEL if cuda else SMOKE_MODEL), *args.overrides],
                 batch_size=args.batch_size or (32 if cuda else 4), steps=args.steps, work_dir=work_dir,
                 gemm_size=8192 if cuda else 256, ns5_repeats=5 if cuda else 2,
                 memory_limit_gib=USABLE_80GB_GIB if cuda else None)


def start_estimates(setup, args, pool) -> None:
    """dit_train.memory_estimate for every training stage's configuration, one after the other in a spawned
    process (it needs a fake process group, which cannot share a process with the real one) while the device works;
    in the order the stages need them."""
    from omegaconf import OmegaConf

    from gpu_check_stages import compose, estimate_peak_bytes

    threads = 1 if args.cpu_smoke else 4
    wanted = [(opt, False) for opt in OPTIMIZERS] + [(args.compile_optimizer, True)]
    for opt, checkpointing in wanted:
        cfg = compose(setup, opt, "estimate", checkpointing=checkpointing)
        setup.estimates[(opt, checkpointing)] = pool.submit(
            estimate_peak_bytes, OmegaConf.to_container(cfg, resolve=True), setup.batch_size, threads)


def header(setup, cfg) -> list[str]:
    import torch

    from dit_train.model import build_model, count_parameters

    if setup.device.type == "cuda":
        props = torch.cuda.get_device_properties(setup.device)
        device = f"{props.name} ({props.total_memory / 1024**3:.1f} GiB), CUDA {torch.version.cuda}"
    else:
        device = f"CPU smoke test ({os.cpu_count()} cores), gloo"
    m = cfg.model
    params = count_parameters(build_model(m, device="meta"))
    command = " ".join(["python scripts/gpu_check.py", *(sys.argv[1:])])
    return [f"# GPU check: `{command}`", "",
            f"{time.strftime('%Y-%m-%d %H:%M')}; {device}; torch {torch.__version__}.",
            f"{m.name} ({params / 1e6:.1f}M parameters, width {m.hidden_size}, depth {m.depth}) under FSDP2 on "
            f"{setup.dist.world_size} process, {setup.precision} compute weights and autocast, fp32 gradient "
            f"reduction; {setup.batch_size} synthetic {m.in_channels}x{m.image_size}x{m.image_size} latents per step; "
            f"{setup.flops_per_image / 1e9:.4g} GFLOP per image forward + backward (model FLOPs). Columns: step ms "
            f"(median of timed steps), TFLOP/s (achieved: model FLOPs / step time; the kernel's own for gemm and "
            f"ns5), MFU (achieved / the gemm row), peak GiB (torch.cuda.max_memory_allocated), estimate GiB "
            f"(dit_train/memory_estimate.py, same configuration), s (the stage's wall time)."]


def stages(setup, args):
    from gpu_check_stages import (stage_checkpoint, stage_compile_checkpointing, stage_gemm, stage_ns5,
                                  stage_train)

    budget = {k: v * (SMOKE_BUDGET_SCALE if args.cpu_smoke else 1) for k, v in BUDGET_S.items()}
    yield "gemm", partial(stage_gemm, setup), budget["gemm"]
    yield "ns5 (bf16)", partial(stage_ns5, setup), budget["ns5"]
    for opt in OPTIMIZERS:
        yield f"train {opt}", partial(stage_train, setup, opt), budget["train"]
    yield "checkpoint (DCP save + resume)", partial(stage_checkpoint, setup, args.checkpoint_optimizer), \
        budget["checkpoint"]
    yield f"compile + AC ({args.compile_optimizer})", partial(stage_compile_checkpointing, setup,
                                                              args.compile_optimizer), budget["compile"]


def write(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def main(argv=None) -> int:
    args = parse(argv)
    check_device(args)
    t_start = time.monotonic()
    deadline = t_start + (args.total_budget or (900 if args.cpu_smoke else 420))
    work_dir = args.work_dir or tempfile.mkdtemp(prefix="gpu_check_")
    import torch

    from dit_train.model_flops import training_flops_per_image
    from dit_train.parallel import shutdown_process_group
    from gpu_check_stages import compose, free_device
    from gpu_check_table import markdown, run_stage

    if args.cpu_smoke:
        torch.set_num_threads(1)  # tiny matrices: a second intra-op thread only adds synchronisation
    setup = make_setup(args, work_dir)
    # one worker, reused: an estimate gives the same bytes after others in the same process as in a fresh one
    pool = concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"))
    rows = []
    try:
        cfg = compose(setup, "adamw", "header")
        setup.flops_per_image = training_flops_per_image(cfg.model)
        start_estimates(setup, args, pool)
        head = header(setup, cfg)
        print("\n".join(head), flush=True)
        plan = list(stages(setup, args))
        for i, (name, fn, budget) in enumerate(plan):
            rows.append(run_stage(name, fn, budget, deadline, partial(free_device, setup.device)))
            write(args.out, markdown(rows, head + ["", f"(in progress: {i + 1} of {len(plan)} stages run)"]))
        table = markdown(rows, head)
        write(args.out, table)
        print("\n" + table + f"\ngpu_check: {time.monotonic() - t_start:.0f} s; table written to {args.out}",
              flush=True)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        shutdown_process_group()
        if args.work_dir is None:
            shutil.rmtree(work_dir, ignore_errors=True)
    return 0 if all(r.ok for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
