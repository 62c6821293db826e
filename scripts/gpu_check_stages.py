"""The stages of scripts/gpu_check.py. Each returns a Row (gpu_check_table.py); training stages build the trainer's
own Trainer from a composed config and take its own steps (Trainer.step_on), one trainer alive at a time."""

from __future__ import annotations

import contextlib
import gc
import math
import os
import statistics
import time
from dataclasses import dataclass, field

import torch

from gpu_check_table import GIB, Row

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# peak / estimate outside [1 / TOLERANCE, TOLERANCE] fails: the estimate decides what fits a GPU (docs/scaling_out.md)
ESTIMATE_TOLERANCE = 1.25
# first-step loss of compile + activation checkpointing against the eager run: same weights, batch and noise
LOSS_RTOL = {"bf16": 2e-2, "fp32": 1e-4}


@dataclass
class Setup:
    dist: object  # dit_train.parallel.DistInfo of the group of one
    precision: str  # bf16 | fp32: autocast and FSDP2 compute weights alike
    overrides: list[str]  # model and anything else, before the stage's own
    batch_size: int
    steps: int  # timed steps per training stage (after one warm-up step)
    work_dir: str
    gemm_size: int
    ns5_repeats: int
    memory_limit_gib: float | None  # CUDA: what an 80 GB GPU leaves to tensors; None on CPU (nothing to measure)
    peak_flops: float | None = None  # the GEMM stage's rate, the MFU denominator
    flops_per_image: int | None = None
    first_losses: dict = field(default_factory=dict)  # optimizer -> first-step loss of its eager stage
    estimates: dict = field(default_factory=dict)  # (optimizer, activation checkpointing) -> Future of peak bytes

    @property
    def device(self) -> torch.device:
        return self.dist.device


# ---- configs and the trainer --------------------------------------------------------------------------------
def compose(setup: Setup, optimizer: str, name: str, checkpointing: bool = False, compiled: bool = False,
            extra=()):
    """The run config of one stage: the setup's model on synthetic data of its shape, FSDP2 on the group of one,
    `setup.precision` for autocast and compute weights, no evaluation beyond a token validation set."""
    from hydra import compose as hcompose
    from hydra import initialize_config_dir

    B, p = setup.batch_size, setup.precision
    with initialize_config_dir(config_dir=os.path.join(ROOT, "dit_train", "conf"), version_base="1.3"):
        return hcompose(config_name="config", overrides=[
            *setup.overrides, "data=synthetic", "data.image_size=${model.image_size}",
            "data.channels=${model.in_channels}", "data.num_classes=${model.num_classes}",
            f"data.num_samples={B * 16}", f"optimizer={optimizer}", f"run_dir={os.path.join(setup.work_dir, name)}",
            f"train.batch_size={B}", "train.steps=1000", "train.warmup_steps=10", f"train.precision={p}",
            "train.progress=false", f"train.val_samples={B}", f"train.val_batch_size={B}", "eval.every_n_steps=0",
            "parallel.fsdp=true", f"parallel.mixed_precision={p}",
            f"parallel.activation_checkpointing={str(checkpointing).lower()}",
            f"parallel.compile={str(compiled).lower()}",
            *extra])


@contextlib.contextmanager
def built_trainer(cfg, dist):
    """The trainer of `cfg` (checked as a run would be), closed afterwards."""
    from dit_train.config import validate
    from dit_train.train import Trainer

    validate(cfg, dist.world_size)
    trainer = Trainer(cfg, dist)
    try:
        yield trainer
    finally:
        trainer.logger.close()


def run_steps(trainer, n: int) -> list[tuple[dict, float]]:
    """n training steps from the trainer's current step: (metrics, seconds) each. Each step is read at once
    (take_deferred waits for the device), so its time is the step's own and its loss and grad norm are numbers."""
    out = []
    clock = trainer.timer.clock
    for x, y in trainer.batches(until=trainer.state.step + n):
        metrics = trainer.step_on(x, y, clock.mark())
        numbers = trainer.take_deferred()
        out.append(({**metrics, "train/loss": numbers.loss, "train/grad_norm": numbers.grad_norm},
                    numbers.step_time))
    return out


def free_device(device: torch.device) -> None:
    """After a stage: drop what it left (trainer, optimizer, compiled code) and return cached blocks to CUDA."""
    from dit_train.timing import set_active_timer

    set_active_timer(None)
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def start_memory(device: torch.device) -> float:
    """Reset the peak counter; GiB still allocated (left by earlier stages: counted in this stage's peak)."""
    if device.type != "cuda":
        return 0.0
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device) / GIB


def peak_memory(device: torch.device) -> tuple[float, float] | None:
    """(max allocated, max reserved) GiB since start_memory; None on CPU."""
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device) / GIB, torch.cuda.max_memory_reserved(device) / GIB


def device_seconds(fn, device: torch.device) -> float:
    """fn's time on the device: CUDA events around it on CUDA, perf_counter on CPU (synchronous there)."""
    if device.type != "cuda":
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


