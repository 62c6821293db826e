"""What a run measures besides its training loss, on the cadence of train.val_every / sample_every and
eval.every_n_steps: the validation velocity loss, sample grids and the FD (with the best FD so far), and each
registered metric (dit_train/evaluation/metric.py) every eval.<name>.every_n_steps. All of it uses
the EMA model and the same code for any number of ranks: every rank takes part in the model calls (FSDP2
gathers weights inside them), rank 0 alone writes files."""

from __future__ import annotations

import logging
import math
import os

import torch

from dit_train import seeds
from dit_train.trainer.cadence import every_n_steps
from dit_train.data.order import fixed_batches
from dit_train.diffusion.flow import validation_loss, validation_t_grid
from dit_train.evaluation.grids import save_grid
from dit_train.parallel.fsdp import all_reduce_sum_, autocast
from dit_train.diffusion.sampler import as_latents, make_sampler
from dit_train.telemetry.progress import model_call_bar, write
from dit_train.config import check_eval
from dit_train.evaluation.metric import METRICS, MetricContext, active_metrics

log = logging.getLogger("dit_train")
BEST_FD_KEYS = ("encoder", "ref_id", "num_gen")  # an FD is comparable only with one measured the same way
PART_NAMES = {"val": "validation loss", "fd": "FD", "samples": "sample grid"}


def grid_classes(model_cfg) -> int:
    """The classes a sample grid shows, one row each: the first 10 (one row for an unconditional model)."""
    return min(max(int(model_cfg.num_classes), 1), 10)


class _Stopped(Exception):
    """Raised inside a model call of the evaluation when the ranks have agreed to stop."""


def reference_data_config(data_cfg):
    """The real images FD compares with: the training data itself, or for latents the images they were made from
    (recorded by dit-encode-latents in latents_info.json)."""
    if data_cfg.name != "latents":
        return data_cfg
    from omegaconf import OmegaConf

    from dit_train.config.latents import read_latents_info

    source = read_latents_info(data_cfg.root).get("source")
    if source is None:
        raise ValueError(f"FD of a latent run compares with the images the latents were made from, but "
                         f"{data_cfg.root}/latents_info.json does not name them: re-encode with "
                         f"dit-encode-latents, or set eval.every_n_steps=0")
    from dit_train.runs.checkpoint import literal_config

    return OmegaConf.create(literal_config(source))  # a file from elsewhere: its strings are taken literally


def update_best_fd(best: dict | None, result: dict, step: int, active_time_s: float) -> dict | None:
    """The best FD after `result` (FDEvaluator.evaluate's dict): the lower finite value of the two, or the new
    one when the old was measured another way (encoder, reference or sample count)."""
    measured = {"encoder": result["fd_encoder"], "ref_id": result["fd_ref_id"], "num_gen": result["fd_num_gen"]}
    if best is not None and any(best.get(k) != measured[k] for k in BEST_FD_KEYS):
        log.warning("best FD %.4f was measured with other settings (%s); not compared with the new ones",
                    best["fd"], {k: best.get(k) for k in BEST_FD_KEYS})
        best = None
    fd = result["fd"]
    if math.isfinite(fd) and (best is None or fd < best["fd"]):
        return {"fd": fd, "step": int(step), "active_time_s": float(active_time_s), **measured}
    return best


