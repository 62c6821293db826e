"""The training loop, top to bottom: build -> (resume) -> steps -> validate / sample / checkpoint -> summary.

Everything that can fail on bad input fails before the model is built (config.validate). The data position is the
step (see batches.py), so a checkpoint of (step, model, EMA, optimizer, schedule, RNG) continues exactly.

Under torchrun the same loop trains an FSDP2-sharded model (parallel.py): rank r takes slice r of every global
batch, and the noise, timesteps and condition dropout are drawn for the whole global batch from a generator that
is identical on every rank, each rank keeping its slice, so a sharded run sees exactly the numbers a single
process would. The loss is averaged over ranks, checkpoints are sharded (dcp.py), and rank 0 alone writes logs,
samples and summaries.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import random
import signal
import time

import numpy as np
import torch
from omegaconf import OmegaConf

from . import checkpoint as ckpt
from . import dcp as sharded_ckpt
from .batches import fixed_batches, train_batches
from .config import remove_stray_hydra_dir, validate
from .data import build_dataset
from .ema import EMA
from .flow import (euler_sample, interpolate, sample_t, validation_loss, validation_t_grid, velocity_loss,
                   velocity_target)
from .images import save_grid
from .logger import MetricLogger
from .model import build_model, count_parameters
from .optim.registry import build_optimizer
from .parallel import (DistInfo, all_reduce_mean, barrier, broadcast_object, clip_grad_norm_,
                       init_distributed, materialize_from_rank0, parallelize, resolve_plan, shutdown_process_group,
                       wants_fsdp)
from .run_info import write_run_info
from .schedule import build_scheduler
from .timing import PhaseTimer, set_active_timer

log = logging.getLogger("dit_train")

EXIT_PREEMPTED = 75  # EX_TEMPFAIL: "try again later"; schedulers/wrappers treat it as requeue-able


class TrainingStopped(RuntimeError):
    """Raised for a run that cannot continue (too many non-finite steps); the message names the step."""


class Preempted(Exception):
    """SIGTERM/SIGUSR1 arrived; a checkpoint of the last finished step has been written."""


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_state(gen: torch.Generator) -> dict:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate(),
             "train_gen": gen.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict, gen: torch.Generator) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    gen.set_state(state["train_gen"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def split_condition(y) -> dict:
    """A batch's condition as model kwargs: class labels, or a dict with precomputed text embeddings."""
    return dict(y) if isinstance(y, dict) else {"y": y}


def to_device(cond: dict, device) -> dict:
    return {k: v.to(device, non_blocking=True) for k, v in cond.items()}


def dry_run(cfg) -> dict:
    """Build on the meta device (nothing allocated), print the size and the optimizer's parameter groups."""
    model = build_model(cfg.model, device="meta")
    n = count_parameters(model)
    optimizer = build_optimizer(model, cfg.optimizer)
    nominal = cfg.model.get("nominal_params")
    rel = f" ({n / nominal:.3f} x nominal {nominal / 1e9:.2f}B)" if nominal else ""
    print(f"model {cfg.model.name}: {n:,} parameters{rel}; depth {cfg.model.depth}, width {cfg.model.hidden_size}, "
          f"heads {cfg.model.num_heads}, patch {cfg.model.patch_size}, tokens {(cfg.model.image_size // cfg.model.patch_size) ** 2}")
    print(f"optimizer {cfg.optimizer.name}:\n{optimizer.routing_table}")
    print("dry run: nothing allocated, exiting")
    return {"params": n}


