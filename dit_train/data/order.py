"""The order of training batches is a pure function of (seed, step): epoch e is a permutation drawn from seed
stream `data_order` (seeds.py), and global step s takes samples [s*B, (s+1)*B) of the concatenated epochs (last
partial batch dropped). So the data position is the step itself, and a resumed run sees exactly the batches it
would have seen. Each rank loads its own contiguous slice of the global batch."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, Sampler, default_collate, get_worker_info

from dit_train import seeds


class StepBatchSampler(Sampler):
    def __init__(self, n: int, global_batch: int, seed: int, start_step: int, total_steps: int,
                 rank: int = 0, world_size: int = 1):
        if global_batch > n:
            raise ValueError(f"train.batch_size={global_batch} is larger than the dataset ({n} samples)")
        self.n, self.B, self.seed = n, global_batch, seed
        self.start, self.total = start_step, total_steps
        self.per_epoch = n // global_batch
        self.local = global_batch // world_size
        self.rank = rank
        self._perm_epoch, self._perm = -1, None

    def indices(self, step: int) -> list[int]:
        epoch, b = divmod(step, self.per_epoch)
        if epoch != self._perm_epoch:
            g = seeds.generator("data_order", self.seed, epoch)
            self._perm, self._perm_epoch = torch.randperm(self.n, generator=g), epoch
        lo = b * self.B + self.rank * self.local
        return self._perm[lo : lo + self.local].tolist()

    def __iter__(self):
        for step in range(self.start, self.total):
            yield self.indices(step)

    def __len__(self) -> int:
        return max(0, self.total - self.start)


def train_batches(dataset, global_batch: int, seed: int, start_step: int, total_steps: int,
                  rank: int = 0, world_size: int = 1, num_workers: int = 0, pin_memory: bool = False):
    """This rank's batches from `start_step` on. `num_workers` > 0 assembles batches in worker processes;
    `pin_memory` (for a CUDA device) puts them in page-locked memory, so that the trainer's non_blocking copies
    are asynchronous (from pageable memory a copy makes the host wait)."""
    sampler = StepBatchSampler(len(dataset), global_batch, seed, start_step, total_steps, rank, world_size)
    counts_in_workers = num_workers > 0 and hasattr(dataset, "skipped")
    loader = DataLoader(dataset, batch_sampler=sampler, num_workers=num_workers,
                        persistent_workers=num_workers > 0, pin_memory=pin_memory,
                        collate_fn=with_worker_skipped if counts_in_workers else None)
    return merge_skipped(loader, dataset.skipped) if counts_in_workers else loader


def with_worker_skipped(samples):
    """A worker's batch with what its copy of the dataset has skipped so far (data.skip_corrupt): that set lives
    in the worker process, the trainer logs the main process's."""
    return default_collate(samples), set(get_worker_info().dataset.skipped)


def merge_skipped(loader, skipped: set):
    for batch, worker_skipped in loader:
        skipped |= worker_skipped
        yield batch


def fixed_batches(dataset, num: int, batch_size: int, rank: int = 0, world_size: int = 1):
    """The first `num` samples of a split, in order, sharded over ranks: the fixed held-out set for the
    validation loss."""
    num = min(num, len(dataset))
    idx = list(range(rank, num, world_size))
    return DataLoader(torch.utils.data.Subset(dataset, idx), batch_size=batch_size, shuffle=False)
