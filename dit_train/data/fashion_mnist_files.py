"""Where Fashion-MNIST's four idx files are: DEFAULT_ROOT (Debian's dataset-fashion-mnist) or any folder holding
them, gzipped or not. No torch here: the command-line check finds them before torch is imported
(config/paths.py); fashion_mnist.py reads them."""

from __future__ import annotations

import os

DEFAULT_ROOT = "/usr/share/datasets/fashion-mnist"
FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "val": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}


def find_file(root: str, stem: str) -> str:
    for name in (stem + ".gz", stem):
        path = os.path.join(root, name)
        if os.path.exists(path):
            return path
    expected = ", ".join(f"{a}.gz" for pair in FILES.values() for a in pair)
    raise FileNotFoundError(
        f"data.root={root!r} has no {stem}(.gz); expected the four Fashion-MNIST idx files ({expected}). "
        f"Install them with `sudo apt-get install dataset-fashion-mnist` (to {DEFAULT_ROOT}) or set data.root="
    )
