"""Streaming Gaussian statistics and the exact Fréchet distance (docs/algorithms.md §9).

FD = ||mu1 - mu2||^2 + Tr S1 + Tr S2 - 2 Tr (S1 S2)^(1/2), everything in float64.

The trace term uses the symmetric form: (S1 S2)^(1/2) is similar to (A S2 A)^(1/2) with A = S1^(1/2), so
Tr (S1 S2)^(1/2) = sum_i sqrt(lambda_i(A S2 A)). A comes from an eigendecomposition of S1 (eigenvalues clamped at 0)
and A S2 A is symmetric PSD, so a symmetric eigensolver gives real eigenvalues; the tiny negative ones that rounding
produces are clamped at 0. No general (non-symmetric, complex) sqrtm, no imaginary parts to discard.

Why not torchmetrics' ``FrechetInceptionDistance`` (it does accept a custom feature module with ``num_features``):
- its trace term is ``torch.linalg.eigvals(sigma1 @ sigma2).sqrt().real.sum()``: a non-symmetric complex
  eigensolve whose rounding noise becomes complex square roots that are silently dropped - not the symmetric,
  clamped form our spec (§9) asks for;
- reference statistics are its in-memory "real" states: caching them to disk keyed by encoder/dataset/preprocessing
  would mean writing its private state tensors by hand; and it keeps the feature network inside the metric, while
  our preprocessing (8-bit quantisation, resize, normalisation) belongs to the extractor and enters the cache key;
- its rank sync is its own ``dist_sync_fn``; ours is one float64 all_reduce of (count, sum, sum of outer products),
  which also works for the one-process-per-rank evaluation job and needs no extra dependency.
The accumulation it does (float64 sums and outer-product sums) is the same as ours, so nothing is lost.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass

import numpy as np
import torch


class RankDeficientWarning(UserWarning):
    """No more samples than feature dimensions: n samples give a covariance of rank at most n - 1, singular for
    n <= dim, and FD is biased upwards."""


@dataclass
class GaussianStats:
    """Mean, (unbiased, n - 1) covariance and sample count of a feature set, float64 numpy."""

    mean: np.ndarray
    cov: np.ndarray
    count: int

    @property
    def dim(self) -> int:
        return int(self.mean.shape[0])


class StreamingStats:
    """Running count, sum and sum of outer products of features, in float64 on ``device``.

    ``update`` takes batches ``[B, D]``; ``merge`` adds another accumulator; ``all_reduce`` sums over ranks (gloo and
    nccl both take float64); ``finalize`` gives ``GaussianStats``. Sums, not running means, so merging in any order or
    across ranks gives the same numbers up to float64 rounding.

    The sums are taken about a shift vector ``c`` (the first batch's mean): sum(f - c) and sum((f - c)(f - c)^T).
    Without it, cov = (sum f f^T - n mu mu^T) / (n - 1) cancels catastrophically when |mean| >> std (a feature with
    mean 1e4 and std 1e-2 loses all digits even in float64). Accumulators with different shifts are re-centred
    exactly before they are added (``recenter``), and ``all_reduce`` first agrees on the count-weighted shift.
    """

    def __init__(self, dim: int, device: torch.device | str = "cpu"):
        self.dim = int(dim)
        self.count = 0
        self.shift: torch.Tensor | None = None
        self.sum = torch.zeros(self.dim, dtype=torch.float64, device=device)
        self.outer = torch.zeros(self.dim, self.dim, dtype=torch.float64, device=device)

    @torch.no_grad()
    def update(self, feats: torch.Tensor) -> "StreamingStats":
        if feats.dim() != 2 or feats.shape[1] != self.dim:
            raise ValueError(f"features must be [B, {self.dim}], got {tuple(feats.shape)}")
        if feats.shape[0] == 0:
            return self
        f = feats.to(device=self.sum.device, dtype=torch.float64)
        if self.shift is None:
            self.shift = f.mean(0)
        f = f - self.shift
        self.count += f.shape[0]
        self.sum += f.sum(0)
        self.outer.addmm_(f.T, f)
        return self

    @torch.no_grad()
    def recenter(self, new_shift: torch.Tensor) -> "StreamingStats":
        """Express the sums about ``new_shift`` instead of the current shift (exact algebra)."""
        new_shift = new_shift.to(device=self.sum.device, dtype=torch.float64)
        if self.shift is not None and self.count > 0:
            delta = self.shift - new_shift  # f - new = (f - old) + delta
            self.outer += (torch.outer(self.sum, delta) + torch.outer(delta, self.sum)
                           + self.count * torch.outer(delta, delta))
            self.sum += self.count * delta
        self.shift = new_shift.clone()
        return self

    def merge(self, other: "StreamingStats") -> "StreamingStats":
        if other.dim != self.dim:
            raise ValueError(f"cannot merge statistics of dim {other.dim} into dim {self.dim}")
        if other.count == 0:
            return self
        if self.shift is None:
            self.shift = other.shift.to(self.sum.device).clone()
        o = StreamingStats(self.dim, self.sum.device)
        o.count, o.shift = other.count, other.shift.to(self.sum.device)
        o.sum, o.outer = other.sum.to(self.sum.device).clone(), other.outer.to(self.sum.device).clone()
        o.recenter(self.shift)
        self.count += o.count
        self.sum += o.sum
        self.outer += o.outer
        return self

    @torch.no_grad()
    def all_reduce(self, group=None) -> "StreamingStats":
        """Sum the statistics over the ranks of ``group`` (no-op when torch.distributed is not initialised).
        Two collectives: the count-weighted mean of the shifts (d + 1 floats), then count/sum/outer."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
            return self
        d, dev = self.dim, self.sum.device
        shift = self.shift if self.shift is not None else torch.zeros(d, dtype=torch.float64, device=dev)
        head = torch.cat([torch.tensor([float(self.count)], dtype=torch.float64, device=dev), self.count * shift])
        dist.all_reduce(head, op=dist.ReduceOp.SUM, group=group)
        common = head[1:] / head[0] if head[0] > 0 else torch.zeros(d, dtype=torch.float64, device=dev)
        self.recenter(common)
        buf = torch.cat([torch.tensor([float(self.count)], dtype=torch.float64, device=dev),
                         self.sum, self.outer.reshape(-1)])
        dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=group)
        self.count = int(round(buf[0].item()))
        self.sum = buf[1:1 + d].clone()
        self.outer = buf[1 + d:].reshape(d, d).clone()
        return self

    def finalize(self) -> GaussianStats:
        if self.count < 2:
            raise ValueError(f"need at least 2 samples for a covariance, have {self.count}")
        n = self.count
        s = self.sum.cpu().numpy()
        cov = (self.outer.cpu().numpy() - np.outer(s, s) / n) / (n - 1)
        cov = (cov + cov.T) / 2
        return GaussianStats(mean=self.shift.cpu().numpy() + s / n, cov=cov, count=n)


