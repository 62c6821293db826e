import gzip
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from PIL import Image
from safetensors.torch import save_file

from conftest import FASHION_ROOT, ROOT, compose, needs_fashion
from dit_train.config import ConfigError
from dit_train.config.latents import read_latents_info
from dit_train.data.order import StepBatchSampler
from dit_train.data.datasets import build_dataset


@needs_fashion
def test_fashion_mnist_real_files():
    cfg = OmegaConf.create({"name": "fashion_mnist", "root": FASHION_ROOT, "image_size": 32})
    train, val = build_dataset(cfg, "train"), build_dataset(cfg, "val")
    assert len(train) == 60000 and len(val) == 10000
    x, y = train[0]
    assert x.shape == (1, 32, 32) and x.dtype == torch.float32
    assert x.min() >= -1 and x.max() <= 1 and x.max() > 0.9  # real image content
    assert torch.all(x[:, :2, :] == -1) and torch.all(x[:, :, :2] == -1)  # 2-px zero padding each side
    assert y == 9  # the first Fashion-MNIST training image is an ankle boot
    assert sorted(set(val.labels.tolist())) == list(range(10))


def test_missing_root_says_how_to_get_it(tmp_path):
    cfg = OmegaConf.create({"name": "fashion_mnist", "root": str(tmp_path / "nope")})
    with pytest.raises(FileNotFoundError, match="apt-get install dataset-fashion-mnist"):
        build_dataset(cfg, "train")


@needs_fashion
def test_fashion_mnist_batches_equal_the_items_one_by_one():
    from torch.utils.data import default_collate

    from dit_train.data.order import fixed_batches, train_batches

    ds = build_dataset(OmegaConf.create({"name": "fashion_mnist"}), "train")
    sampler = StepBatchSampler(len(ds), 16, seed=3, start_step=5, total_steps=7)
    for indices, (x, y) in zip(sampler, train_batches(ds, 16, 3, 5, 7)):
        one_by_one = default_collate([ds[i] for i in indices])
        assert x.shape == (16, 1, 32, 32) and y.dtype == torch.long
        assert torch.equal(x, one_by_one[0]) and torch.equal(y, one_by_one[1])
    x, y = next(iter(fixed_batches(ds, 10, 10)))  # the validation set's Subset fetches through it too
    assert torch.equal(x, default_collate([ds[i] for i in range(10)])[0])
    assert torch.equal(y, default_collate([ds[i] for i in range(10)])[1])