class Trainer:
    def __init__(self, cfg, dist: DistInfo):
        self.cfg, self.dist, self.tc = cfg, dist, cfg.train
        self.device = dist.device
        self.run_dir = cfg.run_dir
        self.plan = resolve_plan(cfg.get("parallel"), dist)
        self.sharded = self.plan.fsdp
        if self.sharded and not torch.distributed.is_initialized():
            raise RuntimeError("parallel.fsdp needs a process group: start training through run() or torchrun")
        seed_everything(cfg.seed + dist.rank)
        # the training noise generator is the same on every rank (each rank uses its slice of the global batch)
        self.gen = torch.Generator(device=self.device).manual_seed(cfg.seed * 7919)

        self.train_set = build_dataset(cfg.data, "train")
        self.val_set = build_dataset(cfg.data, "val")
        self.model, self.ema = self.build_models()
        self.optimizer = build_optimizer(self.model, cfg.optimizer)  # after sharding: it holds the DTensor shards
        self.scheduler = build_scheduler(self.optimizer, self.tc.steps, self.tc.warmup_steps,
                                         self.tc.lr_schedule, self.tc.min_lr_ratio)
        self.timer = PhaseTimer(enabled=self.tc.timing, device=self.device)
        set_active_timer(self.timer)
        self.logger = MetricLogger(self.run_dir, cfg.logger, enabled=dist.is_main,
                                   resolved_config=OmegaConf.to_container(cfg, resolve=True))
        self.step = 0
        self.active_time = 0.0  # wall time inside training steps (no eval, no checkpointing)
        self.bad_steps = 0
        self.skipped_steps = 0
        self.best_fd = None
        self.fd_evaluator = None
        if cfg.eval.get("every_n_steps"):  # built now so missing encoder weights fail before training starts
            from .fd.evaluator import FDEvaluator

            self.fd_evaluator = FDEvaluator(cfg.eval, cfg.data, self.device)
        self.stop_signal = None
        self._previous_handlers: dict = {}
        self.last_val: dict = {}
        self._stop_votes = 0.0  # ranks that have seen a stop signal, agreed at every step (sharded runs)
        if self.sharded:
            # the single-process batches, kept on the host; each rank evaluates its slice of every batch
            self.val_batches = list(fixed_batches(self.val_set, self.tc.val_samples, self.tc.val_batch_size))
        else:
            self.val_batches = [(x.to(self.device), y.to(self.device) if torch.is_tensor(y) else y)
                                for x, y in fixed_batches(self.val_set, self.tc.val_samples, self.tc.val_batch_size,
                                                          dist.rank, dist.world_size)]

    def build_models(self):
        """(model, EMA). Single process: the model on its device and the EMA a copy of it. Sharded: both built on
        the meta device and sharded (parallel.py), then filled with rank 0's seeded initialisation — the weights
        a single process would start from — and the EMA set to the same values."""
        cfg, plan = self.cfg, self.plan
        if not self.sharded:
            model = build_model(cfg.model).to(self.device)
            ema = EMA(model, self.tc.ema_decay)  # copied before checkpointing/compile wrap the blocks
            return parallelize(model, plan), ema
        reference = build_model(cfg.model) if self.dist.is_main else None
        model = parallelize(build_model(cfg.model, device="meta"), plan)
        shadow = parallelize(build_model(cfg.model, device="meta"), plan, trainable=False)
        materialize_from_rank0(model, reference, self.device)
        del reference
        shadow.to_empty(device=self.device)
        return model, EMA(model, self.tc.ema_decay, shadow=shadow)

    # ---- bookkeeping -------------------------------------------------------------------------------------
    def autocast(self):
        if self.tc.precision == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def state_dict(self) -> dict:
        return {
            "step": self.step,
            "model": self.model.state_dict(),
            "ema": self.ema.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "rng": rng_state(self.gen),
            "active_time_s": self.active_time,
            "skipped_steps": self.skipped_steps,
            "best_fd": self.best_fd,
            "config": OmegaConf.to_container(self.cfg, resolve=True),
        }

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.ema.load_state_dict(state["ema"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        set_rng_state(state["rng"], self.gen)
        self._restore_counters(state)

    def _restore_counters(self, state: dict) -> None:
        """Step (= data position), active time, skipped steps and best FD: the same in every checkpoint format."""
        self.step = state["step"]
        self.active_time = state["active_time_s"]
        self.skipped_steps = state.get("skipped_steps", 0)
        self.best_fd = state.get("best_fd")

    def trainer_state(self) -> dict:
        """What a sharded checkpoint keeps besides the tensors (the same on every rank)."""
        return {"step": self.step, "scheduler": self.scheduler.state_dict(), "train_gen": self.gen.get_state(),
                "ema_num_updates": self.ema.num_updates, "active_time_s": self.active_time,
                "skipped_steps": self.skipped_steps, "best_fd": self.best_fd,
                "config": OmegaConf.to_container(self.cfg, resolve=True)}

    def save(self) -> str | None:
        if self.sharded:  # collective: every rank writes its shards
            tensors = sharded_ckpt.sharded_state(self.model, self.optimizer, self.ema.model)
            path = sharded_ckpt.save(self.run_dir, self.step, tensors, self.trainer_state(), rng_state(self.gen),
                                     self.tc.keep_last)
            if self.dist.is_main:
                log.info("saved sharded checkpoint %s", path)
            return path
        if not self.dist.is_main:
            return None
        path = ckpt.save_checkpoint(self.state_dict(), self.run_dir, self.step, self.tc.keep_last)
        log.info("saved checkpoint %s", path)
        return path

    def load_checkpoint(self, path: str) -> None:
        """Any checkpoint into this trainer: a single-process file or a sharded folder, into a single-process or
        a sharded model, whatever the number of ranks that wrote it."""
        if ckpt.is_dcp_checkpoint(path):
            state, rng = sharded_ckpt.load(path, self.model, self.optimizer, self.ema.model)
            self.scheduler.load_state_dict(state["scheduler"])
            if rng is not None:
                set_rng_state(rng, self.gen)
            self.gen.set_state(state["train_gen"])
            self.ema.num_updates = state["ema_num_updates"]
            self._restore_counters(state)
        elif self.sharded:
            state = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
            sharded_ckpt.load_full_into(state, self.model, self.optimizer, self.ema.model)
            self.scheduler.load_state_dict(state["scheduler"])
            self.gen.set_state(state["rng"]["train_gen"])
            if self.dist.is_main:
                set_rng_state(state["rng"], self.gen)
            self.ema.num_updates = state["ema"]["num_updates"]
            self._restore_counters(state)
        else:
            self.load_state_dict(torch.load(path, map_location="cpu", weights_only=False))

    def maybe_resume(self) -> None:
        resume = self.tc.resume
        existing = ckpt.list_checkpoints(self.run_dir, remove_partial=self.dist.is_main)
        barrier()
        if resume is None:
            if existing:
                raise FileExistsError(
                    f"run folder {self.run_dir} already has checkpoints ({os.path.basename(existing[-1])}); "
                    f"pass train.resume=auto to continue it, or choose a new run_dir")
            return
        if resume == "auto":
            if not existing:
                log.info("train.resume=auto: no checkpoint in %s, starting fresh", self.run_dir)
                return
            candidates = list(reversed(existing))
        else:
            candidates = [ckpt.resolve_checkpoint(str(resume))]
        for path in candidates:
            try:
                self.load_checkpoint(path)
            except Exception as e:  # noqa: BLE001 - with resume=auto a damaged checkpoint falls back, loudly
                if resume != "auto" or path == candidates[-1]:
                    raise
                log.warning("checkpoint %s is unreadable (%s); trying the previous one", path, e)
                continue
            break
        self.timer.collect()  # drop anything timed while loading
        log.info("resumed from %s at step %d", path, self.step)

    # ---- one step ----------------------------------------------------------------------------------------
    def train_step(self, x: torch.Tensor, cond: dict) -> dict:
        """Forward/backward/update on one batch. A non-finite loss or gradient skips the update and leaves the
        optimizer state untouched."""
        B = x.shape[0]
        W, rank = self.dist.world_size, self.dist.rank
        timer = self.timer
        # drawn for the global batch (identical generator on every rank); this rank keeps its slice
        t = sample_t(B * W, self.cfg.flow.t_sampling, self.cfg.flow.t_mean, self.cfg.flow.t_std,
                     self.cfg.flow.shift, generator=self.gen, device=self.device)
        eps = torch.randn((B * W, *x.shape[1:]), generator=self.gen, device=self.device, dtype=x.dtype)
        drop = torch.rand(B * W, generator=self.gen, device=self.device) < self.cfg.model.class_dropout_prob
        if W > 1:
            t, eps, drop = t[rank * B:(rank + 1) * B], eps[rank * B:(rank + 1) * B], drop[rank * B:(rank + 1) * B]
        with timer.phase("forward"), self.autocast():
            loss = velocity_loss(self.model, x, t, eps, drop_mask=drop, **cond)
        with timer.phase("backward"):  # under FSDP2 this includes the gradient reduce-scatter
            loss.backward()
        clip = self.tc.grad_clip if self.tc.grad_clip > 0 else float("inf")
        grad_norm = clip_grad_norm_(self.model.parameters(), clip)
        loss = loss.detach()
        if W > 1:  # the global-batch loss, and whether any rank has been asked to stop, in one all-reduce
            votes = torch.stack([loss.float(), torch.tensor(float(self.stop_signal is not None), device=loss.device)])
            torch.distributed.all_reduce(votes)
            loss, self._stop_votes = votes[0] / W, votes[1].item()
        finite = bool(torch.isfinite(loss).item() and torch.isfinite(grad_norm).item())
        if finite:
            with timer.phase("optimizer"):
                self.optimizer.step()
            self.ema.update(self.model)
            self.bad_steps = 0
        else:
            self.bad_steps += 1
            self.skipped_steps += 1
            log.warning("step %d: non-finite loss/grad (loss=%s, grad_norm=%s); update skipped (%d in a row)",
                        self.step, loss.item(), grad_norm.item(), self.bad_steps)
            if self.bad_steps >= self.tc.max_bad_steps > 0:
                raise TrainingStopped(
                    f"stopping at step {self.step}: {self.bad_steps} non-finite steps in a row "
                    f"(train.max_bad_steps={self.tc.max_bad_steps}); the last good checkpoint is untouched")
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        out = {"train/loss": loss.item(), "train/grad_norm": grad_norm.item(), "train/skipped": float(not finite)}
        info = getattr(self.optimizer, "step_info", None)
        if callable(info) and finite:
            out.update(info())
        return out

    # ---- evaluation --------------------------------------------------------------------------------------
    def validate(self) -> dict:
        self.ema.model.eval()
        if self.sharded:
            return self.validate_sharded()
        out = validation_loss(self.ema.model, self.val_batches, validation_t_grid(self.tc.val_t_points),
                              seed=self.cfg.seed, autocast=self.autocast if self.tc.precision == "bf16" else None)
        if self.dist.distributed:
            out = {k: all_reduce_mean(v, self.device) for k, v in out.items()}
        return out

    @torch.no_grad()
    def validate_sharded(self) -> dict:
        """validation_loss of the single-process run (same batches, same per-batch noise, same t grid), with each
        rank evaluating a slice of every batch (possibly one row fewer, or a zero-weight dummy row, so that every
        rank makes the same model calls) and the sums all-reduced."""
        grid = validation_t_grid(self.tc.val_t_points)
        per_t = torch.zeros(len(grid) + 1, dtype=torch.float64, device=self.device)  # last: sample count
        for i, (x0, y) in enumerate(self.val_batches):
            gen = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + i)  # as flow.validation_loss
            eps = torch.randn(x0.shape, generator=gen).to(x0.dtype)
            rows = torch.tensor_split(torch.arange(x0.shape[0]), self.dist.world_size)[self.dist.rank]
            weight = 1.0 if len(rows) else 0.0
            rows = rows if len(rows) else torch.zeros(1, dtype=torch.long)
            x, e = x0[rows].to(self.device), eps[rows].to(self.device)
            cond = to_device({k: v[rows] for k, v in split_condition(y).items()}, self.device)
            for j, t_val in enumerate(grid.tolist()):
                tt = torch.full((x.shape[0],), t_val, device=self.device)
                with self.autocast():
                    pred = self.ema.model(interpolate(x, e, tt), tt, **cond)
                err = (pred.float() - velocity_target(x, e).float()).pow(2).flatten(1).mean(1)
                per_t[j] += weight * err.double().sum()
            per_t[-1] += weight * x.shape[0]
        torch.distributed.all_reduce(per_t)
        per_t = (per_t[:-1] / per_t[-1].clamp(min=1)).cpu()
        out = {"val/loss": per_t.mean().item()}
        out.update({f"val/loss_t{t:.3f}": v for t, v in zip(grid.tolist(), per_t.tolist())})
        return out

    def sample_fn(self, labels, generator, steps: int, cfg_scale: float, context=None, context_mask=None):
        """EMA samples with CFG; used for the grids (train.sample_*) and by the FD evaluator (eval.*)."""
        m = self.cfg.model
        noise = torch.randn((labels.shape[0], m.in_channels, m.image_size, m.image_size), generator=generator,
                            device=self.device)
        with self.autocast():
            x = euler_sample(self.ema.model, noise, y=labels.to(self.device) if m.num_classes else None,
                             steps=steps, cfg_scale=cfg_scale, context=context, context_mask=context_mask)
        return x.float().clamp(-1, 1)

    def sample_grid(self) -> str | None:
        """EMA samples of the first classes (same noise every time); saved by rank 0. Sharded, every rank takes
        part in the model calls."""
        if not self.dist.is_main and not self.sharded:
            return None
        m, k = self.cfg.model, self.tc.samples_per_class
        classes = min(max(m.num_classes, 1), 10)
        labels = torch.arange(classes).repeat_interleave(k)
        gen = torch.Generator(device=self.device).manual_seed(self.cfg.seed + 12345)  # same noise every grid
        context = None
        x0, y0 = self.val_batches[0]
        if isinstance(y0, dict):  # text-conditioned: use the first held-out captions
            labels = torch.zeros(min(len(x0), classes * k), dtype=torch.long)
            context = y0["context"][: len(labels)].to(self.device)
        images = self.sample_fn(labels, gen, self.tc.sample_steps, self.tc.cfg_scale, context=context)
        if not self.dist.is_main:
            return None
        os.makedirs(os.path.join(self.run_dir, "samples"), exist_ok=True)
        path = save_grid(images, os.path.join(self.run_dir, "samples", f"step_{self.step:08d}.png"), nrow=k)
        self.logger.log_image(self.step, "samples", path)
        return path

    def evaluate_fd(self) -> dict:
        """FD of EMA samples (eval.sample_steps, eval.cfg_scale) against the cached reference; keeps the best
        value with its step and active time."""
        ev = self.cfg.eval
        if self.best_fd and self.fd_evaluator.best is None:  # restored from a checkpoint
            self.fd_evaluator.best = dict(self.best_fd)
        result = self.fd_evaluator.evaluate(
            lambda labels, g: self.sample_fn(labels, g, ev.sample_steps, ev.cfg_scale), self.step, self.active_time)
        self.best_fd = dict(self.fd_evaluator.best) if self.fd_evaluator.best else None
        images = result.pop("images", None)
        if images is not None and self.dist.is_main:
            os.makedirs(os.path.join(self.run_dir, "samples"), exist_ok=True)
            save_grid(images[:64], os.path.join(self.run_dir, "samples", f"fd_step_{self.step:08d}.png"), nrow=8)
        out = {k: v for k, v in result.items() if isinstance(v, (int, float, str))}
        out["active_time_s"] = self.active_time
        out.update({f"fd_best/{k}": v for k, v in (self.best_fd or {}).items()})
        return out

    # ---- the loop ----------------------------------------------------------------------------------------
    def _on_signal(self, signum, _frame):
        self.stop_signal = signal.Signals(signum).name

    def _hand_over_signal(self) -> None:
        """After the preemption checkpoint: give the signal to the handler that was there before ours, if it is
        Python code (submitit's SIGUSR2 handler requeues the job from rank 0); default handlers are not called."""
        if self.stop_signal is None:
            return
        previous = self._previous_handlers.get(signal.Signals[self.stop_signal])
        if callable(previous):
            previous(signal.Signals[self.stop_signal].value, None)

    def fit(self) -> dict:
        self.maybe_resume()
        if self.dist.is_main:
            print(f"model {self.cfg.model.name}: {count_parameters(self.model):,} parameters; "
                  f"data {self.train_set.dataset_id} ({len(self.train_set)} train / {len(self.val_set)} val)")
            print(f"optimizer {self.cfg.optimizer.name}:\n{self.optimizer.routing_table}")
            print(f"parallel: {self.dist.world_size} process(es) on {self.device.type}; {self.plan.describe()}")
        # SIGTERM: preemption / scancel / torchrun passing one on; SIGUSR1/SIGUSR2: Slurm's --signal warnings
        # (USR2 is submitit's time-limit signal, handed back to it after the checkpoint)
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)}
        self._previous_handlers = previous
        try:
            return self._loop()
        finally:
            for s, h in previous.items():
                signal.signal(s, h)
            self.logger.close()

    def _loop(self) -> dict:
        tc, dist = self.tc, self.dist
        batches = train_batches(self.train_set, tc.batch_size, self.cfg.seed, self.step, tc.steps,
                                dist.rank, dist.world_size, tc.num_workers)
        progress = None
        if dist.is_main and tc.progress:
            from tqdm import tqdm

            progress = tqdm(total=tc.steps, initial=self.step, desc="train", dynamic_ncols=True, unit="step")
        recent = []
        window_imgs, window_time = 0, 0.0
        data_t0 = time.perf_counter()
        for x, y in batches:
            data_time = time.perf_counter() - data_t0
            t0 = time.perf_counter()
            x, cond = x.to(self.device, non_blocking=True), to_device(split_condition(y), self.device)
            metrics = self.train_step(x, cond)
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            step_time = time.perf_counter() - t0
            self.active_time += step_time
            self.step += 1
            recent = (recent + [metrics["train/loss"]])[-50:]
            window_imgs += tc.batch_size
            window_time += step_time + data_time

            if self.step % tc.log_every == 0 or self.step == tc.steps:
                timings = self.timer.collect()
                metrics.update(timings)
                metrics.update({"lr": self.scheduler.get_last_lr()[0], "time/step": step_time, "time/data": data_time,
                                "imgs_per_s": window_imgs / max(window_time, 1e-9), "active_time_s": self.active_time,
                                "skipped_steps": self.skipped_steps})
                skipped_data = len(getattr(self.train_set, "skipped", ()))
                if skipped_data:
                    metrics["data/skipped"] = skipped_data
                self.logger.log(self.step, metrics)
                if progress is not None:
                    progress.set_postfix(loss=f"{metrics['train/loss']:.4f}", imgs_s=f"{metrics['imgs_per_s']:.0f}")
                window_imgs, window_time = 0, 0.0
            else:
                self.timer.collect()
            if progress is not None:
                progress.update(1)

            last = self.step == tc.steps
            if tc.val_every and (self.step % tc.val_every == 0 or last):
                self.last_val = self.validate()
                self.logger.log(self.step, self.last_val)
            if self.cfg.eval.get("every_n_steps") and (self.step % self.cfg.eval.every_n_steps == 0 or last):
                self.logger.log(self.step, self.evaluate_fd())
            if tc.sample_every and (self.step % tc.sample_every == 0 or last):
                self.sample_grid()
            if (tc.ckpt_every and self.step % tc.ckpt_every == 0) or last:
                self.save()
            # sharded: stop only when the ranks agree (the vote is part of each step's all-reduce)
            stop = self._stop_votes > 0 if dist.distributed else self.stop_signal is not None
            if stop:
                if not ((tc.ckpt_every and self.step % tc.ckpt_every == 0) or last):
                    self.save()
                self._hand_over_signal()
                raise Preempted(f"received {self.stop_signal or 'a stop signal (on another rank)'} at step "
                                f"{self.step}; checkpoint written, rerun with train.resume=auto "
                                f"run_dir={self.run_dir} to continue")
            data_t0 = time.perf_counter()
        if progress is not None:
            progress.close()
        barrier()
        return self.summary(recent)

    def summary(self, recent: list[float]) -> dict:
        val = self.last_val if self.tc.val_every else {}
        summary = {
            "steps": self.step,
            "train_loss": float(np.mean(recent)) if recent else math.nan,
            "val_loss": val.get("val/loss", math.nan),
            "imgs_per_s": self.step * self.tc.batch_size / max(self.active_time, 1e-9),
            "active_time_s": self.active_time,
            "skipped_steps": self.skipped_steps,
            "params": count_parameters(self.model),
            "model": self.cfg.model.name,
            "optimizer": self.cfg.optimizer.name,
            "dataset": self.train_set.dataset_id,
            "best_fd": self.best_fd,
        }
        if self.dist.is_main:
            ckpt.atomic_write_bytes(json.dumps(summary, indent=2).encode(), os.path.join(self.run_dir, "summary.json"))
            print(f"done: steps={summary['steps']} train_loss={summary['train_loss']:.4f} "
                  f"val_loss={summary['val_loss']:.4f} imgs/s={summary['imgs_per_s']:.1f} "
                  f"active_time={summary['active_time_s']:.0f}s run_dir={self.run_dir}")
        return summary


