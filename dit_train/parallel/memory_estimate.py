"""Per-rank memory of training steps, measured by running the trainer's own code on fake tensors (no memory, no
GPU) under a fake process group of W ranks; dit-estimate-memory prints it, docs/scaling_out.md holds the
table.

How (the approach of torchtitan's scripts/estimate/estimation.py, our own code):
- a "fake" process group of W ranks, this process being rank 0 (the largest dim-0 shards); its collectives
  return at once;
- the model and its EMA shadow are built on the meta device and sharded by parallel.parallelize with the plan
  from cfg.parallel, as build.build_models does on every rank (FSDP2 per block + root, bf16 compute / fp32
  reduce as on CUDA). This happens before FakeTensorMode is entered: FSDP2 creates its device mesh there, and
  the mesh set-up fails inside FakeTensorMode on a data-dependent op;
- inside FakeTensorMode the shards are allocated (to_empty: fake tensors, nothing real), the EMA, optimizer
  (optim.registry.build_optimizer, i.e. the real ShardedMatrixOptimizer with its collectives and workspaces) and
  LR schedule are built, and the trainer's own step function runs (Trainer.train_step on a Trainer holding only
  what the step uses; its one host read, step_flags, answers "apply the update") while torch's
  FSDPMemTracker follows every tensor storage and its category (StepTracker: without the global-shape tensors of
  DTensor's sharding propagation, which only exist to compute metadata);
- the step runs until every direction of the optimizer has run once with all persistent state in place
  (K + 1 steps for a periodic optimizer, else 2), so the peak is that of a steady-state step.

Persistent bytes (alive between steps) are read from the objects that hold them: parameter shards, EMA shards,
optimizer.state and the optimizer's stacked workspaces. The peak and its breakdown come from the tracker.
What a fake run cannot see: the CUDA context, NCCL buffers, the caching allocator's fragmentation and rounding,
cuBLAS/attention-kernel workspaces, the data pipeline; and the CPU attention kernel stands in for CUDA's.
"""

from __future__ import annotations

import contextlib
import time
from unittest import mock
from types import SimpleNamespace

import torch
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

GIB = 1024**3

