"""The exchange behind backward (optimizer.overlap_exchange, optim/backward_overlap.py) on 2 CPU/gloo ranks, in
gather and owner mode: training with it equals training without it bit for bit (every parameter of the final
checkpoint, every logged loss and gradient norm), for muon and periodic_rowwise (K=3: refresh, RowNorm, RowNorm,
refresh), with gradient accumulation (hooks fire on the syncing micro-batch only), with clipping that never scales
the gradients (the prefetch is used on every refresh step) and with clipping that always does (the prefetch is
dropped and the step exchanges itself). One spawn runs every job; the parent compares. The owner mode's
optimizer-level cases (3 ranks, a matrix without gradient, a second backward) are
tests/integration/test_owner_overlap.py.
"""

import pytest
import torch

from conftest import needs_fashion
from test_fsdp_train import TINY, metrics, uncompressed_fashion_mnist
from test_sharded_optim import spawn
from test_sharded_train import train_jobs

pytestmark = needs_fashion

# one checkpoint, the final one the tests compare (a DCP save is ~0.5 s of each of the 14 jobs)
BASE = [o for o in TINY if not o.startswith(("optimizer=", "train.sample_every=", "train.val_every=",
                                             "train.ckpt_every="))] + [
    "train.sample_every=0", "train.val_every=0", "train.ckpt_every=4"]
GATHER, OWNER = "optimizer.distributed_mode=gather", "optimizer.distributed_mode=owner"
# name -> overrides; grad_clip 1e6 never scales the tiny model's gradients, 1e-4 always does
CASES = {
    "muon": ["optimizer=muon", "train.grad_clip=1e6", GATHER],
    "muon/micro": ["optimizer=muon", "train.grad_clip=1e6", "train.micro_batch_size=2", GATHER],
    "muon/clipped": ["optimizer=muon", "train.grad_clip=1e-4", GATHER],
    "periodic_rowwise/micro": ["optimizer=periodic_rowwise", "train.grad_clip=1e6", "train.micro_batch_size=3",
                               "optimizer.bucket_mb=0.003", GATHER],
    # owner mode: 2 ranks, shape groups of 1, 2 and 3 matrices (exchanges of 2 and shorter ones)
    "owner/muon": ["optimizer=muon", "train.grad_clip=1e6", OWNER],
    "owner/muon/clipped": ["optimizer=muon", "train.grad_clip=1e-4", OWNER],
    "owner/periodic_rowwise/micro": ["optimizer=periodic_rowwise", "train.grad_clip=1e6",
                                     "train.micro_batch_size=3", OWNER],
}
REFRESHES = {"muon": 4, "muon/micro": 4, "muon/clipped": 0, "periodic_rowwise/micro": 2,  # of 4 steps
             "owner/muon": 4, "owner/muon/clipped": 0, "owner/periodic_rowwise/micro": 2}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("overlap")
    data = f"data.root={uncompressed_fashion_mnist(root / 'fashion_mnist')}"
    jobs = []
    for name, overrides in CASES.items():
        for on in ("true", "false"):
            jobs.append(BASE + overrides + [data, f"run_dir={root / name / on}", f"optimizer.overlap_exchange={on}"])
    spawn(train_jobs, 2, jobs, timeout=900.0)
    return root


def final_weights(run_dir):
    from dit_train.runs.checkpoint import read_tensors

    return read_tensors(str(run_dir / "checkpoints" / "step_00000004.dcp"), "model")


@pytest.mark.parametrize("name", list(CASES))
def test_overlap_equals_the_exchange_in_the_step_bit_for_bit(runs, name):
    on, off = final_weights(runs / name / "true"), final_weights(runs / name / "false")
    assert on.keys() == off.keys() and all(torch.equal(on[k], off[k]) for k in off)
    rows_on = [r for r in metrics(runs / name / "true") if "train/loss" in r]
    rows_off = [r for r in metrics(runs / name / "false") if "train/loss" in r]
    for a, b in zip(rows_on, rows_off, strict=True):
        assert (a["train/loss"], a["train/grad_norm"]) == (b["train/loss"], b["train/grad_norm"])
    # the exchange really ran behind backward on every refresh step whose gradients were not clipped (18 matrices:
    # qkv, proj, fc1, fc2 of two blocks and the adaLN ones), and never when they were
    used = [r["opt/exchanged_in_backward"] for r in rows_on]
    assert sum(u > 0 for u in used) == REFRESHES[name], used
    assert all("opt/exchanged_in_backward" not in r for r in rows_off)


@pytest.mark.parametrize("mode, collective", [("", "all_gather"), ("owner/", "all_to_all")])
def test_clipped_steps_exchange_twice_unclipped_ones_once(runs, mode, collective):
    """Where clipping scaled the gradients the early exchange was wasted (the bytes trade-off; in owner mode the
    inbound all-to-all, about half the bytes); otherwise the bytes are the step's own."""
    def sent(path):
        return [r.get(f"comm_bytes/{collective}", 0) for r in metrics(path) if "train/loss" in r]

    assert sent(runs / f"{mode}muon" / "true") == sent(runs / f"{mode}muon" / "false")
    on, off = sent(runs / f"{mode}muon/clipped" / "true"), sent(runs / f"{mode}muon/clipped" / "false")
    assert all(a > b > 0 for a, b in zip(on, off, strict=True)), (on, off)


def test_the_overlap_is_accepted_in_both_modes():
    from dit_train.config.validate import check_optimizer

    for mode in ("owner", "gather"):
        assert check_optimizer({"name": "muon", "overlap_exchange": True, "distributed_mode": mode})["overlap_exchange"]
