"""Random tensors of a given shape, for benchmarks only: every log names this dataset 'synthetic'."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

from dit_train import seeds


class Synthetic(Dataset):
    def __init__(self, cfg, split: str):
        self.size = cfg.num_samples
        self.shape = (cfg.channels, cfg.image_size, cfg.image_size)
        self.num_classes = cfg.num_classes
        self.seed = 0 if split == "train" else 1
        self.dataset_id = f"synthetic:{split}:{'x'.join(map(str, self.shape))}"

    def __len__(self) -> int:
        return self.size

    def content_index(self):
        """What identifies this split's data (data/datasets.py: data_fingerprint): it is made from these values."""
        return [f"{self.seed}:{self.shape}:{self.size}:{self.num_classes}".encode()]

    def __getitem__(self, i):
        g = seeds.generator("synthetic", self.seed, i)
        return torch.randn(self.shape, generator=g), int(torch.randint(self.num_classes, (1,), generator=g))
