"""Sample grids as PNG (PIL only: torchvision does not import beside the CPU torch build)."""

from __future__ import annotations

import io

import numpy as np
import torch
from PIL import Image

from dit_train.runs.atomic_io import atomic_write_bytes


def to_uint8(x: torch.Tensor) -> np.ndarray:
    """[-1, 1] CHW float -> HWC uint8 (grayscale stays 2-D)."""
    arr = ((x.detach().float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).cpu()
    arr = arr.permute(1, 2, 0).numpy()
    return arr[..., 0] if arr.shape[2] == 1 else arr


def save_grid(images: torch.Tensor, path: str, nrow: int, pad: int = 2, min_size: int = 64) -> str:
    """images [N, C, H, W] in [-1, 1] -> one PNG, nrow images per row; written atomically. Images smaller than
    min_size are enlarged by an integer factor (nearest) so a 32-px grid is readable."""
    factor = max(1, -(-min_size // images.shape[-1]))
    if factor > 1:
        images = torch.nn.functional.interpolate(images.float(), scale_factor=factor, mode="nearest")
    n, c, h, w = images.shape
    if c not in (1, 3):
        images = images[:, :3] if c > 3 else images[:, :1]  # latents: show the first channels
        c = images.shape[1]
    ncol = nrow
    nrows = (n + ncol - 1) // ncol
    shape = (nrows * (h + pad) + pad, ncol * (w + pad) + pad) + (() if c == 1 else (3,))
    canvas = np.full(shape, 255, dtype=np.uint8)
    for i in range(n):
        r, col = divmod(i, ncol)
        y0, x0 = pad + r * (h + pad), pad + col * (w + pad)
        canvas[y0 : y0 + h, x0 : x0 + w] = to_uint8(images[i])
    return _write_png(canvas, path)


def save_image(image: torch.Tensor, path: str) -> str:
    """One image [C, H, W] in [-1, 1] -> PNG at its own size; written atomically."""
    return _write_png(to_uint8(image), path)


def _write_png(pixels: np.ndarray, path: str) -> str:
    """Encoded in memory, then written atomically: a full disk leaves no partial file, a link planted at the temp
    name (a run folder from elsewhere) is not written through."""
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    atomic_write_bytes(buffer.getvalue(), path)
    return path