# peak-snapshot categories of FSDPMemTracker -> ours
GATHERED_AND_COMM = ("Unsharded Param", "All Gather", "Reduce Scatter")
TEMPORARY = ("Temp", "Inputs")


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (local shards of DTensors)."""
    seen, total = set(), 0
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        st = t.untyped_storage()
        if st._cdata not in seen:  # the storage itself, not its Python wrapper
            seen.add(st._cdata)
            total += st.nbytes()
    return total


def _tensors_in(obj):
    """Every tensor inside nested dicts / lists (the optimizer's workspaces)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors_in(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors_in(v)


def optimizer_state_bytes(optimizer) -> int:
    return _storage_bytes(t for state in optimizer.state.values() for t in state.values()
                          if isinstance(t, torch.Tensor))


def optimizer_workspace_bytes(optimizer) -> int:
    """The stacked direction inputs and direction buffers the optimizer keeps from step to step."""
    return _storage_bytes(_tensors_in(getattr(optimizer, "_workspace", {})))


def steps_for(optimizer_cfg) -> int:
    """Steps until every direction has run with the state of all the others in place: a refresh at step 0, the
    between-direction from step 1, the refresh again at step K (periodic); 2 otherwise (the state exists)."""
    K = optimizer_cfg.get("K") or 1
    return K + 1 if K > 1 else 2


class StepTracker(FSDPMemTracker):
    """FSDPMemTracker that leaves DTensor's sharding propagation out of the count. Propagation runs each op once on
    global-shape fake tensors to learn the output's metadata; inside our FakeTensorMode those tensors can reach
    the tracker and be counted as allocations (whole fp32 copies of every parameter list of AdamW's fused step:
    4 x 34 GiB at dit_9b, seen in some runs and not in others). A real run never makes them."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.propagating = 0

    @contextlib.contextmanager
    def ignoring_propagation(self):
        from torch.distributed.tensor._sharding_prop import ShardingPropagator

        original = ShardingPropagator._propagate_tensor_meta_non_cached
        tracker = self

        def propagate(prop, op_schema):
            tracker.propagating += 1
            try:
                return original(prop, op_schema)
            finally:
                tracker.propagating -= 1

        with mock.patch.object(ShardingPropagator, "_propagate_tensor_meta_non_cached", propagate):
            yield

    def _update_peak_stats(self, peak_state) -> None:
        """The peak over the whole step only: the estimate reads no module's own peak, and updating those walks
        every module of the model on every operator (about a third of an estimate's time at dit_15b)."""
        for dev, snap in self._curr_mem_snap.items():
            if self._peak_mem.get(dev, 0) < snap["Total"]:
                self._peak_mem[dev] = snap["Total"]
                self._peak_mem_snap[dev] = dict(snap)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.propagating:
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)


def init_fake_process_group(world_size: int, rank: int = 0) -> None:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if not dist.is_initialized():
        dist.init_process_group("fake", world_size=world_size, rank=rank, store=FakeStore())


@contextlib.contextmanager
def empty_all_to_all_inputs_allowed():
    """The fake process group fills an all-to-all's output from this rank's own input and refuses an empty input
    with a non-empty output (FakeProcessGroup.hpp), which owner mode issues when this rank owns none of an
    exchange's matrices (optim/owner_exchange.py). Such a call returns here with its output unfilled: the fake
    collectives' outputs are arbitrary anyway, only sizes count."""
    import torch.distributed as dist

    real = dist.all_to_all_single

    def all_to_all_single(output, input, *args, **kwargs):
        if input.numel() == 0:
            return SimpleNamespace(wait=lambda: True) if kwargs.get("async_op") else None
        return real(output, input, *args, **kwargs)

    dist.all_to_all_single = all_to_all_single
    try:
        yield
    finally:
        dist.all_to_all_single = real


def by_category(current: dict, peak: dict, params: int, ema_bytes: int, state: int, workspace: int):
    """(persistent, at peak) bytes by category, from the tracker's snapshots and the exact tensor counts."""
    persistent = {
        "parameters": params, "gradients": 0, "optimizer_state": state, "optimizer_workspace": workspace,
        "ema": ema_bytes, "activations": 0,
        "other": current["Total"] - params - ema_bytes - state - workspace,
        "total": current["Total"],
    }
    opt_at_peak = peak["OptState"]
    at_peak = {
        "parameters": peak["Sharded Param"],
        "gradients": peak["Sharded Grad"] + peak["Unsharded Grad"],
        "optimizer_state": min(state, opt_at_peak),
        "optimizer_workspace": opt_at_peak - min(state, opt_at_peak),  # persistent workspaces + step temporaries
        "ema": ema_bytes,
        "activations": peak["Activation"],
        "gathered_and_comm": sum(peak[k] for k in GATHERED_AND_COMM),
        "other": sum(peak[k] for k in TEMPORARY) + peak["Buffer"] - ema_bytes,
        "total": peak["Total"],
    }
    return persistent, at_peak


def fake_training(cfg, world_size: int, micro_batch: int, mode, micro_batches: int = 1) -> SimpleNamespace:
    """The trainer's objects for rank 0 of `world_size`, as estimate() and benchmarks/host_overhead.py run them: a
    fake process group, the model and EMA shadow built on meta and sharded by the plan of cfg.parallel, then inside
    `mode` (a FakeTensorMode, or a null context for real tensors) allocated, with the EMA, optimizer, LR schedule,
    a step-only Trainer and one step's batch (`micro_batch` x `micro_batches` images). Run the steps inside `mode`
    again (and empty_all_to_all_inputs_allowed): run.trainer.train_step(run.x, {"y": run.y}).
    Returns SimpleNamespace(info, plan, model, ema, optimizer, scheduler, trainer, x, y)."""
    from dit_train.diffusion.ema import EMA
    from dit_train.model.dit import build_model
    from dit_train.optim.registry import build_optimizer
    from dit_train.optim.schedule import build_scheduler
    from dit_train.optim.sharded_optimizer import ShardedMatrixOptimizer
    from dit_train.parallel.fsdp import DistInfo, fsdp_mesh, parallelize, resolve_plan

    init_fake_process_group(world_size)
    device = torch.device("cpu")
    info = DistInfo(rank=0, world_size=world_size, device=device)
    plan = resolve_plan(cfg.get("parallel"), info)
    if not plan.sharded:
        raise ValueError("the estimate is for FSDP2 runs: parallel.fsdp must not be false")
    tc = cfg.train
    # the mesh of the estimate's own (fake CPU) tensors: left to parallelize, a host with a visible GPU gets a cuda
    # mesh that the CPU shards cannot use
    mesh = fsdp_mesh(plan, device.type)
    model = parallelize(build_model(cfg.model, device="meta"), plan, mesh=mesh)
    shadow = parallelize(build_model(cfg.model, device="meta"), plan, trainable=False, mesh=mesh)
    with mode:
        model.to_empty(device=device)
        shadow.to_empty(device=device)
        ema = EMA(model, tc.ema_decay, shadow=shadow)
        optimizer = build_optimizer(model, cfg.optimizer)
        if cfg.optimizer.get("compile_rownorm") == "auto":
            # the eager passes (compiled kernels do not run on fake tensors); the compiled ones auto runs on CUDA
            # store U at most where eager does
            optimizer.compile_rownorm = False
        if isinstance(optimizer, ShardedMatrixOptimizer):
            optimizer.keep_whole_matrix_workspaces = False  # what a CUDA run keeps (CPU runs keep more)
        scheduler = build_scheduler(optimizer, tc.steps, tc.warmup_steps, tc.lr_schedule, tc.min_lr_ratio)
        trainer = step_only_trainer(cfg, info, plan, model, ema, optimizer, scheduler, micro_batch)
        m, batch = cfg.model, micro_batch * micro_batches
        x = torch.randn(batch, m.in_channels, m.image_size, m.image_size)
        y = torch.randint(0, max(1, m.num_classes), (batch,))
    return SimpleNamespace(info=info, plan=plan, model=model, ema=ema, optimizer=optimizer, scheduler=scheduler,
                           trainer=trainer, x=x, y=y)


def estimate(cfg, world_size: int, micro_batch: int, steps: int | None = None, fake: bool = True,
             micro_batches: int = 1) -> dict:
    """Bytes per rank (rank 0) of `steps` training steps of `cfg` on `world_size` ranks with `micro_batch` images
    per rank per forward, `micro_batches` forwards per step (gradient accumulation, synced as the trainer does).
    Returns {"persistent": {...}, "peak": {...}, "steps": n, "seconds": s} (bytes). fake=False runs on real
    tensors (small models only: to check the fake run against a real one)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import _FSDPRefType

    from dit_train.parallel.fsdp import local

    t0 = time.perf_counter()
    steps = steps or steps_for(cfg.optimizer)
    # meta tensors are not fake tensors: allow them in, to_empty turns them into fake CPU tensors
    mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext()
    run = fake_training(cfg, world_size, micro_batch, mode, micro_batches)
    model, ema, optimizer, device = run.model, run.ema, run.optimizer, run.info.device
    with mode:
        tracker = StepTracker(model, optimizer)
        tracker.track_inputs((run.x, run.y))
        # the EMA shards live outside the trained module: register them (as "Buffer", split off below) so that
        # the tracker counts them from the start instead of as activations at their first in-place update
        ema_tensors = [local(p) for p in ema.model.parameters()]
        for t in ema_tensors:
            tracker._update_and_maybe_create_winfos(t, _FSDPRefType.BUFFER)
        with tracker.ignoring_propagation(), tracker, empty_all_to_all_inputs_allowed(), \
                stats_reset_between_micro_batches(tracker):
            for _ in range(steps):
                run.trainer.train_step(run.x, {"y": run.y})
                tracker.reset_mod_stats()  # per-module stats are per iteration; the peak is kept
            current = tracker.get_tracker_snapshot("current")[device]
        peak = tracker.get_tracker_snapshot("peak")[device]

        params = _storage_bytes(model.parameters())
        ema_bytes = _storage_bytes(ema_tensors)
        state = optimizer_state_bytes(optimizer)
        workspace = optimizer_workspace_bytes(optimizer)
    persistent, at_peak = by_category(current, peak, params, ema_bytes, state, workspace)
    return {"persistent": persistent, "peak": at_peak, "steps": steps, "seconds": time.perf_counter() - t0}


def step_only_trainer(cfg, info, plan, model, ema, optimizer, scheduler, micro_batch: int):
    """A Trainer holding what Trainer.train_step uses, and nothing else (__init__ also builds the datasets, the
    logger, the checkpoint saver). train.micro_batch_size is the estimate's micro-batch. step_flags, the step's one
    host read, answers: apply the update, no stop vote, gradients not scaled (fake tensors have no values, and the
    fake process group's collectives leave arbitrary ones even in real tensors)."""
    from omegaconf import OmegaConf

    from dit_train import seeds
    from dit_train.optim.hooks import hooks_of
    from dit_train.telemetry.clocks import PhaseTimer
    from dit_train.trainer.loop import Trainer
    from dit_train.trainer.preemption import Preemption

    trainer = Trainer.__new__(Trainer)
    trainer.cfg, trainer.dist, trainer.plan = cfg, info, plan
    trainer.tc = OmegaConf.merge(cfg.train, {"micro_batch_size": micro_batch})
    trainer.model, trainer.ema, trainer.optimizer, trainer.scheduler = model, ema, optimizer, scheduler
    trainer.state = SimpleNamespace(generator=seeds.generator("train_noise", cfg.seed))
    trainer.timer, trainer.preemption, trainer.bad_steps = PhaseTimer(enabled=False), Preemption(), 0
    trainer.hooks = hooks_of(optimizer)  # what the loop tells the optimizer, as Trainer.__init__ sets it
    trainer.hooks.use_timer(trainer.timer)
    trainer.step_flags = lambda finite, stop_votes, scaled: (True, 0.0, False)
    return trainer


@contextlib.contextmanager
def stats_reset_between_micro_batches(tracker):
    """The tracker keeps per-module stats for one forward and refuses a second: reset them after the trainer's
    micro_batch_sync of every micro-batch but a step's first (the peak is kept)."""
    from dit_train.trainer import loop

    real = loop.micro_batch_sync
    first = True

    def sync_then_reset(model, plan, optimizer, last: bool) -> None:
        nonlocal first
        real(model, plan, optimizer, last=last)
        if not first:
            tracker.reset_mod_stats()
        first = last

    with mock.patch.object(loop, "micro_batch_sync", sync_then_reset):
        yield
