"""Class sub-folders of images (root/<class>/<file>), read with PIL, resized (shorter side) and center-cropped,
RGB, scaled to [-1, 1]. The train split is root/train if it exists (and val root/val), otherwise root itself.
Without a val/ folder the validation images are held out of the training images: an image is validation when a
seeded hash of its path relative to the split folder falls in the lowest VAL_FRACTION of the hash range, so the
split is the same on every machine and an image keeps its side when others are added or removed (validating on
the training images, as before, measured memorisation and called it validation)."""

from __future__ import annotations

import glob
import hashlib
import logging
import os
import warnings

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError
from torch.utils.data import Dataset

from dit_train.config.latents import LATENTS_INFO

log = logging.getLogger("dit_train")
VAL_FRACTION = 0.05  # of the images, held out as validation when the folder has no val/
HOLD_OUT_SEED = b"dit_train image_folder val v1\0"
EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".webp", ".gif", ".tif", ".tiff")


def load_image(path: str, size: int) -> torch.Tensor:
    """RGB, shorter side resized to `size` (bicubic), center crop, CHW float in [-1, 1]. 16-bit and float images
    are scaled from their own range (converting them to 8-bit RGB the PIL way saturates them)."""
    with open_image(path) as im:
        if im.mode in WIDE_MODES:
            full_scale = 1.0 if im.mode == "F" else 65535.0  # PIL reads 16-bit PNG/TIFF as I;16 or I
            im = Image.fromarray(np.asarray(im, dtype=np.float32) * (255.0 / full_scale), mode="F")
        else:
            im = im.convert("RGB")
        w, h = im.size
        scale = size / min(w, h)
        im = im.resize((max(size, round(w * scale)), max(size, round(h * scale))), Image.BICUBIC)
        w, h = im.size
        left, top = (w - size) // 2, (h - size) // 2
        im = im.crop((left, top, left + size, top + size))
        arr = np.asarray(im, dtype=np.float32)
    if arr.ndim == 2:  # grey (16-bit or float): the same value in R, G and B
        arr = np.repeat(arr[:, :, None], 3, axis=2)
    return torch.from_numpy(arr.clip(0, 255)).permute(2, 0, 1).div(127.5).sub(1.0)


def open_image(path: str):
    """PIL's image of a regular file: a FIFO in an image folder from elsewhere would hang the reader. An image past
    Image.MAX_IMAGE_PIXELS (89 M pixels) is a decompression bomb here: PIL raises only past twice that and below it
    warns and decodes, so a 100 M-pixel PNG of a few hundred kB was decoded in full for every sample of it."""
    if not os.path.isfile(path):
        raise OSError(f"{path} is not a regular file (a FIFO, device or folder)")
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        return Image.open(path)


WIDE_MODES = ("I;16", "I;16B", "I;16L", "I", "F")
UNREADABLE = (UnidentifiedImageError, OSError, SyntaxError, ValueError, Image.DecompressionBombError,
              Image.DecompressionBombWarning)


def split_folder(root: str, split: str) -> str:
    """The folder a split's class folders are in: root/<split>, else (val without root/val) the train folder."""
    if os.path.isdir(os.path.join(root, split)):
        return os.path.join(root, split)
    return split_folder(root, "train") if split == "val" else root


def class_folders(folder: str) -> list[str]:
    return sorted(d for d in os.listdir(folder) if os.path.isdir(os.path.join(folder, d)))


def no_class_folders(top: str, folder: str) -> str:
    """Why data.root `top` (its split folder `folder`) has no classes, naming the root as typed: it named
    `root/train` only, and a latents folder (image_folder on dit-encode-latents' output) was not recognised."""
    if os.path.isfile(os.path.join(top, LATENTS_INFO)) or glob.glob(os.path.join(folder, "*.safetensors")):
        return (f"data.root={top!r} is a latents folder (dit-encode-latents' shards), not images: use data=latents "
                f"for it")
    inside = f" (in its {os.path.relpath(folder, top)}/ folder)" if folder != top else ""
    return (f"data.root={top!r} has no class sub-folders{inside}; expected root/<class>/<images>, or "
            f"root/train/<class>/... and root/val/<class>/...")


