"""The stages of the GPU check (benchmarks/gpu_check.py runs one per process). Each takes the stage's Context and returns
{"checks": [...], "values": {...}}: every check is what was measured next to the threshold or prediction it is held
against (`ok` None: reported, not judged). A stage's work is sized to its deadline (Context.left)."""

from __future__ import annotations

import contextlib
import math
import os
import statistics
import time
import warnings
from collections import defaultdict

import torch

from benchmarks.cost_model.predict import describe_prediction
from benchmarks.gpu_check import (OPTIMIZER, ROOT, SHARD_OVERRIDES, SHARD_RUNS, SMOKE_MODEL, SMOKE_SHARD_BATCH, SMOKE_TRAINER,
                       TRAINER_BATCH)
from dit_train.config.override_text import override

GIB = 1024**3
# first-step loss of compile + activation checkpointing against the eager stage: same weights, batch and noise
LOSS_RTOL = {"bf16": 2e-2, "fp32": 1e-4}
# the measured bf16 GEMM rate must reach this share of the data sheet's dense peak (H100/H200: ~0.7-0.8 expected)
GEMM_MIN_OF_SPEC = 0.5
# dense bf16 tensor-core peaks (TFLOP/s, NVIDIA data sheets, no sparsity), the MFU denominator; first match wins
SPEC_BF16_TFLOPS = (("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("GH200", 989.4), ("H200", 989.4), ("H100", 989.4),
                    ("H800", 989.4), ("B200", 2250.0), ("A100", 312.0), ("L40S", 362.0))
# loss of a step after resume against the same step before: closer than this is the kernels' nondeterminism
RESUMED_LOSS_RTOL = 1e-3
# NS5 forms: the automatic choice (Gram at c >= 2r) must be within this of the faster form at batch 8
NS5_CHOICE_SLACK = 1.10
# host reads per training step: Trainer.step_flags' one read (docs/algorithms.md, "Host synchronisation")
EXPECTED_SYNCS_PER_STEP = 1


def check(what: str, measured, expected: str, ok: bool | None) -> dict:
    return {"what": what, "measured": measured, "expected": expected, "ok": ok}


def device_for(ctx) -> torch.device:
    if ctx.smoke:
        torch.set_num_threads(1)  # tiny matrices: a second intra-op thread only adds synchronisation
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device is visible (torch.cuda.is_available() is False); run with --cpu-smoke "
                           "to check the check on CPU")
    return torch.device("cuda", 0)


def spec_peak(device: torch.device) -> tuple[float | None, str]:
    """(dense bf16 FLOP/s of the data sheet, the device's name); None for a device not in the table."""
    if device.type != "cuda":
        return None, "CPU"
    name = torch.cuda.get_device_name(device)
    for key, tflops in SPEC_BF16_TFLOPS:
        if key in name:
            return tflops * 1e12, name
    return None, name


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


def gemm_rate(ctx) -> tuple[float | None, str]:
    """The env stage's measured GEMM rate (FLOP/s), or (None, why)."""
    env = ctx.previous("env")
    rate = (env or {}).get("values", {}).get("gemm_flops")
    return (rate, "") if rate else (None, "no GEMM rate: the env stage did not measure one")


# ---- env ------------------------------------------------------------------------------------------------------
SDPA_OPS = {"_scaled_dot_product_flash_attention": "flash", "_scaled_dot_product_cudnn_attention": "cudnn",
            "_scaled_dot_product_efficient_attention": "efficient",
            "_scaled_dot_product_flash_attention_for_cpu": "flash (CPU)",
            "_scaled_dot_product_attention_math": "math", "_scaled_dot_product_fused_attention_overrideable": "other"}