def agree_on_config(cfg, dist: DistInfo):
    """Every rank continues with rank 0's resolved config, so all ranks use one run folder (Hydra's ${now:...}
    is resolved per process and can differ by a second) and see the same values. A non-zero rank's own Hydra
    output folder, if it differs from rank 0's and holds only Hydra's files, is removed."""
    own_hydra_dir = None
    try:
        from hydra.core.hydra_config import HydraConfig

        if HydraConfig.initialized():
            own_hydra_dir = HydraConfig.get().runtime.output_dir
    except Exception:  # noqa: BLE001 - composed without Hydra's runtime (tests, notebooks)
        pass
    payload = (OmegaConf.to_container(cfg, resolve=True), own_hydra_dir) if dist.is_main else None
    container, main_hydra_dir = broadcast_object(payload)
    if not dist.is_main and own_hydra_dir and main_hydra_dir and \
            os.path.abspath(own_hydra_dir) != os.path.abspath(main_hydra_dir):
        remove_stray_hydra_dir(own_hydra_dir)
    agreed = OmegaConf.create(container)
    OmegaConf.set_struct(agreed, True)
    return agreed


def run(cfg) -> dict:
    """Entry point behind `python -m dit_train`: validate, then dry run or train. Under torchrun (or with
    parallel.fsdp=true) this joins/creates the process group first and leaves it as it found it."""
    had_group = torch.distributed.is_initialized()
    dist = init_distributed(single_process_group=wants_fsdp(cfg.get("parallel"), int(os.environ.get("WORLD_SIZE", "1")))
                            and not cfg.train.dry_run)
    try:
        if dist.distributed:
            cfg = agree_on_config(cfg, dist)
        validate(cfg, dist.world_size)
        if cfg.train.dry_run:
            return dry_run(cfg)
        if dist.is_main:
            os.makedirs(cfg.run_dir, exist_ok=True)
            write_run_info(cfg, cfg.run_dir)
        return Trainer(cfg, dist).fit()
    finally:
        if not had_group:
            shutdown_process_group()
