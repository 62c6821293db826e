"""The training loop, top to bottom: build -> (resume) -> steps -> validate / sample / checkpoint -> summary.

Everything that can fail on bad input fails before the model is built (config_check). The data position is the
step (see batches.py), so a checkpoint of (step, model, EMA, optimizer, schedule, RNG) continues exactly.
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
from .batches import fixed_batches, train_batches
from .config_check import check_config
from .data import build_dataset
from .ema import EMA
from .flow import euler_sample, sample_t, validation_loss, validation_t_grid, velocity_loss
from .images import save_grid
from .logger import MetricLogger
from .model import build_model, count_parameters
from .optim.registry import build_optimizer
from .parallel import DistInfo, all_reduce_mean, barrier, init_distributed
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
        seed_everything(cfg.seed + dist.rank)
        self.gen = torch.Generator(device=self.device).manual_seed(cfg.seed * 7919 + dist.rank)

        self.train_set = build_dataset(cfg.data, "train")
        self.val_set = build_dataset(cfg.data, "val")
        self.model = build_model(cfg.model).to(self.device)
        self.ema = EMA(self.model, self.tc.ema_decay)
        self.optimizer = build_optimizer(self.model, cfg.optimizer)
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
        self.fd_evaluator = None
        self.best_fd = None
        self.stop_signal = None
        self.last_val: dict = {}
        self.val_batches = [(x.to(self.device), y.to(self.device) if torch.is_tensor(y) else y)
                            for x, y in fixed_batches(self.val_set, self.tc.val_samples, self.tc.val_batch_size,
                                                      dist.rank, dist.world_size)]

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
        self.step = state["step"]
        self.active_time = state["active_time_s"]
        self.skipped_steps = state.get("skipped_steps", 0)
        self.best_fd = state.get("best_fd")

    def save(self) -> str | None:
        if not self.dist.is_main:
            return None
        path = ckpt.save_checkpoint(self.state_dict(), self.run_dir, self.step, self.tc.keep_last)
        log.info("saved checkpoint %s", path)
        return path

    def maybe_resume(self) -> None:
        resume = self.tc.resume
        existing = ckpt.list_checkpoints(self.run_dir)
        if resume is None:
            if existing:
                raise FileExistsError(
                    f"run folder {self.run_dir} already has checkpoints ({os.path.basename(existing[-1])}); "
                    f"pass train.resume=auto to continue it, or choose a new run_dir")
            return
        if resume == "auto":
            state, path = ckpt.load_newest(self.run_dir)
            if state is None:
                log.info("train.resume=auto: no checkpoint in %s, starting fresh", self.run_dir)
                return
        else:
            path = ckpt.resolve_checkpoint(str(resume))
            state = torch.load(path, map_location="cpu", weights_only=False)
        self.load_state_dict(state)
        log.info("resumed from %s at step %d", path, self.step)

    # ---- one step ----------------------------------------------------------------------------------------
    def train_step(self, x: torch.Tensor, cond: dict) -> dict:
        """Forward/backward/update on one batch. A non-finite loss or gradient skips the update and leaves the
        optimizer state untouched."""
        B = x.shape[0]
        timer = self.timer
        t = sample_t(B, self.cfg.flow.t_sampling, self.cfg.flow.t_mean, self.cfg.flow.t_std,
                     self.cfg.flow.shift, generator=self.gen, device=self.device)
        eps = torch.randn(x.shape, generator=self.gen, device=self.device, dtype=x.dtype)
        drop = torch.rand(B, generator=self.gen, device=self.device) < self.cfg.model.class_dropout_prob
        with timer.phase("forward"), self.autocast():
            loss = velocity_loss(self.model, x, t, eps, drop_mask=drop, **cond)
        with timer.phase("backward"):
            loss.backward()
        clip = self.tc.grad_clip if self.tc.grad_clip > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)
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
        out = validation_loss(self.ema.model, self.val_batches, validation_t_grid(self.tc.val_t_points),
                              seed=self.cfg.seed, autocast=self.autocast if self.tc.precision == "bf16" else None)
        if self.dist.distributed:
            out = {k: all_reduce_mean(v, self.device) for k, v in out.items()}
        return out

    def sample_fn(self, labels, generator, context=None, context_mask=None):
        """EMA samples with CFG; used for the grids and by the FD evaluator."""
        m = self.cfg.model
        noise = torch.randn((labels.shape[0], m.in_channels, m.image_size, m.image_size), generator=generator,
                            device=self.device)
        with self.autocast():
            x = euler_sample(self.ema.model, noise, y=labels.to(self.device) if m.num_classes else None,
                             steps=self.tc.sample_steps, cfg_scale=self.tc.cfg_scale,
                             context=context, context_mask=context_mask)
        return x.float().clamp(-1, 1)

    def sample_grid(self) -> str | None:
        if not self.dist.is_main:
            return None
        m, k = self.cfg.model, self.tc.samples_per_class
        classes = min(max(m.num_classes, 1), 10)
        labels = torch.arange(classes).repeat_interleave(k)
        gen = torch.Generator(device=self.device).manual_seed(self.cfg.seed + 12345)  # same noise every grid
        context = None
        x0, y0 = self.val_batches[0]
        if isinstance(y0, dict):  # text-conditioned: use the first held-out captions
            labels = torch.zeros(min(len(x0), classes * k), dtype=torch.long)
            context = y0["context"][: len(labels)]
        images = self.sample_fn(labels, gen, context=context)
        os.makedirs(os.path.join(self.run_dir, "samples"), exist_ok=True)
        path = save_grid(images, os.path.join(self.run_dir, "samples", f"step_{self.step:08d}.png"), nrow=k)
        self.logger.log_image(self.step, "samples", path)
        return path

    def evaluate_fd(self) -> dict:
        if self.fd_evaluator is None:
            from .fd.evaluator import FDEvaluator

            self.fd_evaluator = FDEvaluator(self.cfg.eval, self.cfg.data, self.device)
            if self.best_fd:
                self.fd_evaluator.best = dict(self.best_fd)
        result = self.fd_evaluator.evaluate(lambda labels, g: self.sample_fn(labels, g), self.step, self.active_time)
        self.best_fd = dict(self.fd_evaluator.best)
        images = result.pop("images", None)
        if images is not None and self.dist.is_main:
            os.makedirs(os.path.join(self.run_dir, "samples"), exist_ok=True)
            save_grid(images[:64], os.path.join(self.run_dir, "samples", f"fd_step_{self.step:08d}.png"), nrow=8)
        out = {k: v for k, v in result.items() if isinstance(v, (int, float, str))}
        out.update({f"fd_best/{k}": v for k, v in self.best_fd.items()})
        return out

    # ---- the loop ----------------------------------------------------------------------------------------
    def _on_signal(self, signum, _frame):
        self.stop_signal = signal.Signals(signum).name

    def fit(self) -> dict:
        tc = self.tc
        self.maybe_resume()
        if self.dist.is_main:
            print(f"model {self.cfg.model.name}: {count_parameters(self.model):,} parameters; "
                  f"data {self.train_set.dataset_id} ({len(self.train_set)} train / {len(self.val_set)} val)")
            print(f"optimizer {self.cfg.optimizer.name}:\n{self.optimizer.routing_table}")
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGUSR1)}
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
            if self.stop_signal:
                if not ((tc.ckpt_every and self.step % tc.ckpt_every == 0) or last):
                    self.save()
                raise Preempted(f"received {self.stop_signal} at step {self.step}; checkpoint written, "
                                f"rerun with train.resume=auto run_dir={self.run_dir} to continue")
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


def run(cfg) -> dict:
    """Entry point behind `python -m dit_train`: validate, then dry run or train."""
    dist = init_distributed()
    check_config(cfg, dist.world_size)
    if cfg.train.dry_run:
        return dry_run(cfg)
    if dist.is_main:
        os.makedirs(cfg.run_dir, exist_ok=True)
        write_run_info(cfg, cfg.run_dir)
    return Trainer(cfg, dist).fit()