def sdpa_backends(q, k, v) -> list[str]:
    """The SDPA kernels forward and backward actually ran, from the profiler's aten ops."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.nn.functional.scaled_dot_product_attention(q, k, v).float().sum().backward()
    seen = set()
    for event in prof.events():
        name = event.name.removeprefix("aten::")
        for op, backend in SDPA_OPS.items():
            if name == op or name == op + "_backward":
                seen.add(backend)
    return sorted(seen)


def stage_env(ctx) -> dict:
    import platform

    from dit_train.parallel.fsdp import init_distributed

    device = device_for(ctx)
    init_distributed(device=device)  # the trainer's device set-up (TF32 for what fp32 work remains)
    peak, name = spec_peak(device)
    values = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
              "device": name, "spec_bf16_flops": peak}
    checks = []
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        values.update(cudnn=torch.backends.cudnn.version(), capability=f"{props.major}.{props.minor}",
                      memory_gib=round(props.total_memory / GIB, 1))
    # SDPA at dit_15b's attention: 32 heads of 128 over 256 tokens, bf16 on CUDA (fp32 on the CPU smoke test)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    batch = 8 if device.type == "cuda" else 1
    q, k, v = (torch.randn(batch, 32, 256, 128, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    used = sdpa_backends(q, k, v)
    values["sdpa_backends"] = used
    checks.append(ctx.record(check("SDPA kernel at head dim 128 (forward + backward)",
                        ", ".join(used) or "none seen by the profiler (not judged)",
                        "a fused kernel (flash / cudnn / efficient), not math", "math" not in used if used else None)))
    # the GEMM rate in the compute dtype: square matmuls back to back, median of 5 rounds
    n = 8192 if device.type == "cuda" else 256
    reps = 20 if device.type == "cuda" else 3
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    c = torch.empty(n, n, device=device, dtype=dtype)

    def gemms():
        for _ in range(reps):
            torch.mm(a, b, out=c)

    gemms()  # warm-up: kernel selection
    rate = 2 * n**3 * reps / statistics.median(device_seconds(gemms, device) for _ in range(5))
    values["gemm_flops"] = rate
    if peak:
        checks.append(check(f"{n}^3 {str(dtype)[6:]} GEMM rate", f"{rate / 1e12:.0f} TFLOP/s = "
                            f"{rate / peak:.2f} x spec {peak / 1e12:.0f}", f">= {GEMM_MIN_OF_SPEC} x spec",
                            rate >= GEMM_MIN_OF_SPEC * peak))
    else:
        checks.append(check(f"{n}^3 {str(dtype)[6:]} GEMM rate", f"{rate / 1e12:.3g} TFLOP/s",
                            f"finite (no spec peak known for {name})", math.isfinite(rate) and rate > 0))
    return {"checks": checks, "values": values}


# ---- ns5 ------------------------------------------------------------------------------------------------------
def matrix_shapes(model_cfg) -> dict[tuple[int, int], int]:
    """Shape -> count of the matrices the matrix optimizers route to NS5 in this model."""
    from dit_train.model.dit import build_model
    from dit_train.optim.routing import route_parameters

    shapes = defaultdict(int)
    for _, p in route_parameters(build_model(model_cfg, device="meta")).matrix:
        shapes[tuple(p.shape)] += 1
    return dict(shapes)


NS5_PRESETS = ("dit_15b", "dit_1b3")


def stage_ns5(ctx) -> dict:
    from dit_train.model.dit import load_preset
    from dit_train.optim.directions import gram_flop_ratio, newton_schulz5, ns5_flops, uses_gram

    device = device_for(ctx)
    # dit_15b's shapes (r = 256 and 4096), then dit_1b3's (r = 256 and 1536): where between 256 and 4096 the Gram
    # form starts to pay on a GPU (at 4096x256 it did not: 1.07-1.12 x the plain time at batch 8, 2026-12-04)
    shapes = []
    for preset in NS5_PRESETS:
        cfg = load_preset(preset)
        if ctx.smoke:
            cfg.hidden_size, cfg.num_heads, cfg.depth = 64, 2, 2
        shapes += [s for s in sorted(matrix_shapes(cfg)) if s not in shapes]
    rate, why = gemm_rate(ctx)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    checks, values = [], {"shapes": [list(s) for s in shapes], "runs": []}
    for m, n in shapes:
        auto = "gram" if uses_gram(m, n) else "plain"
        parts, times = [], {}
        for batch in (1, 8):
            if ctx.left() < 2:
                ctx.notes.append(f"stopped before {m}x{n} batch {batch}: the stage's time was spent")
                break
            X = torch.randn(batch, m, n, device=device, dtype=torch.bfloat16)
            times = {}
            for form, gram in (("plain", False), ("gram", True)):
                ws = {}
                newton_schulz5(X, gram=gram, workspace=ws)  # warm-up: kernel selection, workspace
                sync()
                times[form] = statistics.median(
                    device_seconds(lambda: newton_schulz5(X, gram=gram, workspace=ws), device) for _ in range(3))
            del X
            tf = {f: batch * ns5_flops(m, n) / t for f, t in times.items()}
            values["runs"].append({"batch": batch, "shape": [m, n], "plain_s": times["plain"],
                                   "gram_s": times["gram"], "auto": auto})
            parts.append(f"b{batch}: plain {tf['plain'] / 1e12:.3g}, gram {tf['gram'] / 1e12:.3g} TFLOP/s"
                         + (f" ({tf[auto] / rate:.2f} x GEMM)" if rate else ""))
        if not parts:
            break
        # judged on the GPU at batch 8 (a bucket of same-shape matrices): the case the automatic choice is for
        judged = device.type == "cuda" and len(parts) == 2
        best = min(times, key=times.get)
        measured = "; ".join(parts) + (f"; gram/plain {times['gram'] / times['plain']:.2f} (flops predict "
                                       f"{gram_flop_ratio(m, n):.2f})")
        checks.append(ctx.record(check(f"NS5 {m}x{n} (automatic: {auto}), plain-iteration flops", measured,
                            f"{auto} within {NS5_CHOICE_SLACK:g} x the faster form at b8" if judged else "reported",
                            times[auto] <= NS5_CHOICE_SLACK * times[best] if judged else None)))
    if not rate:
        ctx.notes.append(why)
    if not values["runs"]:
        checks.append(check("NS5 runs", "none", "at least one", False))
    return {"checks": checks, "values": values}


# ---- every optimizer on the device -------------------------------------------------------------------------------
# (optimizer config, how) pairs: every optimizer, and the sharded implementation's placements (owner and gather
# exchanges, and the exchange started in backward, whose CUDA branch records its buffers on the current stream)
OPTIMIZER_RUNS = (({"name": "adamw"}, "both"), ({"name": "muon"}, "both"),
                  ({"name": "periodic_rowwise", "K": 2}, "both"), ({"name": "rownorm"}, "both"),
                  ({"name": "mud"}, "both"), ({"name": "muon", "distributed_mode": "gather"}, "sharded"),
                  ({"name": "periodic_rowwise", "K": 2, "overlap_exchange": True}, "sharded"),
                  ({"name": "periodic_rowwise", "K": 2, "distributed_mode": "gather", "overlap_exchange": True},
                   "sharded"))
OPTIMIZER_WORLD = 8


def stage_optimizers(ctx) -> dict:
    """Every optimizer's first two steps (a refresh and, for periodic_rowwise K=2, a RowNorm step) after a bf16
    forward + backward, at dit_15b's matrix shapes with 2 blocks: on one process (real values: the weights must stay
    finite and the state must live with the parameters), and on rank 0 of 8 FSDP2 ranks whose peers are a fake
    process group (values arbitrary: it must run). Every branch the device type decides runs here."""
    from dit_train.parallel.memory_estimate import empty_all_to_all_inputs_allowed, init_fake_process_group
    from dit_train.model.dit import build_model, load_preset
    from dit_train.optim.registry import build_optimizer
    from dit_train.parallel.fsdp import ParallelPlan, autocast, fsdp_mesh, init_distributed, local, parallelize

    device = device_for(ctx)
    init_distributed(device=device)
    cfg = load_preset("dit_15b", depth=2)
    if ctx.smoke:
        cfg.hidden_size, cfg.num_heads = 64, 2
    precision = "bf16"
    m = cfg
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(2, m.in_channels, m.image_size, m.image_size, device=device, generator=gen)
    t = torch.rand(2, device=device, generator=gen)
    y = torch.randint(0, m.num_classes, (2,), device=device, generator=gen)

    def fill(model):
        with torch.no_grad():
            for p in model.parameters():
                local(p).normal_(0.0, 0.02, generator=gen)
        return model

    def two_steps(model, opt_cfg) -> str:
        opt = build_optimizer(model, opt_cfg)
        for _ in range(2):
            with autocast(precision, device):
                loss = model(x, t, y=y).float().square().mean()
            loss.backward()
            told = getattr(opt, "gradients_scaled", None)
            if callable(told):
                told(False)
            opt.step()
            opt.zero_grad(set_to_none=True)
        wrong = [(tuple(v.shape), v.device, v.dtype) for st in opt.state.values() for v in st.values()
                 if isinstance(v, torch.Tensor) and v.dim() > 0 and local(v).device != device]
        return type(opt).__name__ + (f"; state off the device: {wrong[:2]}" if wrong else "")

    checks = []
    ctx.phase("building dit_15b's shapes with 2 blocks, one process")
    plain = build_model(cfg, device="meta").to_empty(device=device)  # filled on the device: no host init
    plain.reset_buffers()
    for opt_cfg, how in OPTIMIZER_RUNS:
        if how != "both":
            continue
        if ctx.left() < 2:
            ctx.notes.append("stopped before every one-process optimizer ran: the stage's time was spent")
            break
        label = ", ".join(f"{k}={v}" for k, v in opt_cfg.items() if k != "name")
        fill(plain)
        what = f"{opt_cfg['name']}{' (' + label + ')' if label else ''}, one process"
        ctx.phase(f"{what}: 2 steps (a first RowNorm step compiles its passes on CUDA)")
        try:
            kind = two_steps(plain, opt_cfg)
            finite = all(bool(torch.isfinite(p).all()) for p in plain.parameters())
            ok = finite and "off the device" not in kind
            checks.append(ctx.record(check(what, f"{kind}: weights {'finite' if finite else 'NOT finite'}",
                                "2 steps, finite weights, state on the device", ok)))
        except Exception as e:  # noqa: BLE001 - the next optimizer is still worth running
            checks.append(ctx.record(check(what, f"{type(e).__name__}: {str(e).strip()[:200]}", "2 steps", False)))
    del plain
    ctx.phase(f"building the rank 0 of {OPTIMIZER_WORLD} FSDP2 model (a fake process group)")
    init_fake_process_group(OPTIMIZER_WORLD)
    plan = ParallelPlan(sharded=True, param_dtype=torch.bfloat16)
    mesh = fsdp_mesh(plan, device.type)
    sharded = parallelize(build_model(cfg, device="meta"), plan, mesh=mesh)
    sharded.to_empty(device=device)
    sharded.reset_buffers()
    for opt_cfg, _ in OPTIMIZER_RUNS:
        if ctx.left() < 2:
            ctx.notes.append("stopped before every sharded optimizer ran: the stage's time was spent")
            break
        label = ", ".join(f"{k}={v}" for k, v in opt_cfg.items() if k != "name")
        what = f"{opt_cfg['name']}{' (' + label + ')' if label else ''}, rank 0 of {OPTIMIZER_WORLD}"
        ctx.phase(f"{what}: 2 steps")
        fill(sharded)
        try:
            with empty_all_to_all_inputs_allowed():
                kind = two_steps(sharded, opt_cfg)
            checks.append(ctx.record(check(what, kind, "2 steps, state on the device", "off the device" not in kind)))
        except Exception as e:  # noqa: BLE001
            checks.append(ctx.record(check(what, f"{type(e).__name__}: {str(e).strip()[:200]}", "2 steps", False)))
    return {"checks": checks, "values": {}}


# ---- dit_15b as rank 0 of W: real tensors, fake process group -----------------------------------------------------
# what c10 warns at each synchronising call under set_sync_debug_mode("warn"); setting the mode warns too, that it
# is a prototype ("Synchronization debug mode ..."), which the second and third GPU runs counted as a sync in
# every dit_15b stage (1.33 per step over 3 steps of 1 each)
SYNC_WARNING = "called a synchronizing cuda operation"


@contextlib.contextmanager
def sync_warnings(sink: list):
    """Every "synchronizing CUDA operation" warning inside (torch.cuda.set_sync_debug_mode 'warn' issues one per
    synchronising call), appended to `sink` as the innermost frame of this repository's code outside the check that
    made it (path:line); other warnings are shown as usual."""
    import threading
    import traceback

    def show(message, category, filename, lineno, file=None, line=None):
        if SYNC_WARNING not in str(message).lower():  # not one of set_sync_debug_mode's own words (its start)
            return previous(message, category, filename, lineno, file, line)
        check_itself = os.path.join(ROOT, "benchmarks", "gpu_check")
        ours = [f for f in traceback.extract_stack()[:-1] if f.filename.startswith(ROOT + os.sep)
                and not f.filename.startswith(check_itself)]
        if ours:
            sink.append(f"{os.path.relpath(ours[-1].filename, ROOT)}:{ours[-1].lineno}")
            return
        # none of ours on this thread's stack (the first GPU runs' one unplaced sync a stage, at
        # torch/cuda/__init__.py, AC stages only): the thread and the innermost frames say who called it
        inner = " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}"
                            for f in reversed(traceback.extract_stack()[:-1][-4:]))
        sink.append(f"{filename}:{lineno} (thread {threading.current_thread().name}: {inner})")

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        previous = warnings.showwarning
        warnings.showwarning = show
        try:
            yield
        finally:
            warnings.showwarning = previous


@contextlib.contextmanager
def counting_host_syncs(device: torch.device, sink: list):
    """The synchronising CUDA calls inside, in `sink` (sync_warnings); nothing on CPU."""
    if device.type != "cuda":
        yield
        return
    with sync_warnings(sink):
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode("default")


def sharded_step(model, ema, optimizer, scheduler, cfg, noise_of, x, y) -> None:
    """Trainer.train_step's work on one batch (train.py) with what needs real peers left out: the noise of the
    global batch, forward/backward under the run's autocast, clipping, the loss/vote all-reduce and its one host
    read (Trainer.step_flags, whose answer is not used: the fake peers make every value arbitrary), the update,
    the EMA, zero_grad and the schedule."""
    from dit_train.diffusion.flow import velocity_loss
    from dit_train.parallel.fsdp import all_reduce_sum_, autocast, clip_grads_, clip_scaled, global_grad_norm
    from dit_train.trainer.loop import Trainer

    t, eps, drop = noise_of(x)
    with autocast(cfg.train.precision, x.device):
        loss = velocity_loss(model, x, t, eps, drop_mask=drop, y=y)
    loss.backward()
    max_norm = cfg.train.grad_clip if cfg.train.grad_clip > 0 else math.inf
    grad_norm = global_grad_norm(model.parameters())
    votes = all_reduce_sum_(torch.stack([loss.detach().float(), torch.zeros((), device=loss.device)]))
    Trainer.step_flags(torch.isfinite(votes[0]) & torch.isfinite(grad_norm), votes[1], clip_scaled(grad_norm, max_norm))
    clip_grads_(model.parameters(), max_norm, grad_norm)  # as a clipped step does (the trainer skips it unscaled)
    optimizer.step()
    ema.update(model)
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()


def stage_dit15b(ctx) -> dict:
    """dit_15b's rank 0 of W ranks on real device tensors, the peers a fake process group (its collectives return
    at once, their outputs unfilled): memory and compute of one rank of the real job, without the network."""
    from types import SimpleNamespace

    from dit_train import seeds
    from dit_train.trainer.build import build_models
    from dit_train.parallel.memory_estimate import empty_all_to_all_inputs_allowed, init_fake_process_group, steps_for
    from dit_train.model.flops import training_flops_per_image
    from dit_train.optim.registry import build_optimizer
    from dit_train.parallel.fsdp import DistInfo, init_distributed, local, resolve_plan
    from dit_train.optim.schedule import build_scheduler
    from dit_train.telemetry.clocks import clock_for
    from dit_train.trainer.loop import Trainer

    world, ac, _ = SHARD_RUNS[ctx.name]
    device = device_for(ctx)
    cfg, _, batch, _ = prediction_inputs(ctx)  # the batch: SHARD_RUNS's, or the smoke test's
    init_distributed(device=device)  # the trainer's device set-up, no process group (WORLD_SIZE is 1)
    # the peers are fake: no network, so the prediction is of one rank's compute (FSDP and exchange bytes free);
    # counted on its own fake process group (cost_model.sharded.sharded_optimizer), so before this stage's is made
    predicted = prediction(ctx, cfg, world, batch, device, network=False)
    ctx.phase(f"building dit_15b as rank 0 of {world} on {device}")
    init_fake_process_group(world)
    info = DistInfo(rank=0, world_size=world, device=device)
    plan = resolve_plan(cfg.parallel, info)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    model, ema = build_models(cfg, plan, device, initialise=False)
    with torch.no_grad():  # any weights do: the seeded init is the host's work, not what is measured here
        gen = torch.Generator(device=device).manual_seed(0)
        for p in model.parameters():
            local(p).normal_(0.0, 0.02, generator=gen)
        ema.copy_from(model)
    optimizer = build_optimizer(model, cfg.optimizer)
    tc = cfg.train
    scheduler = build_scheduler(optimizer, tc.steps, tc.warmup_steps, tc.lr_schedule, tc.min_lr_ratio)
    trainer = SimpleNamespace(dist=info, cfg=cfg, state=SimpleNamespace(
        generator=seeds.generator("train_noise", cfg.seed, device=device)))
    noise_of = lambda x: Trainer.global_batch_noise(trainer, x)  # noqa: E731
    m = cfg.model
    x = torch.randn(batch, m.in_channels, m.image_size, m.image_size, device=device)
    y = torch.randint(0, m.num_classes, (batch,), device=device)
    clock = clock_for(device)

    def step():
        # owner mode's all-to-all with nothing of this rank's own to send: the fake group refuses it, a real one not
        with empty_all_to_all_inputs_allowed():
            sharded_step(model, ema, optimizer, scheduler, cfg, noise_of, x, y)

    # untimed: the first step (a refresh; it also allocates the state) and the first RowNorm step (on CUDA it
    # compiles the RowNorm passes, optim/fused_rownorm.py: tens of seconds cold, once per process); then the timed
    # steps, K = 3 of them (RowNorm, refresh, RowNorm: one cycle's mix, as the estimate's K + 1 steps hold), each
    # only while another fits before the deadline, the first too: both kinds of step have run by then, so the peak
    # is measured, and a timed step past the timeout would have the stage killed with it unwritten (dit15b_w8_ac's
    # 128 images a step take seconds each)
    n = steps_for(cfg.optimizer)

    def untimed_step(what: str) -> float:
        ctx.phase(what)
        t0 = time.monotonic()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.monotonic() - t0

    first_s = untimed_step("step 1 (refresh; allocates the optimizer state)")
    first_rownorm_s = untimed_step("step 2 (the first RowNorm step: compiles its passes on CUDA)")
    syncs, marks = [], [clock.mark()]
    ctx.phase(f"steps 3-{n + 1} (timed, host syncs counted)")
    syncs_per_step = []
    with counting_host_syncs(device, syncs):
        for i in range(1, n):
            if ctx.left() < 1.5 * first_s:
                ctx.notes.append(f"took {i - 1} of {n - 1} timed steps: the stage's time was spent")
                break
            before = len(syncs)
            step()
            marks.append(clock.mark())
            syncs_per_step.append(len(syncs) - before)
    clock.wait()
    step_s = [clock.seconds(a, b) for a, b in zip(marks, marks[1:])]
    taken = len(step_s)
    mean_s = sum(step_s) / taken if taken else None
    flops = training_flops_per_image(m) * batch
    label = f"dit_15b rank 0 of {world}, {batch} images/rank, AC {'on' if ac else 'off'}"
    values = {"world": world, "activation_checkpointing": ac, "micro_batch": batch, "step_s": step_s,
              "first_step_s": first_s, "first_rownorm_step_s": first_rownorm_s, "flops_per_step": flops,
              "prediction": ctx.prediction}
    peak_spec, name = spec_peak(device)
    ctx.phase("checks")
    timed = (f"steps 3..{taken + 2}" if taken else "steps 3..") + ": RowNorm, refresh, RowNorm"
    checks = [check(f"{label}: compute-only step time ({timed})",
                    " / ".join(f"{s * 1e3:.0f}" for s in step_s) + " ms" if taken else
                    f"no timed step: the stage's time was spent (step 1 took {first_s:.1f} s)",
                    "reported; " + predicted, None),
              check("first RowNorm step (its passes compile on CUDA, once per process)",
                    f"{first_rownorm_s:.1f} s", "reported (a run's one-off cost)", None)]
    if taken and peak_spec:
        mfu = flops / mean_s / peak_spec
        values["mfu_spec"] = mfu
        checks.append(check("MFU (model FLOPs / cycle-mean step time / spec peak)",
                            f"{mfu:.1%} of {peak_spec / 1e12:.0f} TFLOP/s", "reported (first measurement)", None))
    elif taken:
        values["achieved_flops"] = flops / mean_s
        checks.append(check("achieved model FLOP/s", f"{flops / mean_s / 1e12:.3g} TFLOP/s",
                            f"reported (no spec peak for {name})", None))
    checks += memory_checks(ctx, device, values)
    if device.type == "cuda" and not taken:
        checks.append(check("host syncs per step (torch.cuda.set_sync_debug_mode)", "not counted: no timed step",
                            f"<= {EXPECTED_SYNCS_PER_STEP} (Trainer.step_flags)", None))
    elif device.type == "cuda":
        per_step = len(syncs) / taken
        values["host_syncs"], values["host_syncs_per_step"] = syncs, syncs_per_step
        where = ", ".join(sorted(set(syncs)))
        checks.append(check("host syncs per step (torch.cuda.set_sync_debug_mode)", f"{per_step:g} (steps: "
                            f"{', '.join(map(str, syncs_per_step))})" + (f" at {where}" if where else ""), f"<= {EXPECTED_SYNCS_PER_STEP} (Trainer.step_flags)",
                            per_step <= EXPECTED_SYNCS_PER_STEP))
    return {"checks": checks, "values": values}


def memory_checks(ctx, device: torch.device, values: dict, compiled: bool = False) -> list[dict]:
    """The process's peak allocated and reserved bytes against the background estimate of the same configuration
    (judged now if it has finished, else when the table is made: gpu_check_table.settle)."""
    from benchmarks.gpu_check_table import memory_check

    memory = {}
    if device.type == "cuda":
        memory = {"allocated_gib": torch.cuda.max_memory_allocated(device) / GIB,
                  "reserved_gib": torch.cuda.max_memory_reserved(device) / GIB,
                  "device_gib": torch.cuda.get_device_properties(device).total_memory / GIB,
                  **({"upper_only": True} if compiled else {})}
    values["memory"] = memory
    return [memory_check(ctx.results_dir, ctx.name, memory)]


# ---- dit_1b3 through the trainer ----------------------------------------------------------------------------------
def trainer_config(ctx, name: str, checkpointing: bool = False, compiled: bool = False, extra=()):
    """The run config of a trainer stage: dit_1b3 (the smoke test: 64 wide, 2 deep) on synthetic latents of its
    shape, FSDP2 on a group of one, bf16 (smoke: fp32), no evaluation beyond a token validation set."""
    from hydra import compose as hcompose
    from hydra import initialize_config_dir

    import dit_train  # noqa: F401 - registers the config schemas that conf/config.yaml names

    B = TRAINER_BATCH["smoke" if ctx.smoke else "gpu"]
    p = "fp32" if ctx.smoke else "bf16"
    work = os.path.join(ctx.work_dir, name)
    with initialize_config_dir(config_dir=os.path.join(ROOT, "dit_train", "conf"), version_base="1.3"):
        return hcompose(config_name="config", overrides=[
            "model=dit_1b3", *(SMOKE_TRAINER if ctx.smoke else []), f"optimizer={OPTIMIZER}", "optimizer.K=3",
            "data=synthetic", "data.image_size=${model.image_size}", "data.channels=${model.in_channels}",
            "data.num_classes=${model.num_classes}", f"data.num_samples={B * 16}", override("run_dir", work),
            f"train.batch_size={B}", "train.steps=1000", "train.warmup_steps=10", f"train.precision={p}",
            "train.progress=false", f"train.val_samples={B}", f"train.val_batch_size={B}", "eval.every_n_steps=0",
            "parallel.fsdp=true", f"parallel.mixed_precision={p}",
            f"parallel.activation_checkpointing={str(checkpointing).lower()}",
            f"parallel.compile={str(compiled).lower()}", *extra])


@contextlib.contextmanager
def built_trainer(cfg, dist):
    """The trainer of `cfg` (checked as a run would be), closed afterwards."""
    from dit_train.config import validate
    from dit_train.trainer.loop import Trainer

    validate(cfg, dist.world_size)
    trainer = Trainer(cfg, dist)
    try:
        yield trainer
    finally:
        trainer.logger.close()


def run_steps(trainer, n: int, ctx=None, min_steps: int = 2) -> list[tuple[dict, float]]:
    """Up to n training steps from the trainer's current step: (metrics, seconds) each; each is read at once
    (take_deferred waits for the device), so its time is the step's own. With `ctx`, steps stop once another would
    pass the stage's deadline (after `min_steps`)."""
    out = []
    clock = trainer.timer.clock
    for x, y in trainer.batches(until=trainer.state.step + n):
        if ctx is not None and len(out) >= min_steps and ctx.left() < 2 * max(t for _, t in out[2:] or out[1:] or out):
            ctx.notes.append(f"took {len(out)} of {n} steps: the stage's time was spent")
            break
        if ctx is not None:
            ctx.phase(f"step {trainer.state.step + 1}")
        metrics = trainer.step_on(x, y, clock.mark())
        numbers = trainer.take_deferred()
        out.append(({**metrics, "train/loss": numbers.loss, "train/grad_norm": numbers.grad_norm},
                    numbers.step_time))
    return out


