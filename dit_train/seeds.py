"""Named seed streams: every random draw of a run comes from one stream, keyed by (stream, seed, index).

Deriving all of them from one integer with ad-hoc arithmetic (`seed * 1_000_003 + i`, `seed * 7919`) made
unrelated draws share seeds (validation batch 0 and data epoch 0 drew from the same generator). A stream name
is hashed together with the seed and the index, so different streams never collide, and a stream's values do
not depend on the number of ranks (the index is a batch or epoch number, never a rank).
"""

from __future__ import annotations

import hashlib

import torch

STREAMS = (
    "model_init",     # the initial weights: block `index` = "parameter name/block number" (weight_init)
    "train_noise",    # timesteps, noise and condition dropout of every training step (shared by all ranks)
    "data_order",     # the permutation of epoch `index`
    "val_noise",      # the noise of validation batch `index`
    "grid_noise",     # the noise of the sample grids (the same grid at every step)
    "fd_labels",      # the class labels of the generated FD set
    "fd_noise",       # the noise of FD generation batch `index`
    "synthetic",      # sample `index` of the synthetic benchmark dataset
    "reference",      # which real images form the FD reference set
)


def seed_for(stream: str, seed: int, index: int | str = 0) -> int:
    """A 63-bit seed for draw `index` of `stream` in a run seeded with `seed` (an int, or a name such as a
    parameter's)."""
    if stream not in STREAMS:
        raise KeyError(f"unknown seed stream {stream!r}; known: {', '.join(STREAMS)}")
    key = index if isinstance(index, str) else int(index)
    digest = hashlib.blake2b(f"{stream}/{int(seed)}/{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def generator(stream: str, seed: int, index: int | str = 0, device="cpu") -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed_for(stream, seed, index))
