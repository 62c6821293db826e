"""Shapes read from the data (#28 item 2), from the user's side: after dit-encode-latents the training command
needs no shape overrides (channels, latent size and class count come from the shards), an image folder's classes
and size likewise; a command-line value that disagrees with the data is refused with every mismatch in one line and
the overrides that fix them; a resume keeps the checkpoint's (equal) values."""

import json
import os
import re

import pytest
from PIL import Image

from conftest import run_cli_in_process
from test_encode_latents import save_tiny_vae

TINY = ["model.hidden_size=32", "model.depth=1", "model.num_heads=2", "train.steps=1", "train.batch_size=4",
        "train.warmup_steps=0", "train.val_every=0", "train.sample_every=0", "eval.every_n_steps=0",
        "train.progress=false"]


def dit_train(*args, cwd):
    # in this process (conftest.run_cli_in_process): ~3 s of a new Python importing torch less each
    return run_cli_in_process(*args, cwd=str(cwd))


def image_folder(root, classes=("cat", "dog", "emu"), per_class=8, size=(16, 16)):
    """root/<class>/<images>, no train/ or val/."""
    for c, name in enumerate(classes):
        os.makedirs(root / name)
        for i in range(per_class):
            Image.new("RGB", size, (c * 80, i * 20, 0)).save(root / name / f"{i}.png")
    return root


@pytest.fixture(scope="module")
def latents(tmp_path_factory):
    """Three classes of 16 px images in one folder, encoded by a tiny VAE into 4x8x8 latents."""
    root = tmp_path_factory.mktemp("shapes")
    save_tiny_vae(root / "vae")
    image_folder(root / "img")
    from dit_train.data.encode import main as encode  # in this process: the command is test_encode_latents's

    assert encode(["--vae", str(root / "vae"), "--images", str(root / "img"), "--out", str(root / "lat"),
                   "--image-size", "16", "--shard-size", "8"])["complete"]
    return root


def test_encoded_val_latents_are_held_out_images_not_the_training_ones(latents):
    info = json.loads((latents / "lat" / "latents_info.json").read_text())
    splits = {s["split"]: s for s in info["splits"]}
    assert splits["train"]["images"] + splits["val"]["images"] == 24 and splits["val"]["images"] >= 1
    assert splits["train"]["image_list"] != splits["val"]["image_list"]