# ---- the memory estimate (a spawned process: it needs a fake process group of its own) ---------------------------
def estimate_peak_bytes(cfg_dict: dict, micro_batch: int, threads: int) -> int:
    """dit_train.memory_estimate.estimate of this configuration on one rank: its peak bytes."""
    from omegaconf import OmegaConf

    from dit_train.memory_estimate import estimate

    torch.set_num_threads(threads)
    return int(estimate(OmegaConf.create(cfg_dict), 1, micro_batch)["peak"]["total"])


def estimate_gib(setup: Setup, key) -> tuple[float | None, str | None]:
    """(GiB, None), or (None, why not) when the estimate failed."""
    future = setup.estimates.get(key)
    if future is None:
        return None, "no estimate was started for it"
    try:
        return future.result() / GIB, None
    except Exception as e:  # noqa: BLE001 - reported in the row
        return None, f"the estimate failed ({type(e).__name__}: {str(e).strip()[:200]})"


# ---- stages ---------------------------------------------------------------------------------------------------
def stage_gemm(setup: Setup) -> Row:
    """The device's GEMM rate in the compute dtype: square matmuls back to back, median of 5 rounds."""
    from dit_train.parallel import DTYPES

    n, device, dtype = setup.gemm_size, setup.device, DTYPES[setup.precision]
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    c = torch.empty(n, n, device=device, dtype=dtype)
    reps = 20 if device.type == "cuda" else 3

    def gemms():
        for _ in range(reps):
            torch.mm(a, b, out=c)

    gemms()  # warm-up: kernel selection
    seconds = statistics.median(device_seconds(gemms, device) for _ in range(5))
    setup.peak_flops = 2 * n**3 * reps / seconds
    ok = math.isfinite(setup.peak_flops) and setup.peak_flops > 0
    return Row("gemm", ok, tflops=setup.peak_flops / 1e12,
               detail=f"{n}x{n}x{n} {setup.precision} matmul: the MFU denominator")


def stage_ns5(setup: Setup) -> Row:
    """bench_distributed.ns5_speed over the model's matrix shapes, against the same-shape bmm and the GEMM stage."""
    from bench_distributed import ns5_speed

    cfg = compose(setup, "muon", "ns5")
    r = ns5_speed(cfg.model, setup.device, setup.ns5_repeats)
    flops = r["flops"]
    auto, plain, bmm = flops / r["auto_s"], flops / r["plain_s"], flops / r["gemm_s"]
    vs_peak = f", {auto / setup.peak_flops:.2f} x the gemm stage" if setup.peak_flops else ""
    matrices = sum(r["shapes"].values())
    ok = all(math.isfinite(v) and v > 0 for v in (auto, plain, bmm))
    return Row("ns5 (bf16)", ok, step_ms=r["auto_s"] * 1e3, tflops=auto / 1e12,
               detail=f"newton_schulz5 over {matrices} matrices ({flops / 1e9:.4g} GFLOP of plain iterations a pass): "
                      f"{auto / bmm:.2f} x the same-shape bf16 bmm ({bmm / 1e12:.3g} TFLOP/s){vs_peak}; "
                      f"plain iteration {plain / 1e12:.3g} TFLOP/s")


def training_row(setup: Setup, name: str, cfg, results, memory, baseline_gib: float, estimate_key) -> Row:
    """Step time, MFU, peak memory against the estimate, and what fails the stage."""
    losses = [m["train/loss"] for m, _ in results]
    skipped = sum(m["train/skipped"] for m, _ in results)
    step_s = statistics.median(t for _, t in results[1:])
    flops = setup.flops_per_image * cfg.train.batch_size
    est, est_error = estimate_gib(setup, estimate_key)
    failures, notes = [] if est_error is None else [est_error], []
    if not all(math.isfinite(v) for v in losses) or skipped:
        failures.append(f"non-finite losses {losses} ({skipped:.0f} skipped steps)")
    peak = None
    if memory is not None:
        peak, reserved = memory
        if peak > setup.memory_limit_gib:
            failures.append(f"peak {peak:.1f} GiB is over the {setup.memory_limit_gib} GiB of an 80 GB GPU")
        if est is not None and not 1 / ESTIMATE_TOLERANCE <= peak / est <= ESTIMATE_TOLERANCE:
            failures.append(f"peak / estimate {peak / est:.2f} is outside [{1 / ESTIMATE_TOLERANCE:.2f}, "
                            f"{ESTIMATE_TOLERANCE:.2f}]")
        notes.append(f"reserved {reserved:.1f} GiB")
        if baseline_gib > 0.25:
            notes.append(f"{baseline_gib:.2f} GiB were still allocated by earlier stages")
    detail = (f"{cfg.train.batch_size} images x {len(results)} steps (step time: median after the first), "
              f"{cfg.train.batch_size / step_s:.0f} images/s, loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    return Row(name, not failures, step_ms=step_s * 1e3, tflops=flops / step_s / 1e12,
               mfu=flops / step_s / setup.peak_flops if setup.peak_flops else None,
               peak_gib=peak, estimate_gib=est, detail="; ".join([detail, *notes, *failures]))