def stats_from_features(feats: np.ndarray | torch.Tensor) -> GaussianStats:
    """One-shot statistics (mean, unbiased covariance) of ``[N, D]`` features, float64."""
    x = feats.detach().cpu().double().numpy() if isinstance(feats, torch.Tensor) else np.asarray(feats, np.float64)
    return GaussianStats(mean=x.mean(0), cov=np.cov(x, rowvar=False).reshape(x.shape[1], x.shape[1]),
                         count=int(x.shape[0]))


def _as_f64(x) -> torch.Tensor:
    return torch.as_tensor(np.asarray(x, np.float64) if not isinstance(x, torch.Tensor) else x).to("cpu", torch.float64)


def _psd_sqrt(s: torch.Tensor) -> torch.Tensor:
    w, v = torch.linalg.eigh((s + s.T) / 2)
    return (v * w.clamp(min=0).sqrt()) @ v.T


@contextlib.contextmanager
def _single_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


# The linear algebra runs in torch (float64, CPU, one thread), not numpy. Measured on the 2-core dev box while other
# jobs ran: numpy's OpenBLAS pool fighting torch's still-spinning OpenMP workers after an encoder forward took 4-22 s
# for one 2048-d eigh, torch with 2 threads 10-37 s, torch with 1 thread 4.5 s. Multithreaded eigh degrades badly
# whenever cores are shared; once per evaluation a few seconds single-threaded is the robust choice.
def trace_sqrt_product(s1, s2) -> float:
    """Tr (S1 S2)^(1/2) for symmetric PSD S1, S2 via the eigenvalues of the symmetric A S2 A, A = S1^(1/2)."""
    with _single_thread():
        a = _psd_sqrt(_as_f64(s1))
        m = a @ _as_f64(s2) @ a
        ev = torch.linalg.eigvalsh((m + m.T) / 2)
    return float(ev.clamp(min=0).sqrt().sum())


NEGATIVE_FD_TOLERANCE = 1e-6  # relative to tr(S1) + tr(S2), the scale of the cancellation


class NegativeFDError(ValueError):
    """A clearly negative FD: numerical failure or invalid statistics, never a result to report."""


def frechet_distance(mu1, sigma1, mu2, sigma2) -> float:
    """FD between N(mu1, sigma1) and N(mu2, sigma2), float64, trace term from symmetric eigenvalues."""
    mu1, mu2, sigma1, sigma2 = (_as_f64(t) for t in (mu1, mu2, sigma1, sigma2))
    if mu1.shape != mu2.shape or sigma1.shape != sigma2.shape or sigma1.shape != (mu1.shape[0],) * 2:
        raise ValueError(f"shape mismatch: mu {tuple(mu1.shape)} vs {tuple(mu2.shape)}, sigma "
                         f"{tuple(sigma1.shape)} vs {tuple(sigma2.shape)}")
    diff = mu1 - mu2
    traces = float(sigma1.trace()) + float(sigma2.trace())
    fd = float(diff @ diff) + traces - 2 * trace_sqrt_product(sigma1, sigma2)
    # FD >= 0 exactly; rounding (FD ~ 0) can go slightly below: clamp that, refuse a clearly negative value
    tolerance = NEGATIVE_FD_TOLERANCE * max(traces, 1.0)
    if fd < -tolerance:
        raise NegativeFDError(f"FD came out {fd:.6g} (below -{tolerance:.3g}): the statistics are not valid "
                              f"covariances (not positive semi-definite?); recompute them")
    return max(fd, 0.0)


def fd_from_stats(a: GaussianStats, b: GaussianStats, warn: bool = True) -> float:
    """FD between two sets of statistics; warns (``RankDeficientWarning``) when a count is at most the feature dim
    (rank <= count - 1: singular)."""
    if a.dim != b.dim:
        raise ValueError(f"feature dims differ: {a.dim} vs {b.dim} (different encoders?)")
    if warn:
        for label, s in (("first", a), ("second", b)):
            if s.count <= s.dim:
                warnings.warn(
                    f"FD from {s.count} samples ({label} set) with feature dim {s.dim}: the covariance is "
                    f"rank-deficient and FD is biased; use more than {s.dim} samples and compare only equal counts",
                    RankDeficientWarning, stacklevel=2)
    return frechet_distance(a.mean, a.cov, b.mean, b.cov)
