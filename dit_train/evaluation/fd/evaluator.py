"""FD evaluation during training (and for the evaluation job): sample with the EMA model, encode, compare with
cached reference statistics. (The trainer keeps the best value, evaluation.py.)"""

from __future__ import annotations

import math
import time
import warnings
from typing import Callable

import numpy as np
import torch

from dit_train import seeds
from dit_train.evaluation.fd.features import FeatureExtractor, build_extractor
from dit_train.evaluation.fd.frechet import RankDeficientWarning, StreamingStats, fd_from_stats
from dit_train.evaluation.fd.reference import ReferenceStats, load_or_compute_reference

SampleFn = Callable[[torch.Tensor, torch.Generator], torch.Tensor]

def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def generation_labels(ref_labels: np.ndarray, num: int, seed: int) -> torch.Tensor:
    """Class labels for ``num`` generated images with the class mix of the reference set: a seeded permutation of
    the reference labels, repeated when ``num`` exceeds the reference count. Fixed for a given (labels, num, seed)."""
    ref_labels = np.asarray(ref_labels, np.int64)
    if len(ref_labels) == 0:
        return torch.zeros(num, dtype=torch.long)
    perm = np.random.default_rng(seeds.seed_for("fd_labels", seed)).permutation(len(ref_labels))
    return torch.from_numpy(np.resize(ref_labels[perm], num).astype(np.int64))


