"""A cheap identity of a large file (weights of a VAE, DINOv2 or Inception): its size and the sha1 of its first MiB.
Hashing gigabytes at every start is not worth it; recorded in latents_info.json and in FD encoder ids. No torch."""

from __future__ import annotations

import hashlib
import os


def file_fingerprint(path, nbytes: int = 1 << 20) -> str:
    """`<size>-<first 12 hex digits of sha1(first nbytes)>`."""
    with open(path, "rb") as f:
        head = f.read(nbytes)
    return f"{os.path.getsize(path)}-{hashlib.sha1(head).hexdigest()[:12]}"
