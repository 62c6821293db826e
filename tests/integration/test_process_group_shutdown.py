"""Leaving a process group whose TCP store rank 0 hosts: rank 0 must be the last to leave. A rank 0 that left as soon
as every rank had reached the end closed the store under a rank still waiting on it (benchmarks/bench_distributed.py
in CI: rank 1 died in its store.wait with "Failed to recv, got 0 bytes")."""

import os
import re
import time

from conftest import ROOT, gloo_group, spawn_ranks

DELAY_S = 1.5  # rank 1's store requests are this late: rank 0 has long exited if it did not wait for rank 1


class _LateStore:
    """The default store as rank 1 sees it when its process is descheduled: every wait starts DELAY_S late."""

    def __init__(self, store):
        self._store = store

    def wait(self, *args):
        time.sleep(DELAY_S)
        return self._store.wait(*args)

    def __getattr__(self, name):
        return getattr(self._store, name)


def _late_rank_1(rank, world, port):
    import torch
    import torch.distributed as dist

    with gloo_group(rank, world, port):
        dist.all_reduce(torch.ones(1))
        if rank == 1:
            c10d = dist.distributed_c10d
            store = c10d._get_default_store()
            c10d._get_default_store = lambda: _LateStore(store)  # what shutdown_process_group reads it through


def test_rank_0_hosting_the_store_leaves_after_a_late_rank_1():
    # rank 1 raising in its wait (store closed) fails the job; the old one-phase shutdown did so every time
    spawn_ranks(_late_rank_1, 2, (), timeout=120)


def test_every_rank_program_leaves_through_the_one_shutdown_helper():
    """The benchmarks each had their own copy of the one-phase shutdown; the two-phase one lives in one place."""
    users = []
    for top in ("benchmarks", "scripts", "dit_train"):
        for folder, _, files in os.walk(os.path.join(ROOT, top)):
            for name in files:
                if name.endswith(".py") and re.search(r"_get_default_store\(", open(os.path.join(folder, name)).read()):
                    users.append(os.path.relpath(os.path.join(folder, name), ROOT))
    assert users == [os.path.join("dit_train", "parallel", "fsdp.py")]