class Evaluation:
    def __init__(self, cfg, dist, val_set, logger):
        self.cfg, self.dist, self.logger = cfg, dist, logger
        self.progress = bool(cfg.train.progress) and dist.is_main  # a bar per part, on a terminal
        tc = cfg.train
        # the whole held-out batches stay on the host; each rank evaluates its slice of every batch
        self.val_batches = list(fixed_batches(val_set, tc.val_samples, tc.val_batch_size))
        self.val_images = min(tc.val_samples, len(val_set))  # a val split smaller than train.val_samples: all of it
        self.t_grid = validation_t_grid(tc.val_t_points)
        # a latent run's samples are decoded by the VAE that made its latents (each rank decodes its own batches)
        self.codec = None
        if cfg.data.name == "latents" and cfg.vae.path:
            from dit_train.diffusion.vae import LatentCodec

            self.codec = LatentCodec(cfg.vae.path, dist.device, cfg.vae.decode_batch_size)
        self.fd = None
        if cfg.eval.every_n_steps:  # built now so that missing encoder weights fail before training starts
            from dit_train.evaluation.fd.evaluator import FDEvaluator

            self.fd = FDEvaluator(cfg.eval, reference_data_config(cfg.data), dist.device, log=write,
                                  progress=self.progress)
        self.last_val: dict = {}
        self.metrics = {m.name: m for m in active_metrics(check_eval(cfg.eval))}
        self.last_metrics: dict[str, dict] = {}  # metric name -> its last values and their step

    def due(self, step: int, final_step: int) -> dict[str, bool]:
        """Which of validation, FD, the registered metrics and sample grid run at `step`, in that order."""
        tc, ev = self.cfg.train, self.cfg.eval
        return {"val": every_n_steps(step, tc.val_every, final_step),
                "fd": self.fd is not None and every_n_steps(step, ev.every_n_steps, final_step),
                **{name: every_n_steps(step, m.cfg["every_n_steps"], final_step) for name, m in self.metrics.items()},
                "samples": every_n_steps(step, tc.sample_every, final_step)}

    def run_due(self, step: int, final_step: int, ema_model, state, should_stop=lambda: False) -> list[str]:
        """The evaluations due at `step`. `should_stop` (collective: every rank calls it at the same points, before
        each part and each call of the EMA model) ends them early, e.g. on a preemption signal: a 400-step grid
        can take minutes that a scheduler's grace period does not have. Returns the parts skipped, in words."""
        parts = [name for name, is_due in self.due(step, final_step).items() if is_due]

        def stop_before_model_call(_module, _args):
            if should_stop():
                raise _Stopped

        hook = ema_model.register_forward_pre_hook(stop_before_model_call)
        try:
            for i, name in enumerate(parts):
                if should_stop():
                    raise _Stopped
                with model_call_bar(ema_model, self.model_calls(name), PART_NAMES.get(name, name), self.progress, leave=False):
                    self.run_part(name, step, ema_model, state)
        except _Stopped:
            return [PART_NAMES.get(name, name) for name in parts[i:]]
        finally:
            hook.remove()
        return []

    def model_calls(self, name: str) -> int | None:
        """The EMA model calls of a part on this rank, for its progress bar (None: a registered metric's, unknown)."""
        tc = self.cfg.train
        if name in self.metrics:
            return None
        if name == "val":
            return len(self.val_batches) * len(self.t_grid)
        if name == "fd":
            return len(self.fd.my_batches()) * self.cfg.eval.sample_steps
        return tc.sample_steps

    def run_part(self, name: str, step: int, ema_model, state) -> None:
        if name == "val":
            self.last_val = self.validate(ema_model)
            self.logger.log(step, self.last_val)
        elif name == "fd":
            self.logger.log(step, self.evaluate_fd(ema_model, state))
        elif name in self.metrics:
            self.logger.log(step, self.measure(self.metrics[name], ema_model, state))
        else:
            self.sample_grid(ema_model, step)

    def validate(self, ema_model) -> dict:
        ema_model.eval()
        return validation_loss(ema_model, self.val_batches, self.t_grid, self.cfg.seed, self.dist.device,
                               lambda: autocast(self.cfg.train.precision, self.dist.device),
                               self.dist.rank, self.dist.world_size, all_reduce_sum_)

    def sampler(self, ema_model, steps: int, cfg_scale: float, decode: bool = True):
        """decode=False: a latent run's sampler returns the latents, unclamped, for a later decode."""
        finish = None if self.codec is None else self.codec.decode if decode else as_latents
        return make_sampler(ema_model, self.cfg.model, self.dist.device, steps, cfg_scale, self.cfg.train.precision,
                            decode=finish)

    def sample_grid(self, ema_model, step: int) -> str | None:
        """EMA samples of the first classes (the same noise at every step), or of the first held-out captions for
        text-conditioned data."""
        m, tc, device = self.cfg.model, self.cfg.train, self.dist.device
        k, classes = tc.samples_per_class, grid_classes(m)
        labels, context = torch.arange(classes).repeat_interleave(k), None
        _, y0 = self.val_batches[0]
        if isinstance(y0, dict):
            context = y0["context"][: len(labels)].to(device)
            labels = torch.zeros(len(context), dtype=torch.long)
        sample = self.sampler(ema_model, tc.sample_steps, tc.cfg_scale, decode=False)  # every rank: FSDP calls
        images = sample(labels, seeds.generator("grid_noise", self.cfg.seed, device=device), context=context)
        if not self.dist.is_main:
            return None
        if self.codec is not None:  # only the rank that saves the grid decodes it
            images = self.codec.decode(images)
        path = os.path.join(self.cfg.run_dir, "samples", f"step_{step:08d}.png")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        save_grid(images, path, nrow=k)
        self.logger.log_image(step, "samples", path)
        return path

    def evaluate_fd(self, ema_model, state) -> dict:
        """FD of EMA samples against the cached reference; the best value is kept in the TrainState."""
        ev = self.cfg.eval
        result = self.fd.evaluate(self.sampler(ema_model, ev.sample_steps, ev.cfg_scale), state.step)
        state.best_fd = update_best_fd(state.best_fd, result, state.step, state.active_time_s)
        images = result.pop("images", None)
        if images is not None and self.dist.is_main:
            os.makedirs(os.path.join(self.cfg.run_dir, "samples"), exist_ok=True)
            save_grid(images, os.path.join(self.cfg.run_dir, "samples", f"fd_step_{state.step:08d}.png"), nrow=8)
        out = {k: v for k, v in result.items() if isinstance(v, (int, float, str))}
        out["active_time_s"] = state.active_time_s
        out.update({f"fd_best/{k}": v for k, v in (state.best_fd or {}).items()})
        return out

    def measure(self, metric, ema_model, state) -> dict:
        """A registered metric's values as `<name>/<key>`; its best value is kept in the TrainState."""
        context = MetricContext(ema_model, state.step, self.cfg, self.val_batches,
                                lambda steps, cfg_scale: self.sampler(ema_model, steps, cfg_scale),
                                self.dist.device, self.dist.rank, self.dist.world_size)
        values = {k: float(v) for k, v in metric.measure(context).items()}
        best = state.metric_best.get(metric.name)
        if metric.primary in values and metric.is_better(values[metric.primary], best and best["value"]):
            state.metric_best[metric.name] = {"value": values[metric.primary], "step": state.step}
        self.last_metrics[metric.name] = {**values, "step": state.step}
        return {f"{metric.name}/{k}": v for k, v in values.items()}

    def metric_summary(self, state) -> dict:
        """summary.json's `metrics`: each registered metric's last values and best value ({} without any)."""
        return {name: {"last": self.last_metrics.get(name), "best": state.metric_best.get(name)}
                for name in self.metrics}


def end_of_run_work(cfg, val_images: int) -> list[str]:
    """What runs after the last step, in words, in order: on a short run it can take longer than the training (the
    validation and grid sizes are train.val_samples / sample_steps ...; val_every=0 or sample_every=0 skip them).
    `val_images`: the images the validation loss uses (train.val_samples, or fewer in a smaller split)."""
    tc, ev, last = cfg.train, cfg.eval, cfg.train.steps
    work = ["checkpoint"]  # first: a signal or a kill during the evaluations below loses no training
    if every_n_steps(last, tc.val_every, last):
        work.append(f"validation loss ({val_images} images x {tc.val_t_points} t)")
    if every_n_steps(last, ev.every_n_steps, last):
        work.append(f"FD ({ev.num_samples} samples, {ev.sample_steps} steps)")
    for metric in METRICS:
        node = cfg.eval.get(metric.name)
        if node is not None and every_n_steps(last, node.every_n_steps, last):
            work.append(metric.name)
    if every_n_steps(last, tc.sample_every, last):
        work.append(f"sample grid ({grid_classes(cfg.model) * tc.samples_per_class} images, {tc.sample_steps} steps)")
    return work + ["summary"]
