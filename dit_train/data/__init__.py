"""Datasets by name. Each yields (x, y): x float32 CHW in [-1, 1] (or a latent), y an int label (or, for text-
conditioned latents, a dict with the embedding). Every dataset has a stable `dataset_id` for caching and logs."""

from __future__ import annotations

from omegaconf import OmegaConf

from ..config import check_data
from .fashion_mnist import FashionMNIST
from .image_folder import ImageFolder
from .latents import LatentShards
from .synthetic import Synthetic

DATASETS = {
    "fashion_mnist": FashionMNIST,
    "image_folder": ImageFolder,
    "latents": LatentShards,
    "synthetic": Synthetic,
}


def build_dataset(data_cfg, split: str):
    """data_cfg is the Hydra `data` node (or a partial mapping: missing keys from conf/data/<name>.yaml); split is
    'train' or 'val'."""
    values = check_data(data_cfg)
    if split not in ("train", "val"):
        raise ValueError(f"split={split!r} must be 'train' or 'val'")
    return DATASETS[values["name"]](OmegaConf.create(values), split)
