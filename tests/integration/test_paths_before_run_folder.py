"""Every path a run reads is checked before Hydra makes the run folder (#28 item 3): each bad path was found inside
the Hydra job, after run_dir (made by the entry point) or runs/<date>/<time>/ existed. The command's entry, one case
each: exit 2, the one error line, and nothing left where the command ran or at run_dir. Each case runs the entry in
the test's process (conftest.run_cli_in_process: ~3 s less than a new Python importing torch); one case also runs
as a real command, to show the process gives the same."""

import os
import subprocess
import sys

import pytest
import torch

from conftest import FASHION_ROOT, ROOT, needs_fashion, run_cli_in_process
from test_data import make_folder, write_latent_split

LATENTS = ["data=latents", "model.hidden_size=32", "model.depth=1", "model.num_heads=2", "train.sample_every=0",
           "eval.every_n_steps=0", "train.batch_size=4"]


def fashion_files(tmp_path, splits=("train", "val")):
    from dit_train.data.fashion_mnist import FILES

    os.makedirs(tmp_path / "fm")
    for split in splits:
        for stem in FILES[split]:
            os.symlink(os.path.join(FASHION_ROOT, stem + ".gz"), tmp_path / "fm" / (stem + ".gz"))
    return tmp_path / "fm"


def crafted_vae(folder, **edits):
    """A small AutoencoderKL whose config.json is then edited (`edits`), as tests/unit/test_vae_shapes.py does."""
    import json

    from diffusers import AutoencoderKL

    AutoencoderKL(block_out_channels=(8, 16), down_block_types=("DownEncoderBlock2D",) * 2,
                  up_block_types=("UpDecoderBlock2D",) * 2, norm_num_groups=4).save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **edits}))


def truncated_shard(tmp_path):
    write_latent_split(tmp_path / "lat", "val")
    path = write_latent_split(tmp_path / "lat")
    path.write_bytes(path.read_bytes()[:40])
    return path


CASES = {
    "fashion_mnist root missing": (
        lambda t: [f"data.root={t / 'missing'}"],
        "error: data.root='{t}/missing' is not valid: not a folder of the four Fashion-MNIST idx files; install them "
        "with `sudo apt-get install dataset-fashion-mnist` or point data.root at them"),
    "fashion_mnist without its test split": (
        lambda t: [f"data.root={fashion_files(t, splits=('train',))}"],
        "error: data.root='{t}/fm' has no t10k-images-idx3-ubyte(.gz); expected the four Fashion-MNIST idx files"),
    "image_folder with an empty class": (
        lambda t: (make_folder(t / "img", empty_class=True), ["data=image_folder", f"data.root={t / 'img'}"])[1],
        "error: class folder {t}/img/zebra has no images (.png, .jpg, .jpeg, .bmp, .webp, .gif, .tif, .tiff); "
        "remove it or set data.skip_corrupt=true"),
    "latents without shards": (
        lambda t: (os.makedirs(t / "lat"), [*LATENTS, f"data.root={t / 'lat'}"])[1],
        "error: data.root='{t}/lat': no latent shards in {t}/lat/train/*.safetensors; write them with "
        "dit-encode-latents (which creates root/train and root/val)"),
    "latents with a truncated shard": (
        lambda t: (truncated_shard(t), [*LATENTS, f"data.root={t / 'lat'}"])[1],
        "error: latent shard {t}/lat/train/shard_00000.safetensors is truncated or not a safetensors file"),
    "latents whose val shard has another shape": (
        lambda t: (write_latent_split(t / "lat"), write_latent_split(t / "lat", "val", torch.randn(2, 4, 4, 4)),
                   [*LATENTS, f"data.root={t / 'lat'}"])[2],
        "error: latent shard {t}/lat/val/shard_00000.safetensors has latents of shape [4, 4, 4] per item, expected "
        "[4, 8, 8] (data.channels, data.image_size, data.image_size)"),
    "vae.path not a VAE": (
        lambda t: (os.makedirs(t / "vae"), [f"vae.path={t / 'vae'}"])[1],
        "error: vae.path='{t}/vae' is not valid: expected a diffusers AutoencoderKL folder (config.json + weights)"),
    "vae.path whose config.json declares a wider VAE than its weights": (
        lambda t: (crafted_vae(t / "vae", block_out_channels=[8, 32]), [f"vae.path={t / 'vae'}"])[1],
        "error: VAE folder '{t}/vae': its config.json does not describe the weights in "
        "diffusion_pytorch_model.safetensors (it declares in_channels=3, out_channels=3, latent_channels=4, "
        "block_out_channels=[8, 32]; decoder.conv_in.bias: the config makes [32] (32 values), the weights hold [16] "
        "(16 values)); refusing it before anything is allocated"),
    "eval.encoder_path missing": (
        lambda t: [f"eval.encoder_path={t / 'dinov2.pth'}"],
        "error: eval.encoder_path='{t}/dinov2.pth' is not valid: no such file or folder (the FD encoder's local "
        "weights)"),
    "eval.encoder_path not an encoder folder": (
        lambda t: (os.makedirs(t / "dino"), ["eval.encoder=dinov2", f"eval.encoder_path={t / 'dino'}"])[1],
        "error: eval.encoder_path='{t}/dino' is not valid: neither a Hugging Face folder (config.json + "
        "model.safetensors), a torch.hub checkout (hubconf.py) nor a .pth checkpoint"),
    "train.init_from without checkpoints": (
        lambda t: (os.makedirs(t / "source"), [f"train.init_from={t / 'source'}"])[1],
        "error: train.init_from='{t}/source' is not valid: no checkpoints (checkpoints/step_*.dcp) under "
        "'{t}/source'"),
}


def refused(tmp_path, case, in_process=True):
    make_args, expected = CASES[case]
    args = make_args(tmp_path)
    os.makedirs(tmp_path / "cwd")
    short = ["train.steps=1", "train.val_every=0", "train.sample_every=0"]  # should it start after all: seconds
    command = [*args, *short, f"run_dir={tmp_path / 'run'}"]
    if in_process:
        r = run_cli_in_process(*command, cwd=str(tmp_path / "cwd"), timeout=120)
    else:
        r = subprocess.run([sys.executable, "-m", "dit_train", *command], cwd=str(tmp_path / "cwd"),
                           capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": ROOT})
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith(expected.format(t=tmp_path)), r.stderr
    assert not (tmp_path / "run").exists() and os.listdir(tmp_path / "cwd") == []


@needs_fashion
@pytest.mark.parametrize("case", list(CASES))
def test_a_bad_path_is_one_line_before_any_run_folder_exists(tmp_path, case):
    refused(tmp_path, case)


@needs_fashion
def test_a_bad_path_is_one_line_from_the_real_command(tmp_path):
    refused(tmp_path, "latents with a truncated shard", in_process=False)
