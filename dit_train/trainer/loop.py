"""The training loop, top to bottom: build -> resume -> steps -> evaluation / checkpoint -> summary.

One code path for any number of ranks. Under torchrun the model is FSDP2-sharded (parallel.py); rank r takes
slice r of every global batch, and the noise, timesteps and condition dropout are drawn for the whole global
batch from a generator that is identical on every rank, each rank keeping its slice, so a sharded run sees
exactly the numbers a single process would. The loss is averaged over ranks (with the preemption vote in the
same all-reduce); a single process runs the same code with the reductions being the identity.
"""

from __future__ import annotations

import logging
import os
import sys

import torch
from omegaconf import OmegaConf

from dit_train.runs import checkpoint as ckpt
from dit_train.parallel.backend_env import record_nccl_traces
from dit_train.trainer.build import build_training
from dit_train.trainer.cadence import every_n_steps
from dit_train.runs.checkpoint_saver import CheckpointSaver, grace_warning, resolve_async
from dit_train.parallel.comm_volume import describe_run, ranks_per_node
from dit_train.config import validate
from dit_train.config.latents import latents_vae
from dit_train.config.paths import absolute_paths
from dit_train.data.datasets import build_dataset, check_classes_fit, fingerprint, loader_workers
from dit_train.data.order import train_batches
from dit_train.trainer.deferred_steps import DeferredSteps, PendingStep, StepNumbers
from dit_train.trainer.dry_run import dry_run
from dit_train.evaluation.during_training import Evaluation, end_of_run_work
from dit_train.diffusion.flow import condition_kwargs, sample_t, velocity_loss
from dit_train.trainer.hydra_run import agree_on_config
from dit_train.telemetry.logger import MetricLogger
from dit_train.telemetry.metrics import Throughput, read_summary, write_summary
from dit_train.model.dit import count_parameters
from dit_train.optim.fused_rownorm import check_buildable
from dit_train.optim.hooks import hooks_of
from dit_train.optim.routing import PER_TENSOR_HINT
from dit_train.parallel.fsdp import (DistInfo, all_reduce_sum_, autocast, barrier, clip_grads_, clip_scaled, collective_timeouts,
                       global_grad_norm, init_distributed, resolve_plan, shutdown_process_group, wants_fsdp, weights_finite)
from dit_train.trainer.preemption import Preemption
from dit_train.runs.resume_policy import resume_candidates
from dit_train.runs.folder import prepare_run_folder
from dit_train.runs.fork import ForkSourceGone, choose_parent_checkpoint, forget_fork_start, load_fork
from dit_train.telemetry.step_window import StepWindow
from dit_train.runs.timeline import set_aside_after
from dit_train.telemetry.clocks import PhaseTimer
from dit_train.telemetry.progress import logging_beside_bars, progress_bar
from dit_train.telemetry.progress_lines import ProgressLines
from dit_train.trainer.state import TrainState

log = logging.getLogger("dit_train")


class TrainingStopped(RuntimeError):
    """Raised for a run that cannot continue (too many non-finite steps); the message names the step."""


def micro_batch_sync(model, plan, optimizer, last: bool) -> None:
    """Gradient accumulation under FSDP2: the reduce-scatter runs after every micro-batch, so a rank only ever
    holds its gradient shards (FSDP2's no-sync mode would keep the whole unsharded fp32 gradient on every rank
    until the last micro-batch: 4 bytes x parameters, +56 GiB at dit_15b). Under HSDP the replicas' all-reduce
    waits for the last micro-batch: it moves only shards, so deferring it costs 1/W of the gradient and saves the
    other micro-batches' inter-node all-reduces. An exchange behind backward arms on the last micro-batch only.
    The memory estimate runs this too."""
    if plan.sharded and plan.replicate > 1:
        model.set_requires_all_reduce(last)
    hooks_of(optimizer).backward_is_final(last)