def trainer_dist(ctx):
    from dit_train.parallel.fsdp import init_distributed

    return init_distributed(single_process_group=True, device=device_for(ctx))


def trainer_prediction(ctx, cfg, device: torch.device) -> str:
    """The cost model's step time for a trainer stage's configuration on this device, counted before the steps
    (unless the background job has: predict_in_background): it belongs to the part of the stage its deadline
    sizes, not to the margin left for writing its line."""
    return prediction(ctx, cfg, 1, cfg.train.batch_size, device)


def prediction_inputs(ctx):
    """(config, world, images per rank, network) of the prediction a stage compares its step time with, or None
    for a stage that makes none: one declaration for the stage and for predict_in_background."""
    if ctx.name in SHARD_RUNS:
        from dit_train.parallel.memory_estimate_cli import compose as estimate_config

        world, ac, batch = SHARD_RUNS[ctx.name]
        cfg = estimate_config("dit_15b", OPTIMIZER, ac, [*SHARD_OVERRIDES, *(SMOKE_MODEL if ctx.smoke else [])])
        return cfg, world, SMOKE_SHARD_BATCH if ctx.smoke else batch, False
    if ctx.name in TRAINER_CONFIGS:
        cfg = trainer_config(ctx, *TRAINER_CONFIGS[ctx.name])
        return cfg, 1, cfg.train.batch_size, True
    return None


