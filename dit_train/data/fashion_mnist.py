"""Fashion-MNIST from its four idx files (Debian's dataset-fashion-mnist, or any folder holding the same files).
Images are padded 28 -> 32 (so patch sizes 2, 4, 8 divide them) and scaled to [-1, 1]; the official test split is
our validation split. The whole split is decoded into one uint8 tensor (47 MB for train): fast and simple."""

from __future__ import annotations

import gzip
import math
import os
import struct
import zlib

import numpy as np
import torch
from torch.utils.data import Dataset

from dit_train.data.fashion_mnist_files import DEFAULT_ROOT, FILES, find_file
from dit_train.data.shapes import FASHION_MNIST

MAX_GZIP_RATIO = 1032  # deflate's limit: no .gz holds more bytes than this per byte stored


def read_idx(path: str) -> np.ndarray:
    """Parse an idx file (gzipped or raw); a truncated or malformed file raises ValueError naming it. Data files may
    come from elsewhere: only a regular file is opened (a FIFO would hang the reader, a link to /dev/zero fill the
    memory), a header may not declare more bytes than the file can hold, and no more than it declares is read (a
    gzip bomb is never decompressed beyond that)."""
    if not os.path.isfile(path):
        raise ValueError(f"idx file {path} is not a regular file (a FIFO, device or folder)")
    gz = path.endswith(".gz")
    try:
        with (gzip.open if gz else open)(path, "rb") as f:
            head = f.read(4)
            if len(head) < 4 or head[:3] != b"\0\0\x08":
                raise ValueError(f"{path} is not a uint8 idx file (bad magic number)")
            ndim = head[3]
            sizes = f.read(4 * ndim)
            if len(sizes) < 4 * ndim:
                raise ValueError(f"{path} is truncated: its header ends early")
            dims = struct.unpack(">" + "I" * ndim, sizes)
            expected = math.prod(dims)  # exact: numpy's int64 product wraps for a crafted header
            room = os.path.getsize(path) * (MAX_GZIP_RATIO if gz else 1)
            if expected > room:
                raise ValueError(f"{path} is corrupt: header says {dims} ({expected} bytes), more than a "
                                 f"{os.path.getsize(path)}-byte file can hold")
            raw = f.read(expected + 1)
    except (OSError, EOFError, zlib.error) as e:
        raise ValueError(f"cannot read idx file {path}: {e}") from None
    if len(raw) != expected:
        found = "more" if len(raw) > expected else f"{len(raw)}"
        raise ValueError(f"{path} is truncated or corrupt: header says {dims} ({expected} bytes), found {found}")
    return np.frombuffer(raw, dtype=np.uint8).reshape(dims)


class FashionMNIST(Dataset):
    num_classes = FASHION_MNIST["num_classes"]

    def __init__(self, cfg, split: str):
        root = cfg.get("root") or DEFAULT_ROOT
        if not os.path.isdir(root):
            raise FileNotFoundError(
                f"data.root={root!r} does not exist; install the dataset with "
                f"`sudo apt-get install dataset-fashion-mnist` or point data.root at a folder with the idx files"
            )
        img_stem, lbl_stem = FILES[split]
        images = read_idx(find_file(root, img_stem))
        labels = read_idx(find_file(root, lbl_stem))
        if len(images) != len(labels):
            raise ValueError(f"{root}: {len(images)} images but {len(labels)} labels in the {split} split")
        size = cfg.image_size
        pad = size - 28  # >= 0: data.image_size >= 28 is checked by dit_train.config
        x = torch.from_numpy(images.copy())
        self.images = torch.nn.functional.pad(x, (pad // 2, pad - pad // 2, pad // 2, pad - pad // 2))
        self.labels = torch.from_numpy(labels.astype(np.int64))
        self._pixel_values = torch.arange(256, dtype=torch.uint8).float().div(127.5).sub(1.0).numpy()
        self.dataset_id = f"fashion_mnist:{split}:{size}px"

    def __len__(self) -> int:
        return len(self.labels)

    def content_index(self):
        """What identifies this split's data wherever it lives (data/datasets.py: data_fingerprint): every pixel and
        label (71 MB for both splits, hashed in ~0.1 s; Fashion-MNIST and MNIST have files of the same names and
        sizes)."""
        return self.images.numpy(), self.labels.numpy()

    def __getitem__(self, i):
        x = self.images[i].float().div(127.5).sub(1.0).unsqueeze(0)
        return x, int(self.labels[i])

    def __getitems__(self, indices: list[int]) -> list:
        """A batch's items, converted together (the DataLoader fetches a batch with this where it exists): the
        values __getitem__ gives, bit for bit (a table of the 256 pixel values made by __getitem__'s own ops), in
        two numpy gathers instead of four tensor ops per image. numpy, not torch, because it stays on one thread:
        torch splits a batch-sized op over the intra-op threads, which on a busy host waits ~50 ms per batch for a
        thread the cores are not giving it (measured); default_collate stacks the items as before."""
        x = torch.from_numpy(self._pixel_values[self.images.numpy()[indices]]).unsqueeze(1)
        return list(zip(x.unbind(0), self.labels.numpy()[indices].tolist()))