class Trainer:
    def __init__(self, cfg, dist: DistInfo):
        self.cfg, self.dist, self.tc = cfg, dist, cfg.train
        self.plan = resolve_plan(cfg.get("parallel"), dist)
        if self.plan.sharded and not torch.distributed.is_initialized():
            raise RuntimeError("parallel.fsdp needs a process group: start training through run() or torchrun")
        self.train_set = build_dataset(cfg.data, "train")
        self.val_set = build_dataset(cfg.data, "val")
        check_classes_fit(cfg.model, self.train_set)
        # known before building: a resume or a fork overwrites every weight, so the seeded init is skipped for them
        self.candidates = resume_candidates(cfg, remove_partial=dist.is_main)
        barrier()
        weights_from_checkpoint = bool(self.candidates or self.tc.init_from)
        # chosen once, here: the checkpoint loaded is this one, not whatever the parent has saved or pruned since
        self.fork_source = choose_parent_checkpoint(self.tc.init_from) \
            if self.tc.init_from and not self.candidates else None
        self.model, self.ema, self.optimizer, self.scheduler, generator = \
            build_training(cfg, self.plan, dist.device, initialise=not weights_from_checkpoint)
        self.state = TrainState(self.scheduler, generator, self.ema, config=OmegaConf.to_container(cfg, resolve=True),
                                data_fingerprint=fingerprint(self.train_set, self.val_set) if dist.is_main else None,
                                latents_vae=latents_vae(cfg.data) if dist.is_main else None)
        self.timer = PhaseTimer(enabled=self.tc.timing, device=dist.device)
        self.hooks = hooks_of(self.optimizer)  # what the loop tells the optimizer (optim/hooks.py)
        self.hooks.use_timer(self.timer)
        self.logger = MetricLogger(cfg.run_dir, cfg.logger, enabled=dist.is_main, resolved_config=self.state.config)
        self.evaluation = Evaluation(cfg, dist, self.val_set, self.logger)
        self.saver = CheckpointSaver(cfg.run_dir, self.tc.keep_last,
                                     resolve_async(self.tc.async_checkpoint, dist.device), self.logger.log,
                                     self.cfg.parallel.timeout_minutes, stop_grace_s=self.tc.stop_grace_s)
        self.preemption = Preemption(dist.rank)
        self.throughput = Throughput()
        self.window = StepWindow()  # every step's timings, averaged into the next log row
        self.deferred = DeferredSteps(self.timer.clock)  # steps not yet read to the host
        self.bad_steps = 0  # non-finite steps in a row

    # ---- checkpoints -------------------------------------------------------------------------------------
    def save(self) -> None:
        """Collective: every rank writes its shards (a single process writes everything), in the background
        with train.async_checkpoint (checkpoint_saver.py). Weights that are no longer finite are never saved: the
        run stops and the newest checkpoint stays the last good one."""
        if not weights_finite(self.model):
            raise TrainingStopped(f"step {self.state.step}: the weights are no longer finite, so they were not saved; "
                                  f"{self.last_good_checkpoint()}")
        if self.deferred.pending:  # run_steps reads them before every save; the train state must hold every step's
            self.take_deferred()  # loss and active time, or a resumed run's summary would miss them
        tensors = ckpt.tensor_state(self.model, self.optimizer, self.ema.model)
        if self.saver.last_write_s is not None:
            self.state.ckpt_write_s = self.saver.last_write_s
        self.saver.save(self.state.step, tensors, self.state.state_dict())

    def last_good_checkpoint(self) -> str:
        """Where a stopped run can go back to, in words. Collective: a save in flight holds good weights, so it is
        finished first."""
        self.saver.wait(self.state.step)
        good = ckpt.list_checkpoints(self.cfg.run_dir, remove_partial=False)
        if good:
            return f"the last good checkpoint is {good[-1]}, untouched"
        return "no checkpoint of this run has been written yet: nothing to go back to"

    def resume(self) -> None:
        """Continue from the checkpoint resume_policy chose (a damaged newest one falls back, loudly, under
        train.resume=auto), or start a fork from train.init_from's weights, or start fresh."""
        candidates = self.candidates
        if not candidates:
            if self.fork_source:
                source, self.ema.num_updates = load_fork(self.tc.init_from, self.fork_source, self.model,
                                                         self.ema.model)
                log.info("forked from %s: its model and EMA weights (the EMA after %d updates), a fresh optimizer, "
                         "step 0", source, self.ema.num_updates)
            return
        for path in candidates:
            try:
                self.state.load_state_dict(ckpt.load(path, self.model, self.optimizer, self.ema.model))
                break
            except Exception as e:  # noqa: BLE001 - with resume=auto a damaged checkpoint falls back, loudly
                if self.tc.resume != "auto" or path == candidates[-1]:
                    raise
                log.warning("checkpoint %s is unreadable (%s); trying the previous one", path, e)
        if path != candidates[0] and self.dist.is_main:  # the damaged newer ones end an abandoned timeline now
            with self.logger.paused():  # metrics.jsonl is rewritten without that timeline's rows
                moved = set_aside_after(self.cfg.run_dir, self.state.step, path)
            if moved:
                log.warning(moved)
        self.timer.take()  # drop anything timed while loading
        log.info("resumed from %s at step %d", path, self.state.step)
        told = grace_warning(self.state.ckpt_write_s, None, self.tc.stop_grace_s)  # as measured before the restart
        if told and self.dist.is_main:
            log.warning(told)

    # ---- one step ----------------------------------------------------------------------------------------
    def global_batch_noise(self, x: torch.Tensor):
        """Timesteps, noise and condition-dropout mask drawn for the global batch; this rank's slice of each."""
        B, W, rank, device = x.shape[0], self.dist.world_size, self.dist.rank, self.dist.device
        flow, gen = self.cfg.flow, self.state.generator
        t = sample_t(B * W, flow.t_sampling, flow.t_mean, flow.t_std, flow.shift, generator=gen, device=device)
        eps = torch.randn((B * W, *x.shape[1:]), generator=gen, device=device, dtype=x.dtype)
        drop = torch.rand(B * W, generator=gen, device=device) < self.cfg.model.class_dropout_prob
        mine = slice(rank * B, (rank + 1) * B)
        return t[mine], eps[mine], drop[mine]

    def train_step(self, x: torch.Tensor, cond: dict) -> dict:
        """Forward/backward/update on one batch. A non-finite loss or gradient skips the update and leaves the
        optimizer state untouched. train/loss and train/grad_norm come back as device tensors (read at log time,
        deferred_steps.py); the step's one host read is step_flags'."""
        t, eps, drop = self.global_batch_noise(x)
        loss = self.forward_backward(x, t, eps, drop, cond)
        max_norm = self.tc.grad_clip if self.tc.grad_clip > 0 else float("inf")
        grad_norm = global_grad_norm(self.model.parameters())
        # the global-batch loss and the ranks' stop votes in one all-reduce
        # (the vote is filled on the device: torch.tensor(vote, device=cuda) would be a blocking copy, a sync)
        votes = all_reduce_sum_(torch.stack([loss.float(),
                                             torch.full((), float(self.preemption.vote()), device=loss.device)]))
        loss = votes[0] / self.dist.world_size
        finite, stop_votes, scaled = self.step_flags(torch.isfinite(loss) & torch.isfinite(grad_norm), votes[1],
                                                     clip_scaled(grad_norm, max_norm))
        self.preemption.agree(stop_votes)
        self.hooks.gradients_scaled(scaled)  # an exchange started in backward holds only for unscaled gradients
        if finite:
            if scaled:  # clipping at a factor of 1 would leave every gradient as it is: that pass is skipped
                clip_grads_(self.model.parameters(), max_norm, grad_norm)
            with self.timer.phase("optimizer"):
                self.optimizer.step()
            self.ema.update(self.model)
            self.bad_steps = 0
        else:
            self.skip_update(loss, grad_norm)
        self.optimizer.zero_grad(set_to_none=True)
        lr = self.scheduler.get_last_lr()[0]  # the lr this step used: scheduler.step() sets the next step's
        self.scheduler.step()
        out = {"train/loss": loss, "train/grad_norm": grad_norm, "train/skipped": float(not finite), "lr": lr}
        if finite:
            out.update(self.hooks.step_info())
        return out

    @staticmethod
    def step_flags(finite: torch.Tensor, stop_votes: torch.Tensor,
                   scaled: torch.Tensor) -> tuple[bool, float, bool]:
        """The one host read of an ordinary step: whether to apply the update, and the ranks' stop votes, in one
        copy. Why it stays (docs/algorithms.md, "Host synchronisation"): skipping a non-finite step on the device
        would need a copy of every parameter and optimizer state to restore from, and host-side counters (the
        refresh schedule's step, the EMA's update count) that must not advance on a skipped step; the stop vote
        rides along for free, so a signal stops the run at the next step boundary, and so does whether clipping
        scaled the gradients (an exchange started in backward, optim/backward_overlap.py, is then not used)."""
        flag, votes, scaled = torch.stack([finite.float(), stop_votes.float(), scaled.float()]).tolist()
        return flag > 0, votes, scaled > 0

    def forward_backward(self, x, t, eps, drop, cond: dict) -> torch.Tensor:
        """Loss and gradients of this rank's batch, in micro-batches of train.micro_batch_size (gradient
        accumulation: each micro-batch's loss weighted by its share of the batch; under FSDP2 see
        micro_batch_sync). Returns the batch's mean loss (detached)."""
        batch = x.shape[0]
        micro = self.tc.micro_batch_size or batch  # config.validate.split_batch: the same rule, for the estimator
        total = None
        for lo in range(0, batch, micro):
            part = slice(lo, lo + micro)
            if micro < batch:
                micro_batch_sync(self.model, self.plan, self.optimizer, last=lo + micro >= batch)
            with self.timer.phase("forward"), autocast(self.tc.precision, self.dist.device):
                loss = velocity_loss(self.model, x[part], t[part], eps[part], drop_mask=drop[part],
                                     **{k: v[part] for k, v in cond.items()})
            if micro < batch:
                loss = loss * (x[part].shape[0] / batch)
            with self.timer.phase("backward"):  # under FSDP2 it includes the gradient reduce-scatter
                loss.backward()
            total = loss.detach() if total is None else total + loss.detach()
        return total

    def skip_update(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        self.bad_steps += 1
        self.state.skipped_steps += 1
        log.warning("step %d: non-finite loss/grad (loss=%s, grad_norm=%s); update skipped (%d in a row)",
                    self.state.step, loss.item(), grad_norm.item(), self.bad_steps)
        if self.bad_steps >= self.tc.max_bad_steps > 0:
            raise TrainingStopped(
                f"stopping at step {self.state.step}: {self.bad_steps} non-finite steps in a row "
                f"(train.max_bad_steps={self.tc.max_bad_steps}); {self.last_good_checkpoint()}")

    # ---- the loop ----------------------------------------------------------------------------------------
    def fit(self) -> dict:
        self.resume()
        summary_path = os.path.join(self.cfg.run_dir, "summary.json")
        if self.state.step == self.tc.steps and not os.path.exists(summary_path):
            return self.finish_end_of_run()  # a requeue after a signal during the end-of-run work
        if self.state.step >= self.tc.steps:  # a rerun of a finished run: nothing to train, nothing to rewrite
            if self.dist.is_main:
                print(f"run {self.cfg.run_dir} already finished at step {self.state.step} (train.steps="
                      f"{self.tc.steps}); summary.json left unchanged")
            self.logger.close()
            return read_summary(summary_path)
        if self.dist.is_main and self.state.step > 0 and os.path.exists(summary_path):
            os.remove(summary_path)  # an extended run is unfinished until its new last step
        if self.dist.is_main:
            print(f"model {self.cfg.model.name}: {count_parameters(self.model):,} parameters; "
                  f"data {self.train_set.dataset_id} ({len(self.train_set)} train / {len(self.val_set)} val)")
            print(f"optimizer {self.optimizer.routing_table}".replace(
                PER_TENSOR_HINT, "per tensor: the same command with train.dry_run=true"))
            print(f"parallel: {self.dist.world_size} process(es) on {self.dist.device.type}; {self.plan.describe()}")
            if self.plan.sharded and self.dist.world_size > 1:
                print(describe_run(self.model, self.plan, self.dist.world_size, ranks_per_node(self.dist.world_size)))
        try:
            with self.preemption:
                self.loop()
            self.saver.wait(self.state.step)
            return self.write_summary()
        except TrainingStopped:
            self.saver.wait(self.state.step)  # a save in flight from before the trouble holds good weights
            raise
        finally:
            self.logger.close()

    def finish_end_of_run(self) -> dict:
        """The end-of-run work (validation, grid, FD, metrics, summary.json) of a run whose training finished but
        whose end-of-run work was stopped (a signal after the last checkpoint, or a SIGKILL): run from the last
        checkpoint's EMA weights, so its numbers are those of an uninterrupted run. A study counts a run only once
        its summary exists; without this a requeue would leave it without its final evaluation."""
        state, tc = self.state, self.tc
        if self.dist.is_main:
            print(f"run {self.cfg.run_dir} finished training at step {state.step}, but its end-of-run work did not "
                  f"complete (no summary.json): running it now", flush=True)
            print(f"end of run: {', '.join(end_of_run_work(self.cfg, self.evaluation.val_images))} ...", flush=True)
        try:
            with self.preemption:
                best = (state.best_fd, dict(state.metric_best))
                skipped = self.evaluation.run_due(state.step, tc.steps, self.ema.model, state, self.stop_agreed)
                if (state.best_fd, state.metric_best) != best:
                    self.saver.record_train_state(state.step, state.state_dict())
                if self.preemption.requested and skipped:
                    self.saver.wait(state.step)
                    self.stop_agreed()  # who received a signal by now (run_steps: the same, for the same reason)
                    raise self.preemption.stop(state.step, self.cfg.run_dir, skipped, True)
            self.saver.wait(state.step)
            return self.write_summary()
        finally:
            self.logger.close()

    def write_summary(self) -> dict:
        """summary.json and the `done:` line (rank 0), and the logger's summary: the run's last act."""
        summary = write_summary(self.cfg, self.state, self.evaluation.last_val,
                                count_parameters(self.model), self.train_set.dataset_id, self.dist.is_main,
                                self.evaluation.metric_summary(self.state))
        self.logger.summary(summary)
        return summary

    def batches(self, until: int | None = None):
        """This rank's training batches from the current step up to `until` (default train.steps)."""
        tc, dist = self.tc, self.dist
        return train_batches(self.train_set, tc.batch_size, self.cfg.seed, self.state.step,
                             tc.steps if until is None else until, dist.rank, dist.world_size,
                             loader_workers(tc.num_workers, self.cfg.data.name, dist.device),
                             pin_memory=dist.device.type == "cuda")

    def step_on(self, x: torch.Tensor, y, data_start) -> dict:
        """One counted training step on a host batch whose wait began at clock mark `data_start`: moved to the
        device, train_step, queued unread (deferred_steps.py; take_deferred reads it). Returns the step's
        metrics, loss and grad norm still on the device."""
        device, clock = self.dist.device, self.timer.clock
        start = clock.mark()
        metrics = self.train_step(x.to(device, non_blocking=True),
                                  {k: v.to(device, non_blocking=True) for k, v in condition_kwargs(y).items()})
        self.deferred.add(PendingStep(metrics["train/loss"], metrics["train/grad_norm"], data_start, start,
                                      clock.mark(), self.timer.take(), metrics.get("opt/refresh")))
        self.state.step += 1
        return metrics

    def loop(self) -> None:
        progress = self.progress_bar()
        if self.dist.is_main and self.tc.progress and progress.disable:  # asked for, but stderr is no terminal
            self.logger.echo = ProgressLines(self.tc.steps, self.state.step)
        # the bar is closed however the loop ends, so that 'preempted: ...' or an error starts on its own line
        with progress, logging_beside_bars(not progress.disable):
            self.run_steps(progress)

    def run_steps(self, progress) -> None:
        tc, state, clock = self.tc, self.state, self.timer.clock
        data_start = clock.mark()
        for x, y in self.batches():
            metrics = self.step_on(x, y, data_start)
            logged = every_n_steps(state.step, tc.log_every, tc.steps)
            saved = every_n_steps(state.step, tc.ckpt_every) or state.step == tc.steps
            # the numbers are read only where something uses them (deferred_steps.py)
            if (logged or saved or self.preemption.requested or self.deferred.full
                    or any(self.evaluation.due(state.step, tc.steps).values())):
                last = self.take_deferred()
            if logged:
                self.log_train_row({**metrics, "train/loss": last.loss, "train/grad_norm": last.grad_norm},
                                   self.window.take(), progress)
            progress.update(1)
            last_step = state.step == tc.steps
            if last_step and state.skipped_steps >= state.step:  # a run shorter than max_bad_steps
                raise TrainingStopped(
                    f"every one of the run's {state.step} steps was skipped (non-finite loss or gradient), so "
                    f"nothing was trained; check the data (dit-encode-latents' factors, data.skip_corrupt) and lr")
            if last_step:  # the bar is closed before the end-of-run work, which says what it does
                self.announce_end_of_run(progress)
                self.save()  # before the evaluations: a signal (or the SIGKILL after it) during them loses no step
                # written, not in flight, when they start: an asynchronous save lost to a SIGKILL during them cost
                # ckpt_every steps, and a full disk met by a grid hid the save's own error and left its temp folder
                self.saver.wait(state.step)
            best = (state.best_fd, dict(state.metric_best))
            skipped = self.evaluation.run_due(state.step, tc.steps, self.ema.model, state, self.stop_agreed)
            if saved and not last_step:
                self.save()  # after the evaluations: the checkpoint holds their best FD and metric values
            elif last_step and (state.best_fd, state.metric_best) != best:
                self.saver.record_train_state(state.step, self.state.state_dict())
            # agreed by every rank at this step's all-reduce (or during the evaluations); once the last step's
            # work is all done there is nothing left to stop
            if self.preemption.requested and (skipped or not last_step):
                if not saved:
                    self.save()
                self.saver.wait(state.step)  # the run leaves with its checkpoint complete, never in flight
                # voted again (every rank is here: `requested` and `skipped` were agreed): torchrun passes a signal
                # to its ranks at almost the same moment, and one received before the step's vote and another just
                # after it would have rank 1 say "rank 0 did not" beside rank 0's own line (preemption.py)
                self.stop_agreed()
                raise self.preemption.stop(state.step, self.cfg.run_dir, skipped, last_step)
            self.saver.poll(state.step)
            data_start = clock.mark()

    def stop_agreed(self) -> bool:
        """Collective: whether any rank has received a stop signal (the evaluations' check; the training steps
        vote in their loss all-reduce instead). Also the last vote before a stop, once its checkpoint is complete:
        what each rank has received by then decides who says `preempted:` (preemption.py)."""
        votes = all_reduce_sum_(torch.full((), self.preemption.vote(), device=self.dist.device))
        self.preemption.agree(votes.item())
        return self.preemption.requested

    def take_deferred(self) -> StepNumbers:
        """Read every pending step and account for each as it happened: active time, throughput, timing window.
        Returns the newest step's numbers."""
        for numbers in self.deferred.read():
            self.state.active_time_s += numbers.step_time
            self.throughput.add(self.tc.batch_size, numbers.step_time + numbers.data_time)
            self.state.recent_losses.append(numbers.loss)  # the summary's train_loss, in the checkpoint
            self.window.add({**numbers.phases, "time/step": numbers.step_time, "time/data": numbers.data_time},
                            numbers.refresh)
        return numbers

    def announce_end_of_run(self, progress) -> None:
        progress.close()
        if self.dist.is_main:
            print(f"end of run: {', '.join(end_of_run_work(self.cfg, self.evaluation.val_images))} ...", flush=True)

    def progress_bar(self):
        """The steps' bar: on rank 0's terminal with train.progress (else a disabled bar with the same methods)."""
        return progress_bar(self.tc.steps, "train", self.dist.is_main and self.tc.progress, initial=self.state.step,
                            unit="step")

    def log_train_row(self, metrics: dict, window: dict, progress) -> None:
        """The logged step's own values (loss, grad norm, opt/refresh) with the window's timing means (step_window)."""
        metrics = {**metrics, **window, "imgs_per_s": self.throughput.take_rate(),
                   "active_time_s": self.state.active_time_s, "skipped_steps": self.state.skipped_steps}
        skipped_data = len(getattr(self.train_set, "skipped", ()))
        if skipped_data:
            metrics["data/skipped"] = skipped_data
        self.logger.log(self.state.step, metrics)
        if not progress.disable:
            progress.set_postfix(loss=f"{metrics['train/loss']:.4f}", imgs_s=f"{metrics['imgs_per_s']:.0f}")


def dry_run_for_launch(cfg) -> dict:
    """The dry run, checked for the world size its launcher set (WORLD_SIZE, or srun's), without joining a process
    group. Under torchrun only rank 0 prints: every rank would print the same."""
    from dit_train.parallel.fsdp import slurm_environment
    from dit_train.parallel.launch_rank import launch_rank

    environ = {**os.environ, **slurm_environment()}
    world = int(environ.get("WORLD_SIZE", "1"))
    validate(cfg, world)
    if launch_rank(environ) != 0:
        return {}
    return dry_run(cfg, world)


def run(cfg) -> dict:
    """Entry point behind `python -m dit_train`: validate, then dry run or train. Under torchrun (or with
    parallel.fsdp=true) this joins/creates the process group first and leaves it as it found it."""
    if cfg.train.dry_run:  # one process that joins no group: under torchrun, waiting for peers would hang it
        return dry_run_for_launch(cfg)
    had_group = torch.distributed.is_initialized()
    wants_group = wants_fsdp(cfg.get("parallel"), int(os.environ.get("WORLD_SIZE", "1")))
    dist = init_distributed(single_process_group=wants_group, timeout_minutes=cfg.parallel.timeout_minutes)
    lock = None
    try:
        if dist.world_size > 1:
            cfg = agree_on_config(cfg, dist)
        validate(cfg, dist.world_size)
        cfg = absolute_paths(cfg)
        check_buildable(cfg.optimizer.get("compile_rownorm"), dist.device)
        with collective_timeouts(cfg.parallel.timeout_minutes):
            lock = prepare_run_folder(cfg, dist)
            record_nccl_traces(cfg.run_dir)
            return Trainer(cfg, dist).fit()
    except ForkSourceGone:
        if dist.is_main and lock is not None:  # the fork loaded nothing: its folder is left as it was found
            forget_fork_start(cfg.run_dir)
        raise
    finally:
        if lock is not None:
            lock.release()
        if not had_group:
            shutdown_process_group(failing=sys.exc_info()[1])
