"""Rank-merged statistics and the sharded FDEvaluator equal the single-process result (2 gloo processes)."""

import json
import os

import numpy as np
import pytest
import torch

from conftest import gloo_group, spawn_ranks

from dit_train.evaluation.fd.frechet import StreamingStats, stats_from_features

WORLD = 2


def _features():
    rng = np.random.default_rng(0)
    return (rng.normal(size=(101, 12)) * rng.uniform(0.5, 2, size=12) + 50.0).astype(np.float64)


def _evaluator_cfg(cache_dir):
    from omegaconf import OmegaConf

    return OmegaConf.create(dict(every_n_steps=1, num_samples=40, batch_size=16, sample_steps=1, cfg_scale=1.0,
                                 encoder="dinov2_random", encoder_path=None, reference_split="train",
                                 reference_num=50, cache_dir=str(cache_dir), seed=3))


def _run_evaluator(cache_dir):
    from test_fd_evaluator import ToyDataset, toy_images

    from dit_train.evaluation.fd.evaluator import FDEvaluator

    ev = FDEvaluator(_evaluator_cfg(cache_dir), None, "cpu", dataset=ToyDataset(n=70), log=lambda *_: None)
    # a slightly wrong generator, so FD is O(1) and a relative tolerance means something
    res = ev.evaluate(lambda labels, g: 0.8 * toy_images(labels, g), step=1)
    return ev, res


def _worker(rank, world, port, out_dir):
    with gloo_group(rank, world, port):
        x = _features()
        lo, hi = (0, 30) if rank == 0 else (30, 101)  # uneven shards, different shifts
        acc = StreamingStats(12)
        for i in range(lo, hi, 7):
            acc.update(torch.from_numpy(x[i:min(i + 7, hi)]))
        s = acc.all_reduce().finalize()
        # the sharded evaluator: reference computed over ranks and cached, then reused from the cache
        ev, first = _run_evaluator(os.path.join(out_dir, "cache"))
        ev2, second = _run_evaluator(os.path.join(out_dir, "cache"))
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump({"count": s.count, "mean": s.mean.tolist(), "cov": s.cov.tolist(), "fd": first["fd"],
                       "fd2": second["fd"], "num_gen": first["fd_num_gen"], "has_images": "images" in first,
                       "ref_labels": ev.reference.labels.tolist(), "ref_labels2": ev2.reference.labels.tolist(),
                       "ref_mean": ev.reference.stats.mean.tolist(), "batches": ev.my_batches()}, f)


def test_rank_merged_equals_single_process(tmp_path):
    spawn_ranks(_worker, WORLD, (str(tmp_path),))
    ranks = [json.load(open(tmp_path / f"rank{r}.json")) for r in range(WORLD)]

    one = stats_from_features(_features())
    for r in ranks:
        assert r["count"] == 101
        np.testing.assert_allclose(r["mean"], one.mean, rtol=1e-12)
        np.testing.assert_allclose(r["cov"], one.cov, rtol=1e-9, atol=1e-12)

    ev, single = _run_evaluator(tmp_path / "single_cache")
    assert [r["batches"] for r in ranks] == [[0, 2], [1, None]]  # rank 1 pads: the same number of turns
    assert [r["has_images"] for r in ranks] == [True, False]
    for r in ranks:
        assert r["num_gen"] == 40
        # same samples; float32 encoder batches are composed differently across ranks, hence not bit-equal
        assert r["fd"] == pytest.approx(single["fd"], rel=1e-6)
        assert r["fd2"] == r["fd"]  # second evaluator: reference from the rank-0 cache file
        assert r["ref_labels"] == ev.reference.labels.tolist() == r["ref_labels2"]
        np.testing.assert_allclose(r["ref_mean"], ev.reference.stats.mean, rtol=1e-9, atol=1e-12)
    assert len(list((tmp_path / "cache").glob("ref_*.npz"))) == 1