def checkpointing(cfg) -> bool:
    """Whether the configuration recomputes its blocks' forward in backward: the H200 profile prices it
    (cost_model/compute.py); compiling is not among the prediction's arguments."""
    return bool(cfg.parallel.activation_checkpointing)


def prediction_key(cfg, world: int, batch: int, device_name: str, network: bool) -> str:
    """The digest of describe_prediction's arguments: a prediction counted once serves every stage with the same."""
    import hashlib
    import json

    from omegaconf import OmegaConf

    args = [world, batch, device_name, network, checkpointing(cfg), *(OmegaConf.to_container(c, resolve=True)
                                                  if OmegaConf.is_config(c) else c for c in (cfg.model, cfg.optimizer))]
    return hashlib.sha1(json.dumps(args, sort_keys=True, default=str).encode()).hexdigest()[:16]


def counted_predictions(results_dir: str) -> dict[str, dict]:
    """key -> {"stage", "by", "key", "text"} of every prediction counted so far (predictions.jsonl: the background
    job's, predict_in_background, and those a stage counted itself)."""
    from benchmarks.gpu_check_table import PREDICTIONS, json_lines

    return {row["key"]: row for row in json_lines(os.path.join(results_dir, PREDICTIONS))
            if isinstance(row.get("key"), str) and isinstance(row.get("text"), str)}