def test_a_latent_run_needs_no_shape_overrides_and_logs_what_it_read(latents, tmp_path):
    """It needed model.in_channels=4 data.num_classes=3 model.num_classes=3 data.image_size=8 model.image_size=8,
    each refused on a separate try."""
    r = dit_train("data=latents", f"data.root={latents / 'lat'}", f"vae.path={latents / 'vae'}",
                  f"run_dir={tmp_path / 'run'}", *TINY, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    log = (tmp_path / "run" / "dit_train.log").read_text()
    line = next(ln for ln in log.splitlines() if "from the data:" in ln)
    for value in ("data.image_size=8", "data.num_classes=3", "model.in_channels=4", "model.image_size=8",
                  "model.num_classes=3"):
        assert value in line, line
    saved = (tmp_path / "run" / "config.yaml").read_text()
    assert "in_channels: 4" in saved and "num_classes: 3" in saved
    # a resume continues with the checkpoint's values, which are the data's: accepted, nothing to infer
    r = dit_train(f"run_dir={tmp_path / 'run'}", "train.resume=auto", "train.steps=2", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "steps=2" in r.stdout


def test_command_line_values_that_disagree_with_the_data_are_one_line_with_the_fix(latents, tmp_path):
    r = dit_train("data=latents", f"data.root={latents / 'lat'}", f"vae.path={latents / 'vae'}",
                  "model.in_channels=3", "data.image_size=16", "model.num_classes=2", "model.patch_size=3",
                  f"run_dir={tmp_path / 'run'}", *TINY, cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    shard = latents / "lat" / "train" / "shard_00000.safetensors"
    assert r.stderr == (
        f"error: the data in {latents / 'lat'} (latents) disagrees with the command line or the presets: data.image_size=16 "
        f"({shard}: latents [N, 4, 8, 8]); model.in_channels=3 (the data has 4); model.num_classes=2 (the data has "
        f"3); model.patch_size=3 does not divide the image size 8 (valid: 1, 2, 4, 8); use instead: "
        f"data.image_size=8 model.in_channels=4 model.num_classes=3 model.patch_size=2\n")
    assert not (tmp_path / "run").exists()


@pytest.mark.skipif(not os.path.exists("/usr/share/datasets/fashion-mnist"), reason="dataset-fashion-mnist")
def test_fashion_mnist_s_channel_and_classes_are_fixed(tmp_path):
    """data.channels=3 passed the check and crashed in the first step's matmul, after the run folder was made;
    data.num_classes=5 was refused by the label check inside the run, naming model.num_classes. More classes in the
    model than in the data is a choice (unused rows of the class table), as is an unconditional model."""
    r = dit_train("data.channels=3", "data.num_classes=5", f"run_dir={tmp_path / 'run'}", *TINY, cwd=tmp_path)
    assert r.returncode == 2 and r.stderr == (
        "error: the data in /usr/share/datasets/fashion-mnist (fashion_mnist) disagrees with the command line or the "
        "presets: data.channels=3 (Fashion-MNIST images are grayscale); data.num_classes=5 (Fashion-MNIST has 10 "
        "classes); use instead: data.channels=1 data.num_classes=10\n"), r.stderr
    assert not (tmp_path / "run").exists()
    for choice in ("data.num_classes=12", "model.num_classes=0"):
        r = dit_train(choice, f"run_dir={tmp_path / choice.split('=')[0]}", *TINY, cwd=tmp_path)
        assert r.returncode == 0, r.stderr


def test_an_image_folder_run_reads_its_classes_channels_and_size(tmp_path):
    """data=image_folder needed model.in_channels=3 model.image_size=64 and the class count by hand."""
    image_folder(tmp_path / "img", classes=("a", "b"), size=(24, 24))
    r = dit_train("data=image_folder", f"data.root={tmp_path / 'img'}", f"run_dir={tmp_path / 'run'}", *TINY,
                  cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    log = (tmp_path / "run" / "dit_train.log").read_text()
    assert "data.image_size=24" in log and "model.in_channels=3" in log and "model.num_classes=2" in log
    # which folder each label is (dit-sample --classes takes labels): no output said
    assert f"data.num_classes=2 ({tmp_path / 'img'}: 2 class folders, labels 0=a 1=b)" in log
    held = re.search(r"(\d+) of its 16 images are held out as validation", log)
    counts = re.search(r"\((\d+) train / (\d+) val\)", r.stdout)
    assert held and counts and int(counts[2]) == int(held[1]) >= 1 and int(counts[1]) + int(counts[2]) == 16


def test_a_run_started_on_a_relative_data_root_resumes_from_any_folder(tmp_path):
    """The run keeps the paths it reads as absolute ones in its checkpoint's config: resumed from another working
    directory, `data.root=img` was refused as not a folder."""
    (tmp_path / "start").mkdir(), (tmp_path / "elsewhere").mkdir()
    image_folder(tmp_path / "start" / "img", classes=("a", "b"))
    run = tmp_path / "run"
    r = dit_train("data=image_folder", "data.root=img", f"run_dir={run}", *TINY, cwd=tmp_path / "start")
    assert r.returncode == 0, r.stderr
    assert f"root: {tmp_path / 'start' / 'img'}\n" in (run / "config.yaml").read_text()
    r = dit_train(f"run_dir={run}", "train.resume=auto", "train.steps=2", cwd=tmp_path / "elsewhere")
    assert r.returncode == 0 and "steps=2" in r.stdout, r.stderr


def test_a_resume_on_data_of_another_shape_is_refused_naming_the_saved_values(tmp_path):
    """The saved config holds the shapes inferred at the start; data that changed under the run is not silently
    re-inferred on resume (the checkpoint's weights have the saved shapes)."""
    import torch

    from test_data import write_latent_split

    for split in ("train", "val"):
        write_latent_split(tmp_path / "lat", split)  # 4 latents of 4x8x8, labels 0..3
    args = ["data=latents", f"data.root={tmp_path / 'lat'}", f"run_dir={tmp_path / 'run'}", *TINY]
    r = dit_train(*args, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    for split in ("train", "val"):
        write_latent_split(tmp_path / "lat", split, latents=torch.randn(4, 4, 4, 4).half())
    r = dit_train(f"run_dir={tmp_path / 'run'}", "train.resume=auto", "train.steps=2", cwd=tmp_path)
    assert r.returncode == 2 and r.stderr == (
        f"error: the data in {tmp_path / 'lat'} (latents) disagrees with the saved config of the run being "
        f"continued: data.image_size=8 ({tmp_path / 'lat'}/train/shard_00000.safetensors: latents [N, 4, 4, 4]); "
        f"model.image_size=8 (the data has 4); continue it on the data it was trained on, or train on this data in a "
        f"new run_dir\n"), r.stderr


def _png_header(path, side):
    """A PNG declaring side x side grey pixels with no image data: PIL reads its size from the header alone."""
    import struct
    import zlib

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xffffffff)

    os.makedirs(path.parent, exist_ok=True)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", side, side, 8, 0, 0, 0, 0))
                     + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b""))


@pytest.mark.parametrize("attack", ["empty shard of side 2^16", "class count 2^40", "label 2^40",
                                    "images declaring 9000 px"])
def test_data_declaring_shapes_no_model_of_its_size_can_take_is_refused_before_building(tmp_path, attack):
    """A data folder from elsewhere decides the model's input shapes: a shard of no items declaring latents of side
    2^16 (nothing for the file size to bound), latents_info.json's class count or a label of 2^40, images whose
    headers say 9000 x 9000. The run built that model: a traceback asking for 563 TB, or gigabytes allocated
    before a step on millions of tokens. Refused in one line naming the value and the file, exit 2, before the run
    folder is made."""
    import torch
    from safetensors.torch import save_file

    root = tmp_path / "data"
    latents, labels, info = torch.zeros(2, 4, 8, 8), torch.tensor([0, 1]), None
    if attack.startswith("empty"):
        latents, labels = torch.zeros(0, 4, 65536, 65536), torch.zeros(0, dtype=torch.long)
    elif attack == "class count 2^40":
        info = {"source": {"name": "x", "num_classes": 2 ** 40}}
    elif attack == "label 2^40":
        labels = torch.tensor([0, 2 ** 40])
    if attack.startswith("images"):
        for name in ("cat", "dog"):
            _png_header(root / name / "0.png", 9000)
        data = ["data=image_folder"]
    else:
        for split in ("train", "val"):
            os.makedirs(root / split)
            save_file({"latents": latents, "labels": labels}, str(root / split / "shard_00000.safetensors"))
        if info:
            (root / "latents_info.json").write_text(json.dumps(info))
        data = ["data=latents", "model.patch_size=2"]
    r = dit_train(f"run_dir={tmp_path / 'run'}", *data, f"data.root={root}", "model=dit_xs", *TINY, cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert re.match(r"error: data\.(image_size|num_classes)=\d+ \(.*\) makes .* more than ", r.stderr), r.stderr
    assert not (tmp_path / "run").exists()