@needs_fashion
def test_truncated_idx_file_names_the_file(tmp_path):
    for f in os.listdir(FASHION_ROOT):
        shutil.copy(os.path.join(FASHION_ROOT, f), tmp_path)
    path = tmp_path / "t10k-images-idx3-ubyte.gz"
    raw = gzip.decompress(path.read_bytes())
    path.write_bytes(gzip.compress(raw[: len(raw) // 2]))
    cfg = OmegaConf.create({"name": "fashion_mnist", "root": str(tmp_path)})
    with pytest.raises(ValueError, match=r"t10k-images-idx3-ubyte.gz is truncated"):
        build_dataset(cfg, "val")


def test_unknown_dataset_lists_valid_names():
    with pytest.raises(ValueError, match="data.name='cifar' is not valid: choose one of fashion_mnist, image_folder, latents, synthetic"):
        build_dataset(OmegaConf.create({"name": "cifar"}), "train")


def make_folder(root, corrupt=False, empty_class=False):
    for c, color in (("cat", 40), ("dog", 200)):
        os.makedirs(root / c)
        for i in range(3):
            Image.new("RGB", (40 + i, 30), (color, i, 0)).save(root / c / f"{i}.png")
    if corrupt:
        (root / "dog" / "bad.png").write_bytes(b"not a png")
    if empty_class:
        os.makedirs(root / "zebra")


def make_split_folders(root, **kw):
    """root/train/<class> (make_folder's) and root/val/<class>: every training image is trained on."""
    make_folder(root / "train", **kw)
    make_folder(root / "val")


def test_image_folder_resize_crop_labels(tmp_path):
    make_split_folders(tmp_path)
    ds = build_dataset(OmegaConf.create({"name": "image_folder", "root": str(tmp_path), "image_size": 16}), "train")
    assert len(ds) == 6 and ds.classes == ["cat", "dog"]
    x, y = ds[4]
    assert x.shape == (3, 16, 16) and y == 1
    assert abs(x[0].mean().item() - (200 / 127.5 - 1)) < 0.02


def test_image_folder_corrupt_image_named_or_skipped(tmp_path):
    make_folder(tmp_path, corrupt=True)
    cfg = OmegaConf.create({"name": "image_folder", "root": str(tmp_path), "image_size": 16})
    ds = build_dataset(cfg, "train")
    bad = [i for i, (p, _) in enumerate(ds.samples) if p.endswith("bad.png")][0]
    with pytest.raises(ValueError, match=r"corrupt image .*bad\.png"):
        ds[bad]
    cfg.skip_corrupt = True
    ds = build_dataset(cfg, "train")
    x, _ = ds[bad]
    assert x.shape == (3, 16, 16) and len(ds.skipped) == 1


def test_image_folder_empty_class_named(tmp_path):
    make_folder(tmp_path, empty_class=True)
    with pytest.raises(ValueError, match=r"class folder .*zebra has no images"):
        build_dataset(OmegaConf.create({"name": "image_folder", "root": str(tmp_path)}), "train")


def test_latent_shards_labels_text_and_wrong_shape(tmp_path):
    os.makedirs(tmp_path / "train")
    save_file({"latents": torch.randn(5, 4, 8, 8), "labels": torch.arange(5)}, str(tmp_path / "train/a.safetensors"))
    save_file({"latents": torch.randn(3, 4, 8, 8), "labels": torch.arange(3) + 5}, str(tmp_path / "train/b.safetensors"))
    cfg = OmegaConf.create({"name": "latents", "root": str(tmp_path), "image_size": 8, "channels": 4})
    ds = build_dataset(cfg, "train")
    assert len(ds) == 8 and ds[6][1] == 6 and ds[6][0].shape == (4, 8, 8)
    loader = torch.utils.data.DataLoader(ds, batch_size=4, num_workers=1)
    assert next(iter(loader))[0].shape == (4, 4, 8, 8)  # handles reopen in workers
    save_file({"latents": torch.randn(2, 4, 16, 16), "labels": torch.arange(2)}, str(tmp_path / "train/c.safetensors"))
    with pytest.raises(ValueError, match=r"c\.safetensors has latents of shape \[4, 16, 16\].*expected \[4, 8, 8\]"):
        build_dataset(cfg, "train")
    os.makedirs(tmp_path / "val")
    save_file({"latents": torch.randn(2, 4, 8, 8), "text_emb": torch.randn(2, 6, 12),
               "text_mask": torch.ones(2, 6, dtype=torch.bool)}, str(tmp_path / "val/t.safetensors"))
    x, cond = build_dataset(cfg, "val")[1]
    assert cond["context"].shape == (6, 12) and cond["context_mask"].dtype == torch.bool


def test_step_batch_order_is_a_function_of_step():
    full = StepBatchSampler(100, 10, seed=3, start_step=0, total_steps=25)
    resumed = StepBatchSampler(100, 10, seed=3, start_step=13, total_steps=25)
    a, b = list(full), list(resumed)
    assert a[13:] == b
    assert sorted(sum(a[:10], [])) == list(range(100))  # one epoch is a permutation
    assert a[:10] != a[10:20]  # a new permutation each epoch
    ranks = [StepBatchSampler(100, 10, 3, 0, 25, rank=r, world_size=2).indices(4) for r in (0, 1)]
    assert ranks[0] + ranks[1] == full.indices(4)


def test_sixteen_bit_images_keep_their_range(tmp_path):
    """A 16-bit grey ramp: the old RGB conversion saturated almost every pixel at +1."""
    from PIL import Image

    os.makedirs(tmp_path / "a")
    ramp = (np.arange(32 * 32).reshape(32, 32) * 64).astype(np.uint16)  # 0 ... 65472
    Image.fromarray(ramp).save(tmp_path / "a" / "ramp.png")
    ds = build_dataset(OmegaConf.create({"name": "image_folder", "root": str(tmp_path), "image_size": 32}), "train")
    x, _ = ds[0]
    assert x.mean().abs() < 0.02 and (x > 0.99).float().mean() < 0.01
    assert torch.allclose(x[0], x[1]) and torch.allclose(x[1], x[2])


def test_a_decompression_bomb_is_named_and_skipped(tmp_path, monkeypatch):
    from PIL import Image

    make_folder(tmp_path)
    Image.new("RGB", (200, 200)).save(tmp_path / "cat" / "huge.png")
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 10_000)  # 200 x 200 is over twice this: PIL refuses it
    cfg = OmegaConf.create({"name": "image_folder", "root": str(tmp_path), "image_size": 16})
    ds = build_dataset(cfg, "train")
    bomb = [i for i, (p, _) in enumerate(ds.samples) if p.endswith("huge.png")][0]
    with pytest.raises(ValueError, match=r"corrupt image .*huge\.png"):
        ds[bomb]
    cfg.skip_corrupt = True
    ds = build_dataset(cfg, "train")
    x, _ = ds[bomb]
    assert x.shape == (3, 16, 16) and any(p.endswith("huge.png") for p in ds.skipped)


def test_an_image_past_pils_bomb_warning_is_named_not_decoded(tmp_path, monkeypatch):
    """PIL raises only past twice Image.MAX_IMAGE_PIXELS (179 M pixels); between once and twice it warns and
    decodes: a 100 M-pixel PNG of a few hundred kB in a folder from elsewhere was decoded in full (RGB: 300 MB, and
    as much again for its resize) for every sample of it, in each loader worker. Its warning is its refusal."""
    import warnings

    from PIL import Image

    make_folder(tmp_path)
    Image.new("RGB", (150, 100)).save(tmp_path / "cat" / "big.png")
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 10_000)  # 15,000 pixels: past the warning, under the error
    cfg = OmegaConf.create({"name": "image_folder", "root": str(tmp_path), "image_size": 16})
    ds = build_dataset(cfg, "train")
    big = [i for i, (p, _) in enumerate(ds.samples) if p.endswith("big.png")][0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the refusal must not depend on how warnings are shown
        with pytest.raises(ValueError, match=r"corrupt image .*big\.png: .*could be decompression bomb DOS attack"):
            ds[big]


@pytest.mark.parametrize("classes", [11, 12])
def test_more_classes_than_the_model_has_is_one_line_before_training(tmp_path, classes):
    from PIL import Image

    from conftest import compose
    from dit_train.config import ConfigError
    from dit_train.parallel.fsdp import DistInfo
    from dit_train.trainer.loop import Trainer

    for c in range(classes):
        os.makedirs(tmp_path / "data" / f"c{c:02d}")
        Image.new("RGB", (32, 32), (c * 20, 0, 0)).save(tmp_path / "data" / f"c{c:02d}" / "x.png")
    cfg = compose(["data=image_folder", f"data.root={tmp_path / 'data'}", "data.image_size=32", "data.channels=3",
                   "model.in_channels=3", "model.num_classes=10", "model.hidden_size=32", "model.depth=1",
                   "model.num_heads=1", "model.patch_size=8", f"run_dir={tmp_path / 'run'}"])
    with pytest.raises(ConfigError, match=f"model.num_classes=10 is not valid: the training data has {classes} classes"):
        Trainer(cfg, DistInfo())


def write_latent_split(root, split="train", latents=None, labels=None):
    os.makedirs(root / split, exist_ok=True)
    latents = torch.randn(4, 4, 8, 8).half() if latents is None else latents
    labels = torch.arange(len(latents)) if labels is None else labels
    save_file({"latents": latents, "labels": labels}, str(root / split / "shard_00000.safetensors"))
    return root / split / "shard_00000.safetensors"


@pytest.mark.parametrize("latents, labels, message", [
    (None, torch.tensor([0, 1, 2, 10]), r"has label 10: data.num_classes=10 allows labels 0..9 \(label 10 is the "
                                        r"guidance null class\)"),
    (None, torch.tensor([0, 11, 2, 3]), r"has label 11: data.num_classes=10 allows labels 0..9"),
    (None, torch.tensor([0, -1, 2, 3]), r"has label -1: data.num_classes=10 allows labels 0..9"),
    (None, torch.tensor([0.0, 1.0, 2.0, 3.0]), r"has labels of dtype F32, expected integers \(I64, I32"),
    (None, torch.arange(3), r"has labels of shape \[3\], expected \[4\] \(one per latent\)"),
    (torch.randint(-50, 50, (4, 4, 8, 8)), None, r"has latents of dtype I64, expected floating point"),
])
def test_bad_latent_labels_or_dtypes_are_one_line_naming_the_shard(tmp_path, latents, labels, message):
    """Label num_classes trained as the guidance null class, label 11 was an IndexError mid-run, int64 latents
    trained (loss 94): each is now refused when the shards are opened."""
    write_latent_split(tmp_path, latents=latents, labels=labels)
    cfg = OmegaConf.create({"name": "latents", "root": str(tmp_path), "image_size": 8, "channels": 4,
                            "num_classes": 10})
    with pytest.raises(ValueError, match=r"^latent shard \S+shard_00000\.safetensors " + message) as e:
        build_dataset(cfg, "train")
    assert "\n" not in str(e.value)


def test_good_latent_labels_pass_and_an_unconditional_set_takes_any_label(tmp_path):
    write_latent_split(tmp_path, labels=torch.tensor([0, 9, 3, 3], dtype=torch.int32))
    cfg = OmegaConf.create({"name": "latents", "root": str(tmp_path), "image_size": 8, "channels": 4,
                            "num_classes": 10})
    assert [build_dataset(cfg, "train")[i][1] for i in range(4)] == [0, 9, 3, 3]
    write_latent_split(tmp_path, labels=torch.tensor([0, 900, 3, 3]))
    cfg.num_classes = 0  # labels unused
    assert len(build_dataset(cfg, "train")) == 4


@pytest.mark.parametrize("keep", [0, 40, -100])
def test_a_truncated_latent_shard_is_one_line_naming_the_file(tmp_path, keep):
    path = write_latent_split(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[:keep])  # empty, inside the header, inside the tensors
    cfg = OmegaConf.create({"name": "latents", "root": str(tmp_path), "image_size": 8, "channels": 4,
                            "num_classes": 10})
    with pytest.raises(ValueError, match=rf"^latent shard {path} is truncated or not a safetensors file \(.*\); "
                                         rf"delete it and rerun dit-encode-latents") as e:
        build_dataset(cfg, "train")
    assert "\n" not in str(e.value)


def test_a_torn_latents_info_is_one_line_naming_the_file(tmp_path):
    (tmp_path / "latents_info.json").write_text('{"vae": "/w/vae", "scaling_fac')
    with pytest.raises(ConfigError, match=rf"^{tmp_path}/latents_info.json is not valid JSON \(.*\): the file is "
                                         rf"damaged .*; encode "):
        read_latents_info(str(tmp_path))
    (tmp_path / "latents_info.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match=r"latents_info.json holds a JSON list, expected the object"):
        read_latents_info(str(tmp_path))


@pytest.mark.parametrize("fault", ["label", "torn_info"])
def test_the_training_command_refuses_bad_latents_in_one_line(tmp_path, fault):
    write_latent_split(tmp_path / "lat", labels=torch.tensor([0, 1, 2, 10]) if fault == "label" else None)
    write_latent_split(tmp_path / "lat", "val")
    if fault == "torn_info":
        (tmp_path / "lat" / "latents_info.json").write_text('{"vae": "/w/va')
        os.makedirs(tmp_path / "vae")
        (tmp_path / "vae" / "config.json").write_text('{"scaling_factor": 0.18215}')
    cmd = [sys.executable, "-m", "dit_train", "data=latents", f"data.root={tmp_path / 'lat'}", "data.num_classes=10",
           "data.image_size=8", "model.in_channels=4", "model.image_size=8", "model.patch_size=2",
           "model.hidden_size=32", "model.depth=1", "model.num_heads=2", "model.num_classes=10",
           "train.sample_every=0", "eval.every_n_steps=0", "train.steps=2", "train.batch_size=4",
           f"run_dir={tmp_path / 'run'}", *([f"vae.path={tmp_path / 'vae'}"] if fault == "torn_info" else [])]
    r = subprocess.run(cmd, cwd=str(tmp_path), capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": ROOT})
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    expected = {"label": f"error: latent shard {tmp_path}/lat/train/shard_00000.safetensors has label 10: "
                         f"data.num_classes=10 allows labels 0..9",
                "torn_info": f"error: {tmp_path}/lat/latents_info.json is not valid JSON"}[fault]
    assert r.stderr.startswith(expected)
    assert not (tmp_path / "run").exists()  # found before the run folder was made (#28 item 3)


@pytest.mark.parametrize("num_workers", [0, 1])
def test_skipped_images_are_counted_with_loader_workers(tmp_path, num_workers):
    """The skipped set filled in a worker process was lost: data/skipped logged 0 with num_workers >= 1."""
    from dit_train.data.order import train_batches

    make_split_folders(tmp_path, corrupt=True)
    cfg = OmegaConf.create({"name": "image_folder", "root": str(tmp_path), "image_size": 16, "skip_corrupt": True})
    ds = build_dataset(cfg, "train")
    batches = list(train_batches(ds, global_batch=7, seed=0, start_step=0, total_steps=2, num_workers=num_workers))
    assert len(batches) == 2 and batches[0][0].shape == (7, 3, 16, 16) and batches[0][1].shape == (7,)
    assert ds.skipped == {str(tmp_path / "train" / "dog" / "bad.png")}


def test_the_training_log_counts_a_skipped_image_read_by_a_loader_worker(tmp_path):
    from conftest import compose
    from dit_train.trainer.loop import run
    from test_fsdp_train import metrics

    make_split_folders(tmp_path / "data", corrupt=True)
    run(compose(["data=image_folder", f"data.root={tmp_path / 'data'}", "data.image_size=16", "data.channels=3",
                 "data.skip_corrupt=true", "model.in_channels=3", "model.image_size=16", "model.num_classes=2",
                 "model.hidden_size=32", "model.depth=1", "model.num_heads=1", "model.patch_size=8",
                 "train.steps=2", "train.batch_size=7", "train.num_workers=1", "train.log_every=1",
                 "train.val_every=0", "train.sample_every=0", "eval.every_n_steps=0", "train.progress=false",
                 f"run_dir={tmp_path / 'run'}"]))
    rows = [r for r in metrics(tmp_path / "run") if "train/loss" in r]
    assert [r["step"] for r in rows] == [1, 2] and [r.get("data/skipped") for r in rows] == [1, 1]


def test_loader_workers_auto_reads_files_in_workers_on_cuda_only():
    """train.num_workers=auto: file-reading data (latent shards: three safetensors slices per item; decoded
    images) is assembled in 4 loader workers on CUDA, so the step never waits on reads in the main process;
    in-memory data and CPU runs (whose cores the step uses) stay in the main process; an integer is taken as is."""
    from dit_train.data.datasets import loader_workers

    assert loader_workers("auto", "latents", "cuda:3") == 4
    assert loader_workers("auto", "image_folder", torch.device("cuda")) == 4
    assert loader_workers("auto", "fashion_mnist", "cuda") == 0
    assert loader_workers("auto", "latents", "cpu") == 0
    assert loader_workers(2, "fashion_mnist", "cpu") == 2 and loader_workers(0, "latents", "cuda") == 0


@pytest.mark.parametrize("value", ["-1", "some", "1.5"])
def test_num_workers_takes_auto_or_a_count(value):
    from dit_train.config import ConfigError, validate

    with pytest.raises(ConfigError, match=rf"train.num_workers=.* is not valid: choose auto .* or an integer >= 0"):
        validate(compose(["run_dir=/tmp/unused", f"train.num_workers={value}"]))
    validate(compose(["run_dir=/tmp/unused", "train.num_workers=auto"]))


@pytest.mark.parametrize("kind", ["image_folder", "latents"])
def test_the_data_fingerprint_follows_the_data_not_its_folder(tmp_path, kind):
    """What a resume checks data.root against (resume_policy.py): a moved folder keeps its fingerprint; one more
    item, a renamed class or shard, or another split changes it."""
    from dit_train.data.datasets import data_fingerprint

    def cfg(folder):
        extra = {"image_size": 16} if kind == "image_folder" else {"image_size": 8, "channels": 4}
        return OmegaConf.create({"name": kind, "root": str(folder), **extra})

    data = tmp_path / "data"
    if kind == "image_folder":
        make_folder(data)
    else:
        for split, n in (("train", 5), ("val", 2)):
            os.makedirs(data / split)
            save_file({"latents": torch.randn(n, 4, 8, 8), "labels": torch.arange(n)},
                      str(data / split / "a.safetensors"))
    first = data_fingerprint(cfg(data))
    # the image folder has no val/: one of its 6 images is held out as validation
    assert (first["train"], first["val"]) == ((5, 1) if kind == "image_folder" else (5, 2)) and len(first["sha256"]) == 16
    shutil.move(str(data), str(tmp_path / "moved"))
    assert data_fingerprint(cfg(tmp_path / "moved")) == first
    if kind == "image_folder":
        os.rename(tmp_path / "moved" / "dog", tmp_path / "moved" / "wolf")  # same images, other labels' names
    else:
        os.rename(tmp_path / "moved" / "val" / "a.safetensors", tmp_path / "moved" / "val" / "b.safetensors")
    assert data_fingerprint(cfg(tmp_path / "moved"))["sha256"] != first["sha256"]


def test_an_image_folder_without_val_holds_out_a_fixed_part_as_validation(tmp_path, caplog):
    """Validation was the training images themselves (and encode_latents wrote them again as `val` latents): the
    loss it reported was a training loss. Now about 1 in 20 images, chosen by their relative paths, is validation
    only: the same images wherever the folder lies, and an image keeps its side when others are added."""
    import logging

    def splits(root):
        cfg = OmegaConf.create({"name": "image_folder", "root": str(root), "image_size": 8})
        return [{os.path.relpath(p, root) for p, _ in build_dataset(cfg, split).samples} for split in ("train", "val")]

    for c in ("a", "b", "c", "d"):
        os.makedirs(tmp_path / "data" / c)
        for i in range(100):
            Image.new("RGB", (8, 8)).save(tmp_path / "data" / c / f"{i:03d}.png")
    with caplog.at_level(logging.INFO, logger="dit_train"):
        train, val = splits(tmp_path / "data")
    assert not train & val and len(train | val) == 400 and 8 <= len(val) <= 35  # 5% of 400 = 20, binomial spread
    assert f"{len(val)} of its 400 images are held out as validation" in caplog.text
    shutil.copytree(tmp_path / "data", tmp_path / "copy")
    assert splits(tmp_path / "copy") == [train, val]
    Image.new("RGB", (8, 8)).save(tmp_path / "copy" / "a" / "new.png")
    train2, val2 = splits(tmp_path / "copy")
    assert train <= train2 and val <= val2 and len(train2 | val2) == 401
    os.makedirs(tmp_path / "tiny" / "a")
    for i in range(3):  # too few for any image to fall in the 5%: the lowest hash is validation
        Image.new("RGB", (8, 8)).save(tmp_path / "tiny" / "a" / f"{i}.png")
    train, val = splits(tmp_path / "tiny")
    assert len(train) == 2 and len(val) == 1 and not train & val


# ---- data files from elsewhere: no hang, no memory filled from a declared size ----------------------------------
def idx_header(*dims):
    import struct

    return b"\0\0\x08" + bytes([len(dims)]) + struct.pack(">" + "I" * len(dims), *dims)


@pytest.mark.parametrize("attack", ["gzip bomb", "wrapping product", "link to /dev/zero", "fifo"])
def test_a_crafted_idx_file_is_one_line_without_filling_memory_or_hanging(tmp_path, attack):
    """A gzip bomb (a 60 kB .gz declaring 1e9 images, decompressing to 60 MB): the whole stream was decompressed
    into memory before the header was checked. A link to /dev/zero was read without end, a FIFO hung the reader. A
    header whose int64 product wraps round guards the bounded read. Each is one line naming the file, in seconds."""
    import signal
    import tracemalloc

    from dit_train.data.fashion_mnist import read_idx

    path = tmp_path / ("train-images-idx3-ubyte" + (".gz" if attack == "gzip bomb" else ""))
    if attack == "gzip bomb":
        path.write_bytes(gzip.compress(idx_header(10**9, 28, 28) + bytes(60 * 10**6), compresslevel=9))
        match = r"more than a \d+-byte file can hold"
    elif attack == "wrapping product":
        path.write_bytes(idx_header(2**32 - 1, 2**32 - 1, 2**32 - 1, 2**32 - 1, 2**32 - 1) + bytes(64))
        match = "more than a 88-byte file can hold"
    elif attack == "link to /dev/zero":
        os.symlink("/dev/zero", path)
        match = "is not a regular file"
    else:
        os.mkfifo(path)
        match = "is not a regular file"

    def hung(*_):
        raise TimeoutError("the reader hung")

    previous = signal.signal(signal.SIGALRM, hung)
    tracemalloc.start()
    signal.alarm(20)
    try:
        with pytest.raises(ValueError, match=match) as e:
            read_idx(str(path))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        tracemalloc.stop()
    assert str(path) in str(e.value) and "\n" not in str(e.value)
    assert peak < 10**6  # bytes: the bomb was never decompressed (60 MB)


def test_a_fifo_among_latent_shards_or_images_is_one_line_not_a_hang(tmp_path):
    """A FIFO in a data folder from elsewhere hung the reader: PIL's open could be interrupted, safetensors' open
    cannot (it retries after a signal), so before the fix this test hung rather than failed."""
    import signal

    write_latent_split(tmp_path)
    os.mkfifo(tmp_path / "train" / "shard_00001.safetensors")
    make_split_folders(tmp_path / "images")
    os.mkfifo(tmp_path / "images" / "train" / "cat" / "3.png")

    def hung(*_):
        raise TimeoutError("the reader hung on the FIFO")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(20)
    try:
        with pytest.raises(ValueError, match=r"shard_00001\.safetensors is not a regular file"):
            build_dataset(OmegaConf.create({"name": "latents", "root": str(tmp_path), "image_size": 8, "channels": 4,
                                            "num_classes": 10}), "train")
        images = build_dataset(OmegaConf.create({"name": "image_folder", "root": str(tmp_path / "images"),
                                                 "image_size": 16}), "train")
        fifo = [i for i, (p, _) in enumerate(images.samples) if p.endswith("3.png")]
        assert len(fifo) == 1
        with pytest.raises(ValueError, match=r"corrupt image .*3\.png: .* is not a regular file"):
            images[fifo[0]]
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.mark.parametrize("vae_config, info, named", [
    ('{"scaling_factor": 0.18', {"scaling_factor": 0.18, "shift_factor": 0.0}, r"config\.json is not valid JSON"),
    ('{"scaling_factor": "big"}', {"scaling_factor": 0.18, "shift_factor": 0.0}, "numeric scaling_factor"),
    ('{"scaling_factor": 0.18}', {"scaling_factor": [1], "shift_factor": 0.0}, "holds factors that are not numbers"),
])
def test_a_damaged_vae_config_or_latents_info_is_one_line(tmp_path, vae_config, info, named):
    """A VAE folder from elsewhere whose config.json is torn or holds a string factor, or a latents_info.json whose
    factor is not a number: the config check stopped in a traceback (JSONDecodeError, ValueError, TypeError)."""
    from dit_train.config.latents import check_latent_run

    write_latent_split(tmp_path / "latents")
    (tmp_path / "latents" / "latents_info.json").write_text(json.dumps({**info, "complete": True}))
    (tmp_path / "vae").mkdir()
    (tmp_path / "vae" / "config.json").write_text(vae_config)
    with pytest.raises(ConfigError, match=named) as e:
        check_latent_run({"name": "dit_1b3", "image_size": 8}, {"root": str(tmp_path / "latents")},
                         {"path": str(tmp_path / "vae")}, needs_decoding=True)
    assert "\n" not in str(e.value)


def test_skip_corrupt_is_not_a_key_of_latents():
    """data=latents declared skip_corrupt ("skip unreadable shards") but nothing read it: a run asking for it got
    a bad shard's refusal anyway. It is refused as a key latents does not have, naming the keys it has."""
    with pytest.raises(ConfigError, match=r"data.skip_corrupt=True is not valid: not a key of data 'latents'; valid "
                                          r"keys: channels, image_size, name, num_classes, root"):
        build_dataset(OmegaConf.create({"name": "latents", "root": "/nonexistent", "skip_corrupt": True}), "train")