def count_prediction(results_dir: str, stage: str, by: str, key: str, cfg, world: int, batch: int,
                     device_name: str, network: bool) -> dict:
    """describe_prediction of the configuration (`key`: its prediction_key), appended to predictions.jsonl (the
    record the table reads, and what a stage or the background job with the same arguments finds instead of
    counting again)."""
    from benchmarks.gpu_check_table import PREDICTIONS, append_row

    row = {"stage": stage, "by": by, "key": key,
           "text": describe_prediction(cfg.model, cfg.optimizer, world, batch, device_name, network=network,
                                       activation_checkpointing=checkpointing(cfg))}
    append_row(results_dir, row, PREDICTIONS)
    return row


def prediction(ctx, cfg, world: int, batch: int, device: torch.device, network: bool = True) -> str:
    """describe_prediction of this configuration: the background job's (gpu_check.sh starts it with the stages; its
    CPU seconds overlap the GPU's work), else counted here (seconds of CPU on a GPU machine, out of the stage's
    timeout). The arguments' digest and the text go into ctx.prediction, which the stage puts in its values."""
    name = spec_peak(device)[1]
    key = prediction_key(cfg, world, batch, name, network)
    row = counted_predictions(ctx.results_dir).get(key)
    if row is not None:
        ctx.phase(f"the cost model's prediction: counted by {row.get('by', 'the background job')}")
    else:
        ctx.phase("the cost model's prediction (counts a step on fake tensors, CPU)")
        row = count_prediction(ctx.results_dir, ctx.name, f"the {ctx.name} stage", key, cfg, world, batch, name,
                               network)
    ctx.prediction = {"key": key, "text": row["text"]}
    return row["text"]


