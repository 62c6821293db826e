"""Datasets by name. Each yields (x, y): x float32 CHW in [-1, 1] (or a latent), y an int label (or, for text-
conditioned latents, a dict with the embedding). Every dataset has a stable `dataset_id` for caching and logs."""

from __future__ import annotations

import hashlib

import torch
from omegaconf import OmegaConf

from dit_train.config import check_data
from dit_train.config import ConfigError
from dit_train.data.fashion_mnist import FashionMNIST
from dit_train.data.image_folder import ImageFolder
from dit_train.data.latents import LatentShards
from dit_train.data.synthetic import Synthetic

DATASETS = {
    "fashion_mnist": FashionMNIST,
    "image_folder": ImageFolder,
    "latents": LatentShards,
    "synthetic": Synthetic,
}


# datasets that read files per item (decoding, memory-mapped shards): on CUDA their batches are assembled in loader
# workers, so the host never stalls the step on reads (a latent item: 3 safetensors slices, ~0.1 ms here; 256 of
# them would be ~30 ms of the main process per step); in-memory sets gain nothing from workers
READS_FILES = {"image_folder", "latents"}
CUDA_LOADER_WORKERS = 4


def loader_workers(setting, data_name: str, device) -> int:
    """train.num_workers: an integer as given; 'auto' is CUDA_LOADER_WORKERS for a file-reading dataset on CUDA,
    else 0 (the main process: CPU runs share their cores with the step)."""
    if setting != "auto":
        return int(setting)
    return CUDA_LOADER_WORKERS if data_name in READS_FILES and torch.device(device).type == "cuda" else 0


def build_dataset(data_cfg, split: str):
    """data_cfg is the Hydra `data` node (or a partial mapping: missing keys take its schema's defaults); split is
    'train' or 'val'."""
    values = check_data(data_cfg)
    if split not in ("train", "val"):
        raise ValueError(f"split={split!r} must be 'train' or 'val'")
    return DATASETS[values["name"]](OmegaConf.create(values), split)


def check_classes_fit(model_cfg, dataset) -> None:
    """Labels must be < model.num_classes: label num_classes is the guidance null class, larger ones do not exist."""
    found = getattr(dataset, "num_classes", None)
    if model_cfg.num_classes and found and found > model_cfg.num_classes:
        raise ConfigError(f"model.num_classes={model_cfg.num_classes} is not valid: the training data has {found} "
                          f"classes ({dataset.dataset_id}); set model.num_classes={found}")


def fingerprint(train_set, val_set) -> dict:
    """The data a run trains and validates on, as JSON values that stay the same when its folder moves: the item
    counts and a hash of both splits' content_index(). Recorded in every checkpoint's train state; a resume with
    other data is refused (resume_policy.py)."""
    h = hashlib.sha256()
    for dataset in (train_set, val_set):
        for chunk in dataset.content_index():
            h.update(chunk)
        h.update(b"\0end of split\0")
    return {"train": len(train_set), "val": len(val_set), "sha256": h.hexdigest()[:16]}


def data_fingerprint(data_cfg) -> dict:
    """fingerprint() of the data `data_cfg` names (builds both splits: indexes, no image is decoded)."""
    return fingerprint(build_dataset(data_cfg, "train"), build_dataset(data_cfg, "val"))


def describe_fingerprint(fp: dict) -> str:
    return f"{fp['train']} train + {fp['val']} val items, sha256 {fp['sha256']}"