def stage_train(setup: Setup, optimizer: str) -> Row:
    """The optimizer's first step and a full period more (periodic_rowwise: K steps, so its refresh and its RowNorm
    steps are both timed), on a trainer of its own."""
    cfg = compose(setup, optimizer, f"train_{optimizer}")
    n = 1 + max(setup.steps, int(cfg.optimizer.get("K") or 1))
    baseline = start_memory(setup.device)
    with built_trainer(cfg, setup.dist) as trainer:
        results = run_steps(trainer, n)
    setup.first_losses[optimizer] = results[0][0]["train/loss"]
    return training_row(setup, f"train {optimizer}", cfg, results, peak_memory(setup.device), baseline,
                        (optimizer, False))


@contextlib.contextmanager
def deterministic_algorithms():
    """Kernels with a deterministic variant use it (CUDA: flash-attention backward among them); one without one
    raises, naming itself. (CUBLAS_WORKSPACE_CONFIG is set by gpu_check.py before CUDA starts.)"""
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before)


def _local_tensors(trainer) -> dict[str, torch.Tensor]:
    from dit_train.parallel import local

    named = [(f"model.{k}", p) for k, p in trainer.model.named_parameters()]
    named += [(f"ema.{k}", p) for k, p in trainer.ema.model.named_parameters()]
    return {k: local(p).detach() for k, p in named}


def stage_checkpoint(setup: Setup, optimizer: str, before: int = 2, after: int = 2) -> Row:
    """`before` steps, Trainer.save (DCP), `after` steps; then a new trainer resumes from that checkpoint
    (Trainer.resume, train.resume=<path>) and takes the same `after` steps: their losses, gradient norms and the
    final model and EMA weights must be bit-identical."""
    from dit_train import checkpoint as ckpt

    cfg = compose(setup, optimizer, "checkpoint")
    with deterministic_algorithms():
        with built_trainer(cfg, setup.dist) as trainer:
            run_steps(trainer, before)
            t0 = time.perf_counter()
            trainer.save()  # in the background on CUDA (train.async_checkpoint=auto): save_s is what training waits
            save_s = time.perf_counter() - t0
            trainer.saver.wait(trainer.state.step)
            path = ckpt.list_checkpoints(cfg.run_dir)[-1]
            expected = run_steps(trainer, after)
            reference = {k: t.cpu() for k, t in _local_tensors(trainer).items()}
        del trainer
        free_device(setup.device)
        resumed_cfg = compose(setup, optimizer, "checkpoint", extra=[f"train.resume={path}"])
        with built_trainer(resumed_cfg, setup.dist) as trainer:
            t0 = time.perf_counter()
            trainer.resume()
            load_s = time.perf_counter() - t0
            step = trainer.state.step
            got = run_steps(trainer, after)
            differ = [k for k, t in _local_tensors(trainer).items() if not torch.equal(t.cpu(), reference[k])]
    size = ckpt.folder_bytes(path) / GIB
    keys = ("train/loss", "train/grad_norm")
    same_metrics = all(a[0][k] == b[0][k] for a, b in zip(expected, got) for k in keys)
    problems = []
    if step != before:
        problems.append(f"resumed at step {step}, not {before}")
    if not same_metrics:
        problems.append("losses / grad norms differ: " + ", ".join(
            f"{a[0]['train/loss']!r} vs {b[0]['train/loss']!r}" for a, b in zip(expected, got)))
    if differ:
        problems.append(f"{len(differ)} of {len(reference)} tensors differ, first {differ[0]}")
    detail = (f"{optimizer}: saved at step {before} ({size:.2f} GiB in {save_s:.1f} s), resumed in {load_s:.1f} s; "
              f"the next {after} steps' losses, grad norms and {len(reference)} model + EMA tensors "
              f"{'bit-identical' if not problems else 'NOT bit-identical'} (deterministic algorithms on)")
    return Row("checkpoint (DCP save + resume)", not problems, detail="; ".join([detail, *problems]))


def stage_compile_checkpointing(setup: Setup, optimizer: str) -> Row:
    """parallel.compile + parallel.activation_checkpointing: the first step (compilation) and `steps` more; its
    first loss against the eager stage of the same optimizer (same weights, batch and noise)."""
    cfg = compose(setup, optimizer, "compile_ac", checkpointing=True, compiled=True)
    baseline = start_memory(setup.device)
    with built_trainer(cfg, setup.dist) as trainer:
        results = run_steps(trainer, 1 + setup.steps)
    row = training_row(setup, f"compile + AC ({optimizer})", cfg, results, peak_memory(setup.device), baseline,
                       (optimizer, True))
    row.detail += f"; first step (compiling) {results[0][1]:.1f} s"
    eager, first = setup.first_losses.get(optimizer), results[0][0]["train/loss"]
    if eager is None:
        row.ok = False
        row.detail += f"; no eager first loss to compare with (the train {optimizer} stage failed)"
    else:
        rel = abs(first - eager) / abs(eager)
        close = rel <= LOSS_RTOL[setup.precision]
        row.ok = row.ok and close
        row.detail += (f"; first loss {first:.6f} vs eager {eager:.6f} (relative {rel:.1e}, "
                       f"{'within' if close else 'OVER'} {LOSS_RTOL[setup.precision]:g})")
    return row