def predict_in_background(results_dir: str, device_name: str, stages: list[str], smoke: bool) -> None:
    """Every prediction the stages will ask for, counted on the CPU while the GPU runs the stages before them (run
    with no CUDA device visible: it must not take GPU memory), each appended to predictions.jsonl as it is
    counted. A stage that finds none there counts its own (prediction), as when this job has not got to it."""
    import tempfile
    from types import SimpleNamespace

    with tempfile.TemporaryDirectory() as work:
        for name in stages:
            inputs = prediction_inputs(SimpleNamespace(name=name, smoke=smoke, work_dir=work))
            if inputs is None:
                continue
            cfg, world, batch, network = inputs
            key = prediction_key(cfg, world, batch, device_name, network)
            if key in counted_predictions(results_dir):
                continue
            row = count_prediction(results_dir, name, "the background job", key, cfg, world, batch, device_name,
                                   network)
            print(f"{name}: {row['text']}", flush=True)


def trainer_checks(ctx, cfg, results, label: str, predicted: str, compiled: bool = False) -> tuple[list[dict], dict]:
    from dit_train.model.flops import training_flops_per_image

    device = torch.device(ctx.device_type)
    losses = [m["train/loss"] for m, _ in results]
    skipped = sum(m["train/skipped"] for m, _ in results)
    # steps 3.. (RowNorm, refresh, RowNorm: a K = 3 cycle's mix); the first compiles what is compiled, the second
    # is the first RowNorm step, whose passes compile on CUDA (reported on their own)
    timed = [t for _, t in results[2:]] or [t for _, t in results[1:]] or [results[0][1]]
    step_s = statistics.mean(timed)
    flops = training_flops_per_image(cfg.model) * cfg.train.batch_size
    peak, _ = spec_peak(device)
    rate, _ = gemm_rate(ctx)
    denominator, against = (peak, f"spec {peak / 1e12:.0f}") if peak else (rate, "the measured GEMM rate")
    values = {"first_loss": losses[0], "losses": losses, "step_s": [t for _, t in results],
              "prediction": ctx.prediction}
    checks = [check(f"{label}: losses finite, no step skipped", f"{losses[0]:.4f} -> {losses[-1]:.4f}, "
                    f"{skipped:.0f} skipped", "finite", all(math.isfinite(v) for v in losses) and not skipped),
              check(f"step time (mean of steps 3-{len(results)}: RowNorm, refresh, RowNorm)",
                    " / ".join(f"{t * 1e3:.0f}" for t in timed) + f" ms; mean {step_s * 1e3:.1f} ms, "
                    f"{cfg.train.batch_size / step_s:.0f} images/s",
                    "reported; " + predicted, None)]
    if len(results) > 1:
        values["first_rownorm_step_s"] = results[1][1]
        checks.append(check("first RowNorm step (its passes compile on CUDA, once per process)",
                            f"{results[1][1]:.1f} s", "reported (a run's one-off cost)", None))
    if denominator:
        values["mfu"] = flops / step_s / denominator
        checks.append(check(f"MFU (model FLOPs / step time / {against})", f"{values['mfu']:.1%}",
                            "reported (first measurement)", None))
    checks += memory_checks(ctx, device, values, compiled)
    return checks, values


