import os
import subprocess
import sys

import torch
from omegaconf import OmegaConf
from PIL import Image

from conftest import ROOT
from dit_train.data import build_dataset


def test_encode_image_folder_with_tiny_random_vae_then_train_reads_it(tmp_path):
    from diffusers import AutoencoderKL

    vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 16),
                        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                        layers_per_block=1, norm_num_groups=4, sample_size=16)
    vae.save_pretrained(tmp_path / "vae")
    for split, n in (("train", 3), ("val", 2)):
        for c in ("a", "b"):
            os.makedirs(tmp_path / "img" / split / c)
            for i in range(n):
                Image.new("RGB", (20, 18), (i * 60, 100, 0)).save(tmp_path / "img" / split / c / f"{i}.png")
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "encode_latents.py"), "--vae", str(tmp_path / "vae"),
           "--images", str(tmp_path / "img"), "--out", str(tmp_path / "lat"), "--image-size", "16",
           "--shard-size", "4", "--batch-size", "3"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert sorted(os.listdir(tmp_path / "lat" / "train")) == ["shard_00000.safetensors", "shard_00001.safetensors"]
    cfg = OmegaConf.create({"name": "latents", "root": str(tmp_path / "lat"), "image_size": 8, "channels": 4})
    ds = build_dataset(cfg, "train")
    assert len(ds) == 6 and ds[5][1] == 1 and ds[0][0].shape == (4, 8, 8)
    # the stored latent is the scaled posterior mean of the same preprocessed image
    from dit_train.data.image_folder import load_image

    x = load_image(str(tmp_path / "img" / "train" / "a" / "0.png"), 16)[None]
    with torch.no_grad():
        z = vae.encode(x).latent_dist.mean * vae.config.scaling_factor
    assert torch.allclose(ds[0][0], z[0].half().float(), atol=1e-3)
    # rerunning skips complete shards
    mtime = os.path.getmtime(tmp_path / "lat" / "train" / "shard_00000.safetensors")
    assert subprocess.run(cmd, capture_output=True, timeout=120).returncode == 0
    assert os.path.getmtime(tmp_path / "lat" / "train" / "shard_00000.safetensors") == mtime


def test_two_ranks_encode_the_same_shards_as_one(tmp_path):
    """Under torchrun the shards are dealt over the ranks; the result equals the single-process encoding."""
    from diffusers import AutoencoderKL
    from safetensors.torch import load_file

    from conftest import free_port

    vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 16),
                        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                        layers_per_block=1, norm_num_groups=4, sample_size=32)
    vae.save_pretrained(tmp_path / "vae")
    args = ["--vae", str(tmp_path / "vae"), "--data", "fashion_mnist", "--limit", "20", "--shard-size", "6",
            "--batch-size", "4", "--splits", "val"]
    script = os.path.join(ROOT, "scripts", "encode_latents.py")
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    one = subprocess.run([sys.executable, script, *args, "--out", str(tmp_path / "one")], capture_output=True,
                         text=True, timeout=300, env=env)
    assert one.returncode == 0, one.stderr
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                          str(free_port()), script, *args, "--out", str(tmp_path / "two")], capture_output=True,
                         text=True, timeout=300, env=env)
    assert two.returncode == 0, two.stderr
    names = sorted(os.listdir(tmp_path / "one" / "val"))
    assert names == sorted(os.listdir(tmp_path / "two" / "val")) and len(names) == 4
    for name in names:
        a, b = load_file(str(tmp_path / "one" / "val" / name)), load_file(str(tmp_path / "two" / "val" / name))
        assert torch.equal(a["latents"], b["latents"]) and torch.equal(a["labels"], b["labels"])
    assert (tmp_path / "two" / "latents_info.json").is_file()
