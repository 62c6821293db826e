"""Class sub-folders of images (root/<class>/<file>), read with PIL, resized (shorter side) and center-cropped,
RGB, scaled to [-1, 1]. The train split is root/train if it exists (and val root/val), otherwise root itself
for both (a held-out folder is then the user's job)."""

from __future__ import annotations

import os

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError
from torch.utils.data import Dataset

EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".webp", ".gif", ".tif", ".tiff")


def load_image(path: str, size: int) -> torch.Tensor:
    """RGB, shorter side resized to `size` (bicubic), center crop, CHW float in [-1, 1]."""
    with Image.open(path) as im:
        im = im.convert("RGB")
        w, h = im.size
        scale = size / min(w, h)
        im = im.resize((max(size, round(w * scale)), max(size, round(h * scale))), Image.BICUBIC)
        w, h = im.size
        left, top = (w - size) // 2, (h - size) // 2
        im = im.crop((left, top, left + size, top + size))
        arr = np.asarray(im, dtype=np.float32)
    return torch.from_numpy(arr).permute(2, 0, 1).div(127.5).sub(1.0)


class ImageFolder(Dataset):
    def __init__(self, cfg, split: str):
        root = cfg.get("root")
        if not root or not os.path.isdir(root):
            raise FileNotFoundError(f"data.root={root!r} is not a folder; image_folder needs root/<class>/<images>")
        if os.path.isdir(os.path.join(root, split)):
            root = os.path.join(root, split)
        self.size = cfg.image_size
        self.skip_corrupt = cfg.skip_corrupt
        self.classes = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))
        if not self.classes:
            raise FileNotFoundError(f"data.root={root!r} has no class sub-folders; expected root/<class>/<images>")
        self.samples: list[tuple[str, int]] = []
        self.skipped: set[str] = set()
        for label, cls in enumerate(self.classes):
            folder = os.path.join(root, cls)
            files = sorted(f for f in os.listdir(folder) if f.lower().endswith(EXTENSIONS))
            if not files:
                if not self.skip_corrupt:
                    raise ValueError(f"class folder {folder} has no images ({', '.join(EXTENSIONS)}); "
                                     f"remove it or set data.skip_corrupt=true")
                self.skipped.add(folder)
            self.samples += [(os.path.join(folder, f), label) for f in files]
        if not self.samples:
            raise ValueError(f"data.root={root!r} contains no images")
        self.num_classes = len(self.classes)
        self.dataset_id = f"image_folder:{os.path.abspath(root)}:{len(self.samples)}:{self.size}px"

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i):
        for attempt in range(len(self.samples)):
            path, label = self.samples[(i + attempt) % len(self.samples)]
            try:
                return load_image(path, self.size), label
            except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
                if not self.skip_corrupt:
                    raise ValueError(f"corrupt image {path}: {e} (set data.skip_corrupt=true to skip it)") from None
                self.skipped.add(path)  # counted in the training log as data/skipped
        raise ValueError(f"every image under data.root is unreadable (first: {self.samples[0][0]})")