# a trainer stage's trainer_config arguments: (run folder name, activation checkpointing, compiled)
TRAINER_CONFIGS = {"dit1b3_eager": ("eager", False, False), "dit1b3_compile_ac": ("compile_ac", True, True)}


def stage_dit1b3_eager(ctx) -> dict:
    dist = trainer_dist(ctx)
    ctx.device_type = dist.device.type
    cfg = trainer_config(ctx, *TRAINER_CONFIGS[ctx.name])
    predicted = trainer_prediction(ctx, cfg, dist.device)
    ctx.phase("building the trainer (dit_1b3, FSDP2 on a group of one)")
    with built_trainer(cfg, dist) as trainer:
        results = run_steps(trainer, 2 + 3, ctx, min_steps=3)
    checks, values = trainer_checks(ctx, cfg, results, "dit_1b3 eager", predicted)
    return {"checks": checks, "values": values}


def stage_dit1b3_compile_ac(ctx) -> dict:
    dist = trainer_dist(ctx)
    ctx.device_type = dist.device.type
    cfg = trainer_config(ctx, *TRAINER_CONFIGS[ctx.name])
    predicted = trainer_prediction(ctx, cfg, dist.device)
    ctx.phase("building the trainer (dit_1b3, FSDP2 on a group of one, compiled blocks, AC)")
    with built_trainer(cfg, dist) as trainer:
        results = run_steps(trainer, 2 + 3, ctx, min_steps=3)
    checks, values = trainer_checks(ctx, cfg, results, "dit_1b3 compiled + AC", predicted, compiled=True)
    values["compile_step_s"] = results[0][1]
    checks.insert(1, check("first step (compiling the blocks)", f"{results[0][1]:.1f} s", "reported", None))
    eager = ((ctx.previous("dit1b3_eager") or {}).get("values") or {}).get("first_loss")
    rtol = LOSS_RTOL[cfg.train.precision]
    first = values["first_loss"]
    if eager is None:
        checks.append(check("first loss vs eager", f"{first:.6f}", "the eager stage's first loss", False))
        ctx.notes.append("no eager first loss to compare with: the dit1b3_eager stage wrote none")
    else:
        rel = abs(first - eager) / abs(eager)
        checks.append(check("first loss vs eager (same weights, batch, noise)",
                            f"{first:.6f} vs {eager:.6f}: relative {rel:.1e}", f"<= {rtol:g}", rel <= rtol))
    return {"checks": checks, "values": values}


# ---- checkpoint ---------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def deterministic_algorithms(nondeterministic: list):
    """Kernels with a deterministic variant use it; one without one warns (warn_only: the check must not stop at
    it) and is named in `nondeterministic`. (CUBLAS_WORKSPACE_CONFIG is set before CUDA starts: stage_checkpoint.)"""
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            yield
    finally:
        torch.use_deterministic_algorithms(before)
        nondeterministic.extend(sorted({str(w.message).split(" does not have a deterministic")[0][:120]
                                        for w in seen if "deterministic" in str(w.message)}))


