"""FSDP2 training on CPU/gloo: a 2-rank torchrun run of the tiny DiT equals the single-process run of the same
global batch; its sharded checkpoint resumes exactly on 2 ranks and, resharded (uneven shards), on 3; a
single-process checkpoint resumes on 3 ranks; export gives the single-process EMA weights.

Process launches are the cost here (a few seconds of imports each on a small machine), so one module fixture
makes the runs every test compares: the single-process reference, one torchrun launch and two spawned groups.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, compose, gloo_group, needs_fashion, spawn_ranks

pytestmark = needs_fashion

# 12 images per step (divisible by 2 and 3); hidden 32 shards unevenly over 3 ranks (e.g. 32 rows -> 11/11/10)
TINY = ["model.hidden_size=32", "model.depth=2", "model.num_heads=2", "model.patch_size=8",
        "train.steps=4", "train.batch_size=12", "train.warmup_steps=2", "train.log_every=1",
        "train.val_every=2", "train.val_samples=10", "train.val_batch_size=4", "train.val_t_points=2",
        "train.sample_every=4", "train.ckpt_every=2", "train.keep_last=0", "train.progress=false",
        "train.samples_per_class=1", "train.sample_steps=2", "optimizer=adamw"]


def uncompressed_fashion_mnist(folder) -> str:
    """data.root for the same Fashion-MNIST, its four idx files decompressed into `folder` (the loader reads either
    form; data_fingerprint is of the images, so runs and resumes agree with either): every rank of every job below
    reads both splits, and gunzip was ~0.5 s of that each time (0.8 -> 0.3 s measured on a busy host) on jobs of a
    few seconds."""
    import gzip
    import shutil

    from dit_train.data.fashion_mnist import DEFAULT_ROOT, FILES

    os.makedirs(folder, exist_ok=True)
    for stem in (name for pair in FILES.values() for name in pair):
        with gzip.open(os.path.join(DEFAULT_ROOT, stem + ".gz"), "rb") as src, \
                open(os.path.join(folder, stem), "wb") as dst:
            shutil.copyfileobj(src, dst)
    return str(folder)


def _worker(rank, world, port, jobs):
    """One rank: join a gloo group, then run() each job (a list of overrides) in turn."""
    with gloo_group(rank, world, port):
        from dit_train.trainer.loop import run

        for overrides in jobs:
            run(compose(TINY + overrides))


def spawn(world: int, jobs: list[list[str]], timeout: float = 240.0) -> None:
    spawn_ranks(_worker, world, (jobs,), timeout)


def metrics(run_dir) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def losses(run_dir, key="train/loss") -> dict[int, float]:
    return {r["step"]: r[key] for r in metrics(run_dir) if key in r}


def assert_close(a: dict, b: dict, rtol: float) -> None:
    assert sorted(a) == sorted(b), (a, b)
    for k in a:
        assert abs(a[k] - b[k]) <= rtol * abs(b[k]), (k, a[k], b[k])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("fsdp")
    from dit_train.trainer.loop import run

    data = f"data.root={uncompressed_fashion_mnist(root / 'fashion_mnist')}"
    single = root / "single"
    # bf16 compute weights recorded (a single process gathers no weights: it computes in fp32 all the same), so that
    # its checkpoint may resume sharded with them below: a resume may not change parallel.mixed_precision
    run(compose(TINY + [data, f"run_dir={single}", "parallel.mixed_precision=bf16"]))

    # torchrun, Hydra's own run folder: each rank resolves hydra.run.dir differently (as ${now:...} can), and
    # every rank must still land in rank 0's folder
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "dit_train",
           *TINY, data, "hydra.run.dir=runs/rank${oc.env:RANK}"]
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=str(root), env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    two = root / "runs" / "rank0"

    ck2 = two / "checkpoints" / "step_00000002.dcp"
    # same world size: resume from step 2 of the 2-rank run
    spawn(2, [[data, f"run_dir={root / 'two_resumed'}", f"train.resume={ck2}"]])
    # 3 ranks (uneven shards): resume the 2-rank checkpoint (with activation checkpointing, which must not change
    # the numbers), and the single-process checkpoint (with bf16 compute weights)
    spawn(3, [[data, f"run_dir={root / 'three_from_two'}", f"train.resume={ck2}",
               "parallel.activation_checkpointing=true"],
              [data, f"run_dir={root / 'three_from_single'}",
               f"train.resume={single / 'checkpoints' / 'step_00000002.dcp'}", "parallel.mixed_precision=bf16"]])
    return {"root": root, "single": single, "two": two, "torchrun": proc,
            **{k: root / k for k in ("two_resumed", "three_from_two", "three_from_single")}}


def test_torchrun_two_ranks_one_run_folder_rank0_writes(runs):
    root, two = runs["root"], runs["two"]
    assert sorted(os.listdir(root / "runs")) == ["rank0"]  # rank 1's own Hydra folder was removed
    names = set(os.listdir(two))
    assert {"metrics.jsonl", "summary.json", "config.yaml", "run_info.json", "samples", "checkpoints"} <= names
    assert sorted(os.listdir(two / "checkpoints")) == ["step_00000002.dcp", "step_00000004.dcp"]
    ck = two / "checkpoints" / "step_00000004.dcp"
    assert {"COMPLETE", ".metadata", "train_state.json"} <= set(os.listdir(ck))
    assert json.loads((ck / "train_state.json").read_text())["step"] == 4
    assert json.loads((ck / "COMPLETE").read_text())["world_size"] == 2
    assert runs["torchrun"].stdout.count("done: steps=4") == 1  # only rank 0 prints
    rows = [r for r in metrics(two) if "train/loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]  # one writer
    assert all(r["time/backward"] > 0 and r["time/forward"] > 0 for r in rows)


def test_two_ranks_match_single_process_of_same_global_batch(runs):
    assert_close(losses(runs["two"]), losses(runs["single"]), rtol=1e-5)
    assert_close(losses(runs["two"], "train/grad_norm"), losses(runs["single"], "train/grad_norm"), rtol=1e-5)
    assert_close(losses(runs["two"], "val/loss"), losses(runs["single"], "val/loss"), rtol=1e-5)


def test_sharded_resume_same_world_size_is_exact(runs):
    straight = losses(runs["two"])
    resumed = losses(runs["two_resumed"])
    assert resumed == {3: straight[3], 4: straight[4]}
    assert losses(runs["two_resumed"], "val/loss") == {4: losses(runs["two"], "val/loss")[4]}  # EMA restored
    from dit_train.runs.checkpoint import read_tensors

    a = read_tensors(str(runs["two"] / "checkpoints" / "step_00000004.dcp"), "optimizer")
    b = read_tensors(str(runs["two_resumed"] / "checkpoints" / "step_00000004.dcp"), "optimizer")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_two_rank_checkpoint_resumes_on_three_ranks(runs):
    three = runs["three_from_two"]
    assert_close(losses(three), {k: v for k, v in losses(runs["two"]).items() if k > 2}, rtol=1e-5)
    assert_close(losses(three, "val/loss"), {4: losses(runs["two"], "val/loss")[4]}, rtol=1e-5)
    ck = three / "checkpoints" / "step_00000004.dcp"
    assert json.loads((ck / "COMPLETE").read_text())["world_size"] == 3


def test_single_process_checkpoint_resumes_sharded_with_bf16_compute(runs):
    # bf16 gathered weights: the same trajectory to bf16 accuracy
    assert_close(losses(runs["three_from_single"]), {k: v for k, v in losses(runs["single"]).items() if k > 2},
                 rtol=2e-2)


def test_export_gives_single_process_ema_weights(runs, tmp_path):
    from safetensors.torch import load_file

    from dit_train.runs.checkpoint import read_tensors
    from dit_train.export import main as export_main

    assert export_main([str(runs["single"]), str(tmp_path / "single")]) == 0
    assert export_main([str(runs["two"]), str(tmp_path / "two")]) == 0
    assert export_main([str(runs["three_from_two"] / "checkpoints" / "step_00000004.dcp"),
                        str(tmp_path / "three")]) == 0
    from dit_train.model.pretrained import DIFFUSERS_WEIGHTS_FILE, TRANSFORMER

    weights = os.path.join(TRANSFORMER, DIFFUSERS_WEIGHTS_FILE)  # an export is a diffusers pipeline folder
    single = load_file(str(tmp_path / "single" / weights))
    saved = read_tensors(str(runs["single"] / "checkpoints" / "step_00000004.dcp"), "ema")
    assert single.keys() == saved.keys() and all(torch.equal(single[k], saved[k]) for k in saved)
    for name in ("two", "three"):
        sharded = load_file(str(tmp_path / name / weights))
        assert sharded.keys() == saved.keys()
        for k in saved:
            # the zero-initialised weights (adaLN, output layer) are ~1e-3 after 4 AdamW steps, and Adam's normalised
            # step turns the ranks' summation order in their near-zero gradients into up to ~1.2e-6 of difference
            torch.testing.assert_close(sharded[k], saved[k], rtol=1e-5, atol=5e-6, msg=f"{name}: {k}")


def test_load_for_inference_reads_sharded_checkpoint(runs):
    from dit_train.runs.checkpoint import load_for_inference

    model, cfg, meta = load_for_inference(str(runs["two"]), "cpu")
    ref, _, ref_meta = load_for_inference(str(runs["single"]), "cpu")
    assert meta["step"] == ref_meta["step"] == 4 and meta["format"] == "dcp"
    assert cfg.model.hidden_size == 32
    x, t, y = torch.randn(3, 1, 32, 32), torch.rand(3), torch.tensor([0, 1, 2])
    with torch.no_grad():
        torch.testing.assert_close(model(x, t, y=y), ref(x, t, y=y), rtol=1e-4, atol=1e-5)


def test_fd_job_scores_every_checkpoint_of_a_sharded_run(runs, tmp_path):
    """dit-fd finds a 2-rank run's checkpoints through the same listing as resume and scores them."""
    from dit_train.evaluation.fd import job

    rows = job.main([str(runs["two"]), "--out", str(tmp_path), "--eval-preset", "ci", "--encoder", "dinov2_random",
                     "--cache-dir", str(tmp_path / "cache"), "--reference-split", "val", "--num-samples", "8",
                     "--batch-size", "4", "--reference-num", "16", "--sample-steps", "1", "--no-grid"])
    assert [r["step"] for r in rows] == [2, 4]
    assert all(r["checkpoint"].endswith(".dcp") and r["fd"] == r["fd"] for r in rows)  # finite, not NaN
