"""What a run measures besides its training loss, on the cadence of train.val_every / sample_every and
eval.every_n_steps: the validation velocity loss, sample grids and the FD (with the best FD so far). All of it uses
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
from dit_train.diffusion.sampler import make_sampler

log = logging.getLogger("dit_train")
BEST_FD_KEYS = ("encoder", "ref_id", "num_gen")  # an FD is comparable only with one measured the same way
PART_NAMES = {"val": "validation loss", "fd": "FD", "samples": "sample grid"}


class _Stopped(Exception):
    """Raised inside a model call of the evaluation when the ranks have agreed to stop."""


def reference_data_config(data_cfg):
    """The real images FD compares with: the training data itself, or for latents the images they were made from
    (recorded by scripts/encode_latents.py in latents_info.json)."""
    if data_cfg.name != "latents":
        return data_cfg
    from omegaconf import OmegaConf

    from dit_train.config.latents import read_latents_info

    source = read_latents_info(data_cfg.root).get("source")
    if source is None:
        raise ValueError(f"FD of a latent run compares with the images the latents were made from, but "
                         f"{data_cfg.root}/latents_info.json does not name them: re-encode with "
                         f"scripts/encode_latents.py, or set eval.every_n_steps=0")
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
        tc = cfg.train
        # the whole held-out batches stay on the host; each rank evaluates its slice of every batch
        self.val_batches = list(fixed_batches(val_set, tc.val_samples, tc.val_batch_size))
        self.t_grid = validation_t_grid(tc.val_t_points)
        # a latent run's samples are decoded by the VAE that made its latents (each rank decodes its own batches)
        self.codec = None
        if cfg.data.name == "latents" and cfg.vae.path:
            from dit_train.diffusion.vae import LatentCodec

            self.codec = LatentCodec(cfg.vae.path, dist.device, cfg.vae.decode_batch_size)
        self.fd = None
        if cfg.eval.every_n_steps:  # built now so that missing encoder weights fail before training starts
            from dit_train.evaluation.fd.evaluator import FDEvaluator

            self.fd = FDEvaluator(cfg.eval, reference_data_config(cfg.data), dist.device)
        self.last_val: dict = {}

    def due(self, step: int, final_step: int) -> dict[str, bool]:
        """Which of validation, FD and sample grid run at `step`."""
        tc, ev = self.cfg.train, self.cfg.eval
        return {"val": every_n_steps(step, tc.val_every, final_step),
                "fd": self.fd is not None and every_n_steps(step, ev.every_n_steps, final_step),
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
                self.run_part(name, step, ema_model, state)
        except _Stopped:
            return [PART_NAMES[name] for name in parts[i:]]
        finally:
            hook.remove()
        return []

    def run_part(self, name: str, step: int, ema_model, state) -> None:
        if name == "val":
            self.last_val = self.validate(ema_model)
            self.logger.log(step, self.last_val)
        elif name == "fd":
            self.logger.log(step, self.evaluate_fd(ema_model, state))
        else:
            self.sample_grid(ema_model, step)

    def validate(self, ema_model) -> dict:
        ema_model.eval()
        return validation_loss(ema_model, self.val_batches, self.t_grid, self.cfg.seed, self.dist.device,
                               lambda: autocast(self.cfg.train.precision, self.dist.device),
                               self.dist.rank, self.dist.world_size, all_reduce_sum_)

    def sampler(self, ema_model, steps: int, cfg_scale: float, decode: bool = True):
        return make_sampler(ema_model, self.cfg.model, self.dist.device, steps, cfg_scale, self.cfg.train.precision,
                            decode=self.codec.decode if decode and self.codec is not None else None)

    def sample_grid(self, ema_model, step: int) -> str | None:
        """EMA samples of the first classes (the same noise at every step), or of the first held-out captions for
        text-conditioned data."""
        m, tc, device = self.cfg.model, self.cfg.train, self.dist.device
        k, classes = tc.samples_per_class, min(max(m.num_classes, 1), 10)
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


def end_of_run_work(cfg) -> list[str]:
    """What runs after the last step, in words, in order: on a short run it can take longer than the training (the
    validation and grid sizes are train.val_samples / sample_steps ...; val_every=0 or sample_every=0 skip them)."""
    tc, ev, last = cfg.train, cfg.eval, cfg.train.steps
    work = ["checkpoint"]  # first: a signal or a kill during the evaluations below loses no training
    if every_n_steps(last, tc.val_every, last):
        work.append(f"validation loss ({tc.val_samples} images x {tc.val_t_points} t)")
    if every_n_steps(last, ev.every_n_steps, last):
        work.append(f"FD ({ev.num_samples} samples, {ev.sample_steps} steps)")
    if every_n_steps(last, tc.sample_every, last):
        classes = min(max(cfg.model.num_classes, 1), 10)
        work.append(f"sample grid ({classes * tc.samples_per_class} images, {tc.sample_steps} steps)")
    return work + ["summary"]