class FDEvaluator:
    """Fréchet distance of generated samples against cached reference statistics.

    ``FDEvaluator(eval_cfg, data_cfg, device)`` builds the encoder ``eval_cfg.encoder`` (weights from
    ``eval_cfg.encoder_path``; a missing-weights error is raised here, at start, not after hours of training) and
    loads or computes the reference statistics of ``data_cfg``'s ``eval_cfg.reference_split`` split
    (``eval_cfg.reference_num`` images, cached under ``eval_cfg.cache_dir``). Under torch.distributed the
    constructor and ``evaluate`` are collectives: call them on every rank.

    ``evaluate(sample_fn, step) -> dict``:
      ``sample_fn(labels: LongTensor[B] on device, generator: torch.Generator on device) -> Tensor[B, C, H, W]``
      in [-1, 1] (clamped here before encoding; C = 1 or 3). ``eval_cfg.num_samples`` images are generated in batches
      of ``eval_cfg.batch_size``; batch ``b`` has fixed labels (the reference class mix, seeded by ``eval_cfg.seed``)
      and a generator seeded with ``batch_seed(seed, b)``, and batches are dealt round-robin to ranks, so the sample
      set is the same for any number of ranks. Feature statistics are all-reduced; rank 0 computes the FD and
      broadcasts it. Returned on every rank:
        ``fd`` (float), ``fd_encoder`` (encoder id incl. weights fingerprint), ``fd_num_gen``, ``fd_num_ref`` (ints),
        ``fd_ref_id`` (reference-statistics id), ``fd_time_s`` (wall time of this evaluation);
      and on rank 0 only: ``images``, the first generated batch (at most 64 images) as a CPU float32 tensor in
      [-1, 1], for a sample grid (``dit_train.evaluation.grids.save_grid``). Pop ``images`` before logging scalars.
    ``sample_fn`` is ``dit_train.diffusion.sampler.make_sampler(...)`` with ``eval_cfg.sample_steps`` and ``eval_cfg.cfg_scale``.
    """

    GRID_MAX = 64

    def __init__(self, eval_cfg, data_cfg, device: torch.device | str = "cpu", *,
                 extractor: FeatureExtractor | None = None, dataset=None, log: Callable[[str], None] = print,
                 progress: bool = False):
        from dit_train.config import check_eval

        self.cfg = cfg = check_eval(eval_cfg)  # checked; keys it lacks take EvalConfig's defaults
        self.device = torch.device(device)
        self.num_samples, self.batch_size = cfg["num_samples"], cfg["batch_size"]
        self.seed = cfg["seed"]
        dist = _dist()
        self.rank = dist.get_rank() if dist else 0
        self.world = dist.get_world_size() if dist else 1
        self.log = log if self.rank == 0 else (lambda *_: None)
        self.extractor = extractor or build_extractor(cfg["encoder"], cfg["encoder_path"], self.device,
                                                       trust_code=cfg["trust_encoder_code"])
        split = cfg["reference_split"]
        if dataset is None:
            from dit_train.data.datasets import build_dataset

            dataset = build_dataset(data_cfg, split)
        self.reference: ReferenceStats = load_or_compute_reference(
            self.extractor, dataset, split, cfg["reference_num"], cfg["cache_dir"],
            data_cfg=data_cfg, batch_size=self.batch_size, log=self.log, progress=progress)
        self.labels = generation_labels(self.reference.labels, self.num_samples, self.seed)
        # the key that set the count (a split smaller than eval.reference_num, or <= 0 for all of it: its size)
        ref_key = "eval.reference_num" if self.reference.count == cfg["reference_num"] else "the reference count"
        for count, what in ((self.num_samples, "eval.num_samples"), (self.reference.count, ref_key)):
            if count <= self.extractor.feature_dim:  # n samples: covariance of rank n - 1, singular for n <= d
                relation = "<" if count < self.extractor.feature_dim else "="
                self.log(f"[fd] {what}={count} {relation} feature dim {self.extractor.feature_dim} of "
                         f"{self.extractor.name}: covariance rank-deficient, FD biased (fine for tracking, compare "
                         f"only equal counts)")

    def my_batches(self) -> list[int | None]:
        """This rank's generation batches, dealt round-robin; None marks a padding turn. Every rank takes the same
        number of turns (sampling under FSDP2 is a collective), whatever the world size: the ranks with one batch
        fewer sample a batch they throw away."""
        nb = math.ceil(self.num_samples / self.batch_size)
        turns = math.ceil(nb / self.world)
        return [b if b < nb else None for b in range(self.rank, turns * self.world, self.world)]

    @torch.no_grad()
    def generated_stats(self, sample_fn: SampleFn) -> tuple[StreamingStats, torch.Tensor | None]:
        """This rank's share of the samples, encoded and accumulated, then all-reduced. Returns the statistics
        and (on the rank holding batch 0) the first batch of images."""
        acc = StreamingStats(self.extractor.feature_dim, device=self.device)
        first = None
        for b in self.my_batches():
            if b is None:  # padding: the same model calls as the other ranks, nothing kept
                sample_fn(self.labels[: self.batch_size].to(self.device),
                          seeds.generator("fd_noise", self.seed, -1, device=self.device))
                continue
            lo, hi = b * self.batch_size, min((b + 1) * self.batch_size, self.num_samples)
            labels = self.labels[lo:hi].to(self.device)
            gen = seeds.generator("fd_noise", self.seed, b, device=self.device)  # independent of the rank count
            imgs = sample_fn(labels, gen)
            if imgs.shape[0] != hi - lo:
                raise RuntimeError(f"sample_fn returned {imgs.shape[0]} images for {hi - lo} labels")
            imgs = imgs.float().clamp(-1, 1)
            if b == 0:
                first = imgs[: self.GRID_MAX].detach().cpu()
            acc.update(self.extractor(imgs))
        acc.all_reduce()
        return acc, first

    def evaluate(self, sample_fn: SampleFn, step: int) -> dict:
        t0 = time.perf_counter()
        acc, first = self.generated_stats(sample_fn)
        dist = _dist()
        out = [None]
        if self.rank == 0:
            if not bool(torch.isfinite(acc.sum).all()):
                fd = float("nan")
                self.log(f"[fd] step {step}: generated images gave non-finite features; FD = nan")
            else:
                with warnings.catch_warnings():  # said once, in words, when the evaluator was made
                    warnings.simplefilter("ignore", RankDeficientWarning)
                    fd = fd_from_stats(acc.finalize(), self.reference.stats)
            out = [fd]
        if dist:
            dist.broadcast_object_list(out, src=0)
        fd = float(out[0])
        res = {"fd": fd, "fd_encoder": self.extractor.encoder_id, "fd_num_gen": acc.count,
               "fd_num_ref": self.reference.count, "fd_ref_id": self.reference.ref_id,
               "fd_time_s": time.perf_counter() - t0}
        if first is not None:
            res["images"] = first
        return res