def flat_tensors(tree, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of nested dicts / lists (a checkpoint's tensor state) by its path: local shards, on the host."""
    from dit_train.parallel.fsdp import local

    if isinstance(tree, torch.Tensor):
        return {prefix: local(tree).detach().cpu().clone()}
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, (list, tuple)) else ()
    out = {}
    for k, v in items:
        out.update(flat_tensors(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def trainer_state(trainer) -> dict[str, torch.Tensor]:
    """What a checkpoint holds of the trainer's tensors (model, optimizer, EMA), on the host."""
    from dit_train.runs import checkpoint as ckpt

    return flat_tensors(ckpt.tensor_state(trainer.model, trainer.optimizer, trainer.ema.model))


def differing(a: dict, b: dict) -> list[str]:
    return sorted(set(a) ^ set(b)) + [k for k in a if k in b and not torch.equal(a[k], b[k])]


def stage_checkpoint(ctx, before: int = 2, after: int = 2) -> dict:
    """`before` steps, an asynchronous Trainer.save (DCP), `after` steps; a new trainer resumes from that checkpoint:
    its tensors must be the saved ones bit for bit, and its `after` steps the same as the first trainer's (bit for
    bit under deterministic algorithms; a kernel without a deterministic variant is named instead of failed)."""
    from dit_train.runs import checkpoint as ckpt

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS; read when CUDA starts
    dist = trainer_dist(ctx)
    # dit_1b3 at 8 blocks deep (0.35 B parameters, ~4 GB of checkpoint): GB/s at size, within the stage's time
    extra = [*([] if ctx.smoke else ["model.depth=8"]), "train.async_checkpoint=true"]
    cfg = trainer_config(ctx, "checkpoint", extra=extra)
    saved, nondeterministic = {}, []
    with deterministic_algorithms(nondeterministic):
        ctx.phase("building the trainer (dit_1b3 at 8 blocks)")
        with built_trainer(cfg, dist) as trainer:
            ctx.phase(f"{before} steps")
            run_steps(trainer, before)
            at_save = trainer_state(trainer)
            ctx.phase("asynchronous save (DCP)")
            forward = trainer.saver.log_metrics
            trainer.saver.log_metrics = lambda step, m: (saved.update(m), forward(step, m))  # ckpt/write_s, bytes
            t0 = time.perf_counter()
            trainer.save()  # returns once the shards are staged in host memory: what training waits for
            staged_s = time.perf_counter() - t0
            trainer.saver.wait(trainer.state.step)
            path = ckpt.list_checkpoints(cfg.run_dir)[-1]
            ctx.phase(f"{after} steps after the save")
            expected = run_steps(trainer, after)
            reference = trainer_state(trainer)
        del trainer
        resumed = trainer_config(ctx, "checkpoint", extra=[*extra, override("train.resume", path)])
        ctx.phase("a new trainer resumes from the checkpoint")
        with built_trainer(resumed, dist) as trainer:
            t0 = time.perf_counter()
            trainer.resume()
            load_s = time.perf_counter() - t0
            step = trainer.state.step
            loaded = differing(at_save, trainer_state(trainer))
            ctx.phase(f"{after} steps after the resume")
            got = run_steps(trainer, after)
            differ = differing(reference, trainer_state(trainer))
    size = saved.get("ckpt/bytes") or ckpt.folder_bytes(path)
    write_s = saved.get("ckpt/write_s")
    gb = size / 1e9
    keys = ("train/loss", "train/grad_norm")
    same = all(a[0][k] == b[0][k] for a, b in zip(expected, got) for k in keys)
    values = {"bytes": size, "staged_s": staged_s, "write_s": write_s, "load_s": load_s,
              "nondeterministic": nondeterministic}
    # After an exact resume, steps that differ a little are the kernels' doing (one without a deterministic variant,
    # named when torch knows it); lost state (the noise generator, the schedule, a moment) changes the loss itself.
    rel = max((abs(a[0]["train/loss"] - b[0]["train/loss"]) / abs(a[0]["train/loss"]) for a, b in zip(expected, got)),
              default=0.0)
    small = rel <= RESUMED_LOSS_RTOL
    why = ("nondeterministic: " + "; ".join(nondeterministic)) if nondeterministic else "no kernel reported itself"
    checks = [
        check("asynchronous save: staging (what training waits for)",
              f"{gb:.2f} GB in {staged_s:.2f} s = {gb / staged_s:.2f} GB/s", "reported", None),
        check("background write", f"{write_s:.2f} s = {gb / write_s:.2f} GB/s" if write_s else "not reported",
              "reported (ckpt/write_s)", None if write_s else False),
        check("resume", f"step {step} in {load_s:.2f} s = {gb / load_s:.2f} GB/s", f"step {before}", step == before),
        check("model, optimizer and EMA tensors after resume", f"{len(at_save) - len(loaded)} of {len(at_save)} "
              f"as saved" + (f", first differing {loaded[0]}" if loaded else ""), "all bit-identical", not loaded),
        check(f"next {after} steps: losses and grad norms", "bit-identical" if same else
              f"relative loss difference {rel:.1e} ({why})", f"bit-identical (deterministic algorithms); a "
              f"difference <= {RESUMED_LOSS_RTOL:g} is reported, not failed",
              True if same else (None if small else False)),
        check("model, optimizer and EMA tensors after those steps",
              f"{len(reference) - len(differ)} of {len(reference)} identical"
              + (f", first differing {differ[0]}" if differ else ""), "all bit-identical (as the steps)",
              True if not differ else (None if small else False)),
    ]
    return {"checks": checks, "values": values}


STAGE_FUNCTIONS = {"env": stage_env, "ns5": stage_ns5, "optimizers": stage_optimizers,
                   **{name: stage_dit15b for name in SHARD_RUNS},
                   "dit1b3_eager": stage_dit1b3_eager, "dit1b3_compile_ac": stage_dit1b3_compile_ac,
                   "checkpoint": stage_checkpoint}
