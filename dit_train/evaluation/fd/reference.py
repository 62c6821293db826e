"""Reference statistics of a real dataset split for one encoder, computed once and cached as .npz.

The cache key hashes everything the numbers depend on: encoder id (network + weights fingerprint), the extractor's
preprocessing string, the dataset id (``dataset.dataset_id``), the split, the number of images and how they were
chosen (a seeded permutation), and a format version. Change any of those and a new file is computed; otherwise the
file is reused by every evaluation (in training and in ``dit-fd``).

The .npz holds: mean [D], cov [D, D] (float64, unbiased), count, labels [count] (int64, the class labels of the
reference images, used to condition generation with the same class mix), encoder_id, dataset_id, split,
preprocessing, subset, key, format.

Under torch.distributed the images are sharded across ranks and the statistics all-reduced; rank 0 writes the
file (atomically: temp file + rename). Every rank must call ``load_or_compute_reference``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dit_train import seeds

from dit_train.evaluation.fd.features import FeatureExtractor
from dit_train.evaluation.fd.frechet import GaussianStats, StreamingStats
from dit_train.telemetry.progress import progress_bar

FORMAT_VERSION = 1


@dataclass
class ReferenceStats:
    stats: GaussianStats
    labels: np.ndarray
    encoder_id: str
    dataset_id: str
    split: str
    preprocessing: str
    subset: str
    key: str
    path: Path | None = None

    @property
    def count(self) -> int:
        return self.stats.count

    @property
    def ref_id(self) -> str:
        """Short, human-readable id reported with every FD value."""
        return f"{self.dataset_id}:{self.split}:n{self.count}:{self.key[:10]}"


def _dist():
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist
    return None


def subset_indices(n_total: int, num: int, seed: int = 0) -> tuple[np.ndarray, str]:
    """The reference images: all of the split when num <= 0 or num >= n_total, else a seeded random subset
    (sorted, for I/O locality). Returns (indices, description for the cache key)."""
    if num <= 0 or num >= n_total:
        return np.arange(n_total), f"all{n_total}"
    idx = torch.randperm(n_total, generator=seeds.generator("reference", seed))[:num].sort().values.numpy()
    return idx, f"perm(stream=reference,seed={seed})[:{num}]of{n_total}"


def reference_key(encoder_id: str, preprocessing: str, dataset_id: str, split: str, subset: str) -> str:
    blob = json.dumps(dict(encoder_id=encoder_id, preprocessing=preprocessing, dataset_id=dataset_id, split=split,
                           subset=subset, format=FORMAT_VERSION), sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def _slug(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", s).strip("-")[:60]


def cache_path(cache_dir: str | os.PathLike, encoder_name: str, dataset_id: str, split: str, key: str) -> Path:
    return Path(os.path.expanduser(str(cache_dir))) / f"ref_{_slug(dataset_id)}_{split}_{_slug(encoder_name)}_{key}.npz"


def save_reference(ref: ReferenceStats, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    os.close(fd)
    try:
        with open(tmp, "wb") as f:
            np.savez(f, mean=ref.stats.mean, cov=ref.stats.cov, count=np.int64(ref.count),
                     labels=ref.labels.astype(np.int64), encoder_id=np.str_(ref.encoder_id),
                     dataset_id=np.str_(ref.dataset_id), split=np.str_(ref.split),
                     preprocessing=np.str_(ref.preprocessing), subset=np.str_(ref.subset), key=np.str_(ref.key),
                     format=np.int64(FORMAT_VERSION))
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load_reference(path: str | os.PathLike) -> ReferenceStats:
    path = Path(path)
    with np.load(path, allow_pickle=False) as z:
        return ReferenceStats(
            stats=GaussianStats(mean=z["mean"], cov=z["cov"], count=int(z["count"])), labels=z["labels"],
            encoder_id=str(z["encoder_id"]), dataset_id=str(z["dataset_id"]), split=str(z["split"]),
            preprocessing=str(z["preprocessing"]), subset=str(z["subset"]), key=str(z["key"]), path=path)


def load_checked_reference(path: str | os.PathLike, feature_dim: int, count: int) -> ReferenceStats:
    """load_reference for a cache file that may come from elsewhere (a shared cache_dir): its members may decompress
    to no more than a [D, D] covariance or [count] labels (a zip bomb is refused before it is read), and it must hold
    the shapes of the statistics its key names, with finite numbers and integer labels. ValueError otherwise."""
    import zipfile

    limit = 8 * max(feature_dim * feature_dim, count) + 4096  # float64 / int64 arrays and their .npy headers
    with zipfile.ZipFile(path) as z:
        big = [(i.filename, i.file_size) for i in z.infolist() if i.file_size > limit]
    if big:
        raise ValueError(f"its {big[0][0]} declares {big[0][1]} bytes, more than statistics of {feature_dim} "
                         f"features and {count} images take")
    ref = load_reference(path)
    mean, cov, labels = ref.stats.mean, ref.stats.cov, ref.labels
    expected = ((feature_dim,), (feature_dim, feature_dim), (count,), count)
    if (mean.shape, cov.shape, labels.shape, ref.count) != expected:
        raise ValueError(f"it holds mean {list(mean.shape)}, cov {list(cov.shape)}, labels {list(labels.shape)} and "
                         f"count {ref.count}, not the statistics of {feature_dim} features and {count} images")
    if not (np.issubdtype(mean.dtype, np.floating) and np.issubdtype(cov.dtype, np.floating)
            and np.isfinite(mean).all() and np.isfinite(cov).all() and np.issubdtype(labels.dtype, np.integer)):
        raise ValueError("its statistics are not finite floating-point numbers, or its labels not integers")
    check_covariance(cov)
    return ref


def check_covariance(cov: np.ndarray) -> None:
    """ValueError unless `cov` is symmetric positive semi-definite up to rounding: another matrix gives an FD that
    means nothing (even a negative one). A sample covariance from fewer images than features has zero eigenvalues
    that round to about -1e-16 of the largest; -1e-8 of it leaves room for float32 writers too."""
    scale = float(np.abs(cov).max()) if cov.size else 0.0
    if not np.allclose(cov, cov.T, rtol=0, atol=1e-8 * scale):
        raise ValueError("its covariance is not symmetric")
    lowest = float(np.linalg.eigvalsh(cov)[0]) if cov.size else 0.0
    if lowest < -1e-8 * scale:
        raise ValueError(f"its covariance is not positive semi-definite (an eigenvalue {lowest:.3g})")


def dataset_id_of(dataset, data_cfg=None) -> str:
    did = getattr(dataset, "dataset_id", None)
    if did:
        return str(did)
    # fallback: the data config itself (stable as long as the config is)
    cfg = dict(data_cfg) if data_cfg is not None else {"class": type(dataset).__name__, "len": len(dataset)}
    return "cfg-" + hashlib.sha256(json.dumps(cfg, sort_keys=True, default=str).encode()).hexdigest()[:12]


@torch.no_grad()
def compute_reference(extractor: FeatureExtractor, dataset, indices: np.ndarray, batch_size: int = 100,
                      num_workers: int = 0, progress: bool = False) -> tuple[GaussianStats, np.ndarray]:
    """Statistics of ``extractor`` features over ``dataset[indices]`` (sharded over ranks, then all-reduced),
    and the labels of those images in ``indices`` order (gathered on every rank)."""
    dist = _dist()
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist else (0, 1)
    mine = indices[rank::world]
    loader = torch.utils.data.DataLoader(torch.utils.data.Subset(dataset, mine.tolist()), batch_size=batch_size,
                                         shuffle=False, num_workers=num_workers)
    acc = StreamingStats(extractor.feature_dim, device=extractor.device)
    labels = []
    with progress_bar(len(loader), f"reference statistics ({extractor.name})", progress and rank == 0,
                      unit="batch") as bar:  # closed on an error too: its message gets a line of its own
        for x, y in loader:
            if not torch.is_tensor(x) or x.dim() != 4 or x.shape[1] not in (1, 3):
                raise ValueError(f"reference images must be [B, C, H, W] pixels in [-1, 1] with C = 1 or 3, got "
                                 f"{tuple(getattr(x, 'shape', ()))}: FD needs an image dataset (latents must be "
                                 f"decoded)")
            acc.update(extractor(x))
            try:
                labels.append(torch.as_tensor(y).reshape(-1).long())
            except (TypeError, ValueError, RuntimeError):  # e.g. text conditions: no class labels to mimic
                labels.append(torch.zeros(x.shape[0], dtype=torch.long))
            bar.update(1)
    acc.all_reduce()
    my_labels = torch.cat(labels).numpy() if labels else np.zeros(0, np.int64)
    if dist:
        parts = [None] * world
        dist.all_gather_object(parts, my_labels)
        all_labels = np.zeros(len(indices), np.int64)
        for r, part in enumerate(parts):
            all_labels[r::world] = part
    else:
        all_labels = my_labels
    return acc.finalize(), all_labels


def load_or_compute_reference(extractor: FeatureExtractor, dataset, split: str, num: int, cache_dir,
                              *, data_cfg=None, batch_size: int = 100, seed: int = 0, num_workers: int = 0,
                              recompute: bool = False, progress: bool = False, log=print) -> ReferenceStats:
    """Cached reference statistics (see module docstring). A collective when torch.distributed is initialised."""
    dataset_id = dataset_id_of(dataset, data_cfg)
    indices, subset = subset_indices(len(dataset), num, seed)
    key = reference_key(extractor.encoder_id, extractor.preprocessing, dataset_id, split, subset)
    path = cache_path(cache_dir, extractor.name, dataset_id, split, key) if cache_dir else None
    dist = _dist()
    rank = dist.get_rank() if dist else 0

    hit = None
    if path is not None and not recompute and rank == 0 and path.is_file():
        try:
            cand = load_checked_reference(path, extractor.feature_dim, len(indices))
            if (cand.key, cand.encoder_id, cand.preprocessing, cand.dataset_id, cand.split, cand.subset) == (
                    key, extractor.encoder_id, extractor.preprocessing, dataset_id, split, subset):
                hit = cand
            else:
                log(f"[fd] cached reference {path} does not match the request; recomputing")
        except Exception as e:  # noqa: BLE001 - a corrupt cache file is recomputed, not fatal
            log(f"[fd] could not read cached reference {path} ({type(e).__name__}: {e}); recomputing")
    if dist:
        flag = [hit is not None]
        dist.broadcast_object_list(flag, src=0)
        have = flag[0]
    else:
        have = hit is not None
    if have:
        obj = [hit]
        if dist:  # every rank gets the same statistics and labels
            dist.broadcast_object_list(obj, src=0)
        if rank == 0:
            log(f"[fd] reference statistics from cache {path} (n={hit.count})")
        return obj[0]

    stats, labels = compute_reference(extractor, dataset, indices, batch_size=batch_size, num_workers=num_workers,
                                      progress=progress)
    ref = ReferenceStats(stats=stats, labels=labels, encoder_id=extractor.encoder_id, dataset_id=dataset_id,
                         split=split, preprocessing=extractor.preprocessing, subset=subset, key=key, path=path)
    if path is not None and rank == 0:
        save_reference(ref, path)
        log(f"[fd] reference statistics computed (n={ref.count}, dim={stats.dim}) and cached at {path}")
    if dist:
        dist.barrier()
    return ref