def first_image_sizes(folder: str, classes: list[str]) -> list[tuple[int, int]]:
    """(width, height) of the first readable image (by name) of each class: headers only, one file per class."""
    sizes = []
    for cls in classes:
        for name in sorted(os.listdir(os.path.join(folder, cls))):
            if name.lower().endswith(EXTENSIONS):
                try:
                    with open_image(os.path.join(folder, cls, name)) as im:
                        sizes.append(im.size)
                    break
                except UNREADABLE:
                    continue
    return sizes


def held_out(relative_path: str) -> bool:
    """Whether an image of a folder without val/ is validation: its hash in the lowest VAL_FRACTION."""
    digest = hashlib.sha256(HOLD_OUT_SEED + os.fsencode(relative_path)).digest()  # a name's bytes, UTF-8 or not
    return int.from_bytes(digest[:8], "big") < VAL_FRACTION * 2 ** 64


def hold_out(samples: list[tuple[str, int]], folder: str, split: str) -> list[tuple[str, int]]:
    """The `split` part of a folder's images when it has no val/: held_out() ones are validation; a folder too
    small for any to fall there gives its lowest-hash image (one image: validation is then that training image)."""
    keys = [os.path.relpath(p, folder) for p, _ in samples]
    val = {k for k in keys if held_out(k)}
    if not val and samples:
        val = {min(keys, key=lambda k: hashlib.sha256(HOLD_OUT_SEED + os.fsencode(k)).digest())}
    if len(val) == len(samples):
        return samples
    return [s for s, k in zip(samples, keys) if (k in val) == (split == "val")]


class ImageFolder(Dataset):
    def __init__(self, cfg, split: str):
        top = cfg.get("root")
        if not top or not os.path.isdir(top):
            raise FileNotFoundError(f"data.root={top!r} is not a folder; image_folder needs root/<class>/<images>")
        root = split_folder(top, split)
        self.size = cfg.image_size
        self.skip_corrupt = cfg.skip_corrupt
        self.unreadable_hint = "set data.skip_corrupt=true to skip it"
        self.classes = class_folders(root)
        if not self.classes:
            raise FileNotFoundError(no_class_folders(top, root))
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
        if not os.path.isdir(os.path.join(top, "val")):
            everything = len(self.samples)
            self.samples = hold_out(self.samples, root, split)
            if split == "val":
                log.info("data.root=%s has no val/ folder: %d of its %d images are held out as validation (sha256 "
                         "of each image's relative path, the lowest %g of the range) and not trained on", top,
                         len(self.samples), everything, VAL_FRACTION)
        self.num_classes = len(self.classes)
        self.root = root
        self.dataset_id = f"image_folder:{os.path.abspath(root)}:{len(self.samples)}:{self.size}px"

    def in_order_only(self, hint: str) -> None:
        """For a reader whose item i must be image i (dit-encode-latents: a shard holds its images' latents in
        order): an unreadable image is refused with `hint`, never replaced by the next one (data.skip_corrupt's
        substitute stored the next image's latent twice). Empty class folders are still skipped if asked."""
        self.skip_corrupt, self.unreadable_hint = False, hint

    def __len__(self) -> int:
        return len(self.samples)

    def content_index(self):
        """What identifies this split's data wherever it lives (data/datasets.py: data_fingerprint): the file list
        (paths relative to the split's folder) with the labels; no file is opened or stat-ed, so a file rewritten
        under the same name is not noticed."""
        return [os.fsencode("".join(f"{os.path.relpath(p, self.root)}\t{label}\n" for p, label in self.samples))]

    def __getitem__(self, i):
        for attempt in range(len(self.samples)):
            path, label = self.samples[(i + attempt) % len(self.samples)]
            try:
                return load_image(path, self.size), label
            except UNREADABLE as e:  # a decompression bomb too: named, skipped like any unreadable image
                if not self.skip_corrupt:
                    raise ValueError(f"corrupt image {path}: {e} ({self.unreadable_hint})") from None
                self.skipped.add(path)  # counted in the training log as data/skipped
        raise ValueError(f"every image under data.root is unreadable (first: {self.samples[0][0]})")
