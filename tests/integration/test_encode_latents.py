import json
import os
import re
import stat
import subprocess
import sys

import pytest
import torch
from omegaconf import OmegaConf
from PIL import Image

from conftest import ROOT, run_entry_in_process
from dit_train.config import ConfigError
from dit_train.config.latents import check_latent_run
from dit_train.data.datasets import build_dataset


def save_tiny_vae(folder, sample_size=16, seed=0):
    """A random-init diffusers AutoencoderKL (8x8x4 latents of 16 px images)."""
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 16),
                        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                        layers_per_block=1, norm_num_groups=4, sample_size=sample_size)
    vae.save_pretrained(folder)
    return vae


def test_encode_image_folder_with_tiny_random_vae_then_train_reads_it(tmp_path):
    vae = save_tiny_vae(tmp_path / "vae")
    for split, n in (("train", 3), ("val", 2)):
        for c in ("a", "b"):
            os.makedirs(tmp_path / "img" / split / c)
            for i in range(n):
                Image.new("RGB", (20, 18), (i * 60, 100, 0)).save(tmp_path / "img" / split / c / f"{i}.png")
    # in this process (the command line is test_the_refusal_is_one_line_on_the_command_line's): ~3 s less a run
    args = ["--vae", str(tmp_path / "vae"), "--images", str(tmp_path / "img"), "--out", str(tmp_path / "lat"),
            "--image-size", "16", "--shard-size", "4", "--batch-size", "3"]
    assert load_encoder()(args)["complete"]
    assert sorted(os.listdir(tmp_path / "lat" / "train")) == ["shard_00000.safetensors", "shard_00001.safetensors"]
    umask = os.umask(0o022)
    os.umask(umask)  # the process's: readable like any other output, not safetensors' 0600
    assert stat.S_IMODE(os.stat(tmp_path / "lat" / "train" / "shard_00000.safetensors").st_mode) == 0o666 & ~umask
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
    assert load_encoder()(args)["complete"]
    assert os.path.getmtime(tmp_path / "lat" / "train" / "shard_00000.safetensors") == mtime


def test_two_ranks_encode_the_same_shards_as_one(tmp_path, capfd, one_intra_op_thread):
    """Under torchrun the shards are dealt over the ranks; the result equals the single-process encoding (run in
    the test's process, one thread as the ranks have: torchrun's ranks are the processes under test)."""
    from safetensors.torch import load_file

    from conftest import free_port

    save_tiny_vae(tmp_path / "vae", sample_size=32)
    args = ["--vae", str(tmp_path / "vae"), "--data", "fashion_mnist", "--limit", "20", "--shard-size", "6",
            "--batch-size", "4", "--splits", "val"]
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    capfd.readouterr()
    assert load_encoder()([*args, "--out", str(tmp_path / "one")])["complete"]
    one_stderr = capfd.readouterr().err
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                          str(free_port()), "-m", "dit_train.data.encode", *args, "--out", str(tmp_path / "two")], capture_output=True,
                         text=True, timeout=300, env=env)
    assert two.returncode == 0, two.stderr
    names = sorted(os.listdir(tmp_path / "one" / "val"))
    assert names == sorted(os.listdir(tmp_path / "two" / "val")) and len(names) == 4
    for name in names:
        a, b = load_file(str(tmp_path / "one" / "val" / name)), load_file(str(tmp_path / "two" / "val" / name))
        assert torch.equal(a["latents"], b["latents"]) and torch.equal(a["labels"], b["labels"])
    assert (tmp_path / "two" / "latents_info.json").is_file()
    # the bars count what they say: all 20 images in one process; rank 0's shards 0 and 2 (6 + 6) under torchrun
    # (it showed 12 images with no total and no word that the other rank's 8 were not counted)
    assert "encode: 100%" in one_stderr and "20/20" in one_stderr, one_stderr[-1000:]
    assert "encode (rank 0's shards of 2 ranks): 100%" in two.stderr and "12/12" in two.stderr, two.stderr[-1000:]


def load_encoder():
    from dit_train.data.encode import main

    return main


def image_folder(root, per_class=3):
    """root/a and root/b, `per_class` 20x18 images each, no val/: of the default 6, one is held out as validation
    (dit_train/data/image_folder.py), so the train split has 5."""
    for c in ("a", "b"):
        os.makedirs(root / c, exist_ok=True)
        for i in range(per_class):
            Image.new("RGB", (20, 18), (i * 60, 100 if c == "a" else 200, 0)).save(root / c / f"{i}.png")


def folder_state(folder):
    """Every file under `folder` with its bytes: what a refused run must leave as it found it."""
    return {os.path.relpath(os.path.join(d, f), folder): open(os.path.join(d, f), "rb").read()
            for d, _, files in os.walk(folder) for f in files}


def test_a_resumed_encoding_refuses_another_vae_and_continues_with_its_own(tmp_path):
    """Interrupted (a corrupt image stops it after the first shard), then rerun with another VAE of the same
    factors: the old code kept the first shard, encoded the rest with the new VAE and recorded only that one."""
    from safetensors.torch import load_file

    encode = load_encoder()
    save_tiny_vae(tmp_path / "vae", seed=0)
    save_tiny_vae(tmp_path / "other_vae", seed=1)
    image_folder(tmp_path / "img")
    (tmp_path / "img" / "b" / "2.png").write_bytes(b"not a png")
    args = ["--images", str(tmp_path / "img"), "--out", str(tmp_path / "lat"), "--image-size", "16",
            "--shard-size", "4", "--splits", "train"]
    with pytest.raises(ValueError, match=r"corrupt image .*2\.png"):
        encode(["--vae", str(tmp_path / "vae"), *args])
    assert sorted(os.listdir(tmp_path / "lat" / "train")) == ["shard_00000.safetensors"]
    with pytest.raises(ConfigError, match=r"data.root=.* is not valid: its encoding stopped before every shard was "
                                          r"written: rerun the same dit-encode-latents command"):
        check_latent_run({"name": "dit_s"}, {"root": str(tmp_path / "lat")}, {"path": str(tmp_path / "vae")}, True)
    Image.new("RGB", (20, 18), (120, 200, 0)).save(tmp_path / "img" / "b" / "2.png")  # the image, repaired
    before = folder_state(tmp_path / "lat")
    with pytest.raises(ConfigError, match=rf"^{tmp_path}/lat holds latents made with another VAE "
                                          rf"\({tmp_path}/vae\), not --vae {tmp_path}/other_vae; rerun with the "
                                          rf"settings in {tmp_path}/lat/latents_info.json, or choose another --out$"):
        encode(["--vae", str(tmp_path / "other_vae"), *args])
    assert folder_state(tmp_path / "lat") == before
    info = encode(["--vae", str(tmp_path / "vae"), *args])
    assert info["complete"] and json.loads((tmp_path / "lat" / "latents_info.json").read_text()) == info
    # the resumed folder holds what one uninterrupted run writes
    encode(["--vae", str(tmp_path / "vae"), *args[:2], "--out", str(tmp_path / "whole"), *args[4:]])
    for name in ("shard_00000.safetensors", "shard_00001.safetensors"):
        a, b = load_file(str(tmp_path / "lat" / "train" / name)), load_file(str(tmp_path / "whole" / "train" / name))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    check_latent_run({"name": "dit_s"}, {"root": str(tmp_path / "lat")}, {"path": str(tmp_path / "vae")}, True)


@pytest.mark.parametrize("change, message", [
    (["--shard-size", "4"], r" holds latents made with --shard-size 2, not 4"),
    (["--flip"], r" holds latents made without --flip"),
    (["--image-size", "32"], r" holds latents made from source image_size=16, not 32 \(--images/--data/"),
    ("no record", r" holds latent shards but no latents_info.json that says how they were made"),
    ("torn record", r"/latents_info.json is not valid JSON \(.*\): the file is damaged .*; encode the latents again"),
    ("old record", r"/latents_info.json does not record vae_files, shard_size, .*\(an older dit-encode-latents"),
    ("record without shard lists", r" holds train latents of 5 images, now 6 images or other files \(--limit, or "),
    ("shard lists a string", r"/latents_info.json is not as dit-encode-latents writes it \(train's shard_image_lists "
                             r"is not 3 image lists, one per shard\); choose another --out"),
    ("shard lists too short", r"/latents_info.json is not as dit-encode-latents writes it \(train's "
                              r"shard_image_lists is not 3 image lists"),
    ("splits an object", r"/latents_info.json is not as dit-encode-latents writes it \(splits is a dict, not a list"),
    ("split entry a number", r"/latents_info.json is not as dit-encode-latents writes it \(a split entry 7 lacks"),
    # a count of 10^20 shards without lists was a list of 10^20 '' (OverflowError; 10^10: MemoryError), a source
    # that is not an object an AttributeError, and of two train entries the encoder read the last, the trainer the first
    ("huge shard count", r"/latents_info.json is not as dit-encode-latents writes it \(train's shard_image_lists "
                         r"is not 100000000000000000000 image lists"),
    ("source a string", r"/latents_info.json is not as dit-encode-latents writes it \(source is a str, not an "
                        r"object\); choose another --out"),
    ("two train entries", r"/latents_info.json is not as dit-encode-latents writes it \(two entries for split "
                          r"train\); choose another --out"),
    ("a split named ../x", r"/latents_info.json is not as dit-encode-latents writes it \(a split entry named "
                           r"'../x' \(dit-encode-latents writes train and val\)\); choose another --out"),
])
def test_a_resumed_encoding_refuses_other_settings_before_writing(tmp_path, change, message):
    """--shard-size 4 over shards of 2 skipped shard 1 (images 2-3, not 4-7) and left images never encoded while
    latents_info.json counted them; every setting that changes what a shard holds is checked the same way."""
    encode = load_encoder()
    save_tiny_vae(tmp_path / "vae")
    image_folder(tmp_path / "img")
    args = ["--vae", str(tmp_path / "vae"), "--images", str(tmp_path / "img"), "--out", str(tmp_path / "lat"),
            "--image-size", "16", "--shard-size", "2", "--splits", "train"]
    encode(args)
    os.remove(tmp_path / "lat" / "train" / "shard_00002.safetensors")  # as if interrupted before the last shard
    info_path = tmp_path / "lat" / "latents_info.json"
    if change == "no record":
        os.remove(info_path)
    elif change == "torn record":
        info_path.write_text(info_path.read_text()[:50])
    elif change == "old record":  # what the encoder wrote before it recorded its settings
        old = json.loads(info_path.read_text())
        info_path.write_text(json.dumps({k: old[k] for k in ("vae", "scaling_factor", "shift_factor", "flip",
                                                             "source", "splits")}))
    elif change in ("huge shard count", "source a string", "two train entries", "a split named ../x"):
        old = json.loads(info_path.read_text())
        split = old["splits"][0]
        edited = {"huge shard count": {"splits": [{**split, "shards": 10 ** 20}]}, "source a string": {"source": "x"},
                  "two train entries": {"splits": [split, {**split, "shard_image_lists": ["x"] * 3}]},
                  "a split named ../x": {"splits": [split, {**split, "split": "../x"}]}}[change]
        info_path.write_text(json.dumps({**old, **edited}))
    elif change in ("shard lists a string", "shard lists too short", "splits an object", "split entry a number"):
        # hand-edited (or planted): a string's characters were compared as shard lists, and every shard removed
        old = json.loads(info_path.read_text())
        split = {**old["splits"][0], "shard_image_lists": "abc" if change == "shard lists a string"
                 else old["splits"][0]["shard_image_lists"][:1]}
        splits = {"splits an object": {"train": split}, "split entry a number": [7]}.get(change, [split])
        info_path.write_text(json.dumps({**old, "splits": splits}))
        Image.new("RGB", (20, 18)).save(tmp_path / "img" / "a" / "3.png")
    elif change == "record without shard lists":  # an encoder before them: a changed image list is refused
        old = json.loads(info_path.read_text())
        newer = ("shard_image_lists", "shard_image_stats")  # nor stats: they came after the lists
        info_path.write_text(json.dumps({**old, "splits": [
            {k: v for k, v in s.items() if k not in newer} for s in old["splits"]]}))
        Image.new("RGB", (20, 18)).save(tmp_path / "img" / "a" / "3.png")
    before = folder_state(tmp_path / "lat")
    with pytest.raises(ConfigError, match=rf"^{tmp_path}/lat" + message) as e:
        encode(args + (change if isinstance(change, list) else []))
    assert "\n" not in str(e.value)
    assert folder_state(tmp_path / "lat") == before  # nothing written, the missing shard still missing


@pytest.mark.parametrize("splits", [[7], {"train": {}}, "the val entry of another encoding"])
def test_a_record_of_no_shard_binds_nothing_and_none_of_it_is_kept(tmp_path, splits):
    """A latents_info.json with no shard beside it (a refused encoding's, or planted) binds nothing, as
    resume_conflict says; its splits were still read and kept: [7] was a TypeError traceback, and another
    encoding's val entry (--flip, other counts) was kept in the new record, describing shards that never existed."""
    save_tiny_vae(tmp_path / "vae")
    image_folder(tmp_path / "img")
    load_encoder()(encode_args(tmp_path, "--out", str(tmp_path / "fresh")))
    record = json.loads((tmp_path / "fresh" / "latents_info.json").read_text())
    planted = {**record, "flip": True, "complete": False,
               "splits": [{**record["splits"][0], "split": "val"}] if isinstance(splits, str) else splits}
    os.makedirs(tmp_path / "lat")
    (tmp_path / "lat" / "latents_info.json").write_text(json.dumps(planted))
    info = load_encoder()(encode_args(tmp_path))
    assert info == {**record, "vae": info["vae"]} and info["complete"]
    assert json.loads((tmp_path / "lat" / "latents_info.json").read_text()) == info


def test_the_refusal_is_one_line_on_the_command_line(tmp_path):
    save_tiny_vae(tmp_path / "vae")
    image_folder(tmp_path / "img")
    from dit_train.data.encode import cli

    cmd = ["--vae", str(tmp_path / "vae"), "--images", str(tmp_path / "img"), "--out", str(tmp_path / "lat"),
           "--image-size", "16", "--shard-size", "2", "--splits", "train"]
    assert load_encoder()(cmd)["complete"]
    # the refused one is the command's cli (dit-encode-latents' entry), in this process: its status and stderr
    r = run_entry_in_process(cli, *cmd[:-4], "--shard-size", "4", "--splits", "train", prog="dit-encode-latents")
    assert r.returncode == 2 and "Traceback" not in r.stderr  # argparse's status for bad input (was 1)
    assert r.stderr.splitlines()[-1] == (f"error: {tmp_path}/lat holds latents made with --shard-size 2, not 4; rerun "
                                         f"with the settings in {tmp_path}/lat/latents_info.json, or choose another "
                                         f"--out")


def test_an_image_name_with_control_characters_is_escaped_in_the_error_line(tmp_path):
    """An image folder made elsewhere can hold a file named with an ESC or a newline: the refusal quoting it drew the
    escape codes and printed a second, fake line. It is one line of escapes."""
    save_tiny_vae(tmp_path / "vae")
    image_folder(tmp_path / "img")
    (tmp_path / "img" / "a" / "x\x1b[2J\nerror: fake.png").write_bytes(b"not an image")
    from dit_train.data.encode import cli

    r = run_entry_in_process(cli, "--vae", str(tmp_path / "vae"), "--images", str(tmp_path / "img"), "--out",
                             str(tmp_path / "lat"), "--image-size", "16", prog="dit-encode-latents")
    assert r.returncode == 2 and "\x1b" not in r.stderr, r.stderr
    last = r.stderr.splitlines()[-1]
    assert last.startswith(f"error: corrupt image {tmp_path}/img/a/x\\x1b[2J\\nerror: fake.png: "), last


def test_a_vae_path_that_is_not_a_vae_folder_is_one_line_before_anything_is_written(tmp_path):
    image_folder(tmp_path / "img")
    with pytest.raises(ConfigError, match=rf"^--vae {tmp_path}/nope is not a diffusers AutoencoderKL folder "
                                          rf"\(config.json \+ weights\)$"):
        load_encoder()(["--vae", str(tmp_path / "nope"), "--images", str(tmp_path / "img"), "--out",
                        str(tmp_path / "lat"), "--image-size", "16"])
    assert not (tmp_path / "lat").exists()


@pytest.mark.parametrize("flag, value, message", [
    ("--shard-size", "0", "--shard-size=0 is not valid: expected an integer >= 1"),  # was ZeroDivisionError
    ("--batch-size", "0", "--batch-size=0 is not valid: expected an integer >= 1"),  # after latents_info.json
    ("--limit", "-1", "--limit=-1 is not valid: expected an integer >= 0"),  # recorded splits of -1 images
    ("--image-size", "0", "--image-size=0 is not valid: expected an integer >= 1"),  # named data.image_size
    ("--splits", "train,test", "--splits=train,test is not valid: expected train, val or train,val"),  # traceback
    ("--splits", "train,train", "--splits=train,train is not valid: expected train, val or train,val"),
    ("--out", "", "--out='' is not valid: expected a folder for the shards and latents_info.json"),  # '[Errno 2] ...'
])
def test_a_bad_flag_is_one_line_naming_it_before_anything_is_written(tmp_path, flag, value, message):
    save_tiny_vae(tmp_path / "vae")
    image_folder(tmp_path / "img")
    with pytest.raises(ConfigError) as e:
        load_encoder()(["--vae", str(tmp_path / "vae"), "--images", str(tmp_path / "img"), "--out",
                        str(tmp_path / "lat"), flag, value])
    assert str(e.value) == message
    assert not (tmp_path / "lat").exists()


def test_without_image_size_the_images_are_encoded_at_their_own_size(tmp_path, capsys):
    """A folder of 16 px images was encoded at 256 px unasked (128x128 latents of an f2 VAE, 256 times the pixels);
    the size is now the one a run on the folder takes (data/shapes.py), and the first line says where it came from.
    A folder of mixed or non-square sizes keeps 256, --image-size wins, and --data image_folder reads the same."""
    from types import SimpleNamespace

    from dit_train.data.encode import source_config

    save_tiny_vae(tmp_path / "vae")
    for c in ("a", "b"):
        os.makedirs(tmp_path / "img" / c)
        for i in range(3):
            Image.new("RGB", (16, 16), (i * 60, 100, 0)).save(tmp_path / "img" / c / f"{i}.png")
    info = load_encoder()(["--vae", str(tmp_path / "vae"), "--images", str(tmp_path / "img"), "--out",
                           str(tmp_path / "lat"), "--splits", "train"])
    assert info["source"]["image_size"] == 16
    assert f"encoding train 5 images at 16x16 px (the images' size) with --vae {tmp_path / 'vae'} into " \
           f"{tmp_path / 'lat'}\n" in capsys.readouterr().out
    ds = build_dataset(OmegaConf.create({"name": "latents", "root": str(tmp_path / "lat"), "image_size": 8,
                                         "channels": 4}), "train")
    assert ds[0][0].shape == (4, 8, 8)  # the VAE halves each side
    image_folder(tmp_path / "mixed")  # 20x18 images

    def args(**kw):
        return SimpleNamespace(**{"images": None, "data": None, "data_set": [], "image_size": None, **kw})

    assert source_config(args(images=str(tmp_path / "mixed")))[0]["image_size"] == 256
    for c in ("a", "b"):  # one square size above 256: downscaled to DiT's 256 as before, not encoded at 320
        os.makedirs(tmp_path / "large" / c)
        Image.new("RGB", (320, 320)).save(tmp_path / "large" / c / "0.png")
    assert source_config(args(images=str(tmp_path / "large"))) == (
        {**source_config(args(images=str(tmp_path / "mixed")))[0], "root": str(tmp_path / "large")},
        "the default for images of mixed or larger sizes")
    assert source_config(args(images=str(tmp_path / "img"), image_size=24))[0]["image_size"] == 24
    by_data = source_config(args(data="image_folder", data_set=[f"root={tmp_path / 'img'}"]))
    assert by_data[0]["image_size"] == 16 and by_data[1] == "the images' size"
    by_data = source_config(args(data="image_folder", data_set=[f"root={tmp_path / 'img'}", "image_size=24"]))
    assert by_data[0]["image_size"] == 24 and by_data[1] == "data=image_folder's"
    assert source_config(args(data="image_folder", data_set=[f"root={tmp_path / 'mixed'}"])) == (
        {**by_data[0], "root": str(tmp_path / "mixed"), "image_size": 64}, "data=image_folder's")  # the preset's


def test_a_vae_other_than_the_one_that_made_the_latents_is_refused_by_train_sample_export_and_fd(tmp_path):
    """latents_info.json records the VAE's fingerprints and the encoder's --help says the trainer checks vae.path
    against it, but only the factors were compared: a VAE of the same factors trained, sampled, exported and was
    scored, and dit-sample / dit-export / dit-fd --vae compared nothing (a VAE of other factors decoded
    dit-sample's images)."""
    from dit_train.config.latents import check_decoding_vae
    from dit_train.evaluation.fd.job import latent_decoder
    from dit_train.export import latent_vae
    from dit_train.sample import latent_codec

    save_tiny_vae(tmp_path / "vae", seed=0)
    save_tiny_vae(tmp_path / "same_factors", seed=1)
    save_tiny_vae(tmp_path / "shifted", seed=0)  # the same weights, another shift_factor
    config = json.loads((tmp_path / "shifted" / "config.json").read_text())
    (tmp_path / "shifted" / "config.json").write_text(json.dumps({**config, "shift_factor": 0.1}))
    image_folder(tmp_path / "img")
    lat = tmp_path / "lat"
    load_encoder()(["--vae", str(tmp_path / "vae"), "--images", str(tmp_path / "img"), "--out", str(lat),
                    "--image-size", "16", "--splits", "train"])
    weights = (rf"its diffusion_pytorch_model.safetensors is not the one the latents in {lat} were made with "
               rf"\({tmp_path}/vae; size-sha1 \d+-[0-9a-f]{{12}}, recorded \d+-[0-9a-f]{{12}}\): pass that VAE folder$")
    factors = rf"its scaling/shift factors \(0.18215, 0.1\) differ from those the latents in {lat} were made with"
    with pytest.raises(ConfigError, match=rf"^vae.path='{tmp_path}/same_factors' is not valid: {weights}"):
        check_latent_run({"name": "dit_s"}, {"root": str(lat)}, {"path": str(tmp_path / "same_factors")}, True)
    run = OmegaConf.create({"model": {"name": "dit_s"}, "data": {"name": "latents", "root": str(lat)},
                            "vae": {"path": str(tmp_path / "vae")}})
    for other, message in (("same_factors", weights), ("shifted", factors)):
        with pytest.raises(ConfigError, match=rf"^--vae='{tmp_path}/{other}' is not valid: {message}"):
            latent_codec(run, str(tmp_path / other), "cpu")
        with pytest.raises(ConfigError, match=rf"^--vae='{tmp_path}/{other}' is not valid: {message}"):
            latent_vae(OmegaConf.to_container(run), str(tmp_path / other))
        with pytest.raises(ConfigError, match=rf"^--vae='{tmp_path}/{other}' is not valid: {message}"):
            latent_decoder(run, run.data, str(tmp_path / other), "cpu")  # dit-fd
    # the VAE that made them passes everywhere; a run whose latents are not here (another machine) is not checked
    check_latent_run({"name": "dit_s"}, {"root": str(lat)}, {"path": str(tmp_path / "vae")}, True)
    assert latent_vae(OmegaConf.to_container(run), None) == str(tmp_path / "vae")
    check_decoding_vae(str(tmp_path / "same_factors"), str(tmp_path / "elsewhere"), "--vae")


@pytest.mark.parametrize("out", [".", "lat"])
def test_out_inside_the_image_folder_is_refused_before_writing(tmp_path, out):
    """--out equal to --images wrote train/ and val/ into it: the folder then read as root/train/<class> with no
    class folders ('has no class sub-folders'), for the trainer, a rerun and the latents' own FD reference."""
    save_tiny_vae(tmp_path / "vae")
    image_folder(tmp_path / "img")
    before = folder_state(tmp_path / "img")
    target = os.path.normpath(tmp_path / "img" / out)
    with pytest.raises(ConfigError, match=rf"^--out {re.escape(target)} is inside the image folder "
                                          rf"{re.escape(str(tmp_path / 'img'))}: its train/ and val/ would join"):
        load_encoder()(["--vae", str(tmp_path / "vae"), "--images", str(tmp_path / "img"), "--out", target,
                        "--image-size", "16"])
    assert folder_state(tmp_path / "img") == before
    build_dataset(OmegaConf.create({"name": "image_folder", "root": str(tmp_path / "img"), "image_size": 16}),
                  "train")  # still an image folder


def test_the_class_folders_are_recorded_and_a_latent_run_names_its_labels(tmp_path):
    """A latent run's start-up line said `3 classes` and nothing said which folder label 1 is (dit-sample --classes
    takes labels); the encoder records the image folder's classes, and a record of an older encoder, which has
    none, still continues (the image lists, not the names, say what the shards hold)."""
    from dit_train.data.shapes import latent_class_count

    encode = load_encoder()
    save_tiny_vae(tmp_path / "vae")
    image_folder(tmp_path / "img")
    args = ["--vae", str(tmp_path / "vae"), "--images", str(tmp_path / "img"), "--out", str(tmp_path / "lat"),
            "--image-size", "16", "--shard-size", "2", "--splits", "train"]
    assert encode(args)["class_names"] == ["a", "b"]
    found = latent_class_count(str(tmp_path / "lat"))
    assert (found.value, found.source, found.suggested) == (
        2, f"{tmp_path / 'lat' / 'latents_info.json'}: 2 class folders, labels 0=a 1=b", False)
    info_path = tmp_path / "lat" / "latents_info.json"
    older = json.loads(info_path.read_text())
    del older["class_names"]
    older["complete"] = False
    info_path.write_text(json.dumps(older))
    os.remove(tmp_path / "lat" / "train" / "shard_00002.safetensors")  # interrupted before its last shard
    assert latent_class_count(str(tmp_path / "lat")).source.endswith(": largest label 1 in the shards")
    assert encode(args)["complete"] and json.loads(info_path.read_text())["class_names"] == ["a", "b"]
    assert os.path.exists(tmp_path / "lat" / "train" / "shard_00002.safetensors")


def test_a_wrong_images_path_is_one_line_naming_the_flag_before_anything_is_written(tmp_path):
    """--images naming no folder was a traceback ending in FileNotFoundError: data.root='...' is not a folder (a key
    the user never typed), exit 1, after the VAE was checked (found by a new-user trial)."""
    from dit_train.data.encode import cli

    save_tiny_vae(tmp_path / "vae")
    r = run_entry_in_process(cli, "--vae", tmp_path / "vae", "--images", tmp_path / "typo", "--out", tmp_path / "lat",
                             prog="dit-encode-latents")
    assert (r.returncode, r.stderr) == (2, f"error: --images {tmp_path / 'typo'} is not a folder: expected an image "
                                           f"folder (root/<class>/<images>, or root/train/<class>/... and "
                                           f"root/val/<class>/...)\n")
    assert not (tmp_path / "lat").exists()
    (tmp_path / "empty").mkdir()  # a folder, but no images: the dataset's words, under the flag given
    r = run_entry_in_process(cli, "--vae", tmp_path / "vae", "--images", tmp_path / "empty", "--out", tmp_path / "lat",
                             prog="dit-encode-latents")
    assert r.returncode == 2 and r.stderr.startswith(f"error: --images: data.root={str(tmp_path / 'empty')!r} has no "
                                                     f"class sub-folders;") and r.stderr.count("\n") == 1, r.stderr
    assert not (tmp_path / "lat").exists()


def test_ctrl_c_while_encoding_is_one_line_and_the_same_command_continues(tmp_path, monkeypatch):
    """Ctrl-C mid-encoding printed a KeyboardInterrupt traceback; now one line, exit 130, and the shards written
    before it are kept: the same command writes only the rest, and the set equals an uninterrupted one."""
    from safetensors.torch import load_file

    import dit_train.data.encode as encode_module

    save_tiny_vae(tmp_path / "vae")
    image_folder(tmp_path / "img")
    cmd = ["--vae", tmp_path / "vae", "--images", tmp_path / "img", "--out", tmp_path / "lat", "--image-size", "16",
           "--shard-size", "2", "--splits", "train"]
    save, saved = encode_module.atomic_save_tensors, []

    def ctrl_c_after_the_first_shard(tensors, path, meta):
        if saved:
            raise KeyboardInterrupt
        saved.append(path)
        save(tensors, path, meta)

    monkeypatch.setattr(encode_module, "atomic_save_tensors", ctrl_c_after_the_first_shard)
    try:
        r = run_entry_in_process(encode_module.cli, *cmd, prog="dit-encode-latents")
    except KeyboardInterrupt:  # not out of the test session: this test's failure
        pytest.fail("Ctrl-C escaped dit-encode-latents: a KeyboardInterrupt traceback")
    assert (r.returncode, r.stderr.splitlines()[-1]) == (130, encode_module.INTERRUPTED), r.stderr
    assert "Traceback" not in r.stderr and "continue" in encode_module.INTERRUPTED
    assert os.listdir(tmp_path / "lat" / "train") == ["shard_00000.safetensors"]
    monkeypatch.setattr(encode_module, "atomic_save_tensors", save)
    assert run_entry_in_process(encode_module.cli, *cmd, prog="dit-encode-latents").returncode == 0
    load_encoder()([str(a) for a in cmd[:4]] + ["--out", str(tmp_path / "whole")] + [str(a) for a in cmd[6:]])
    names = sorted(os.listdir(tmp_path / "whole" / "train"))
    assert names == sorted(os.listdir(tmp_path / "lat" / "train")) and len(names) == 3
    for name in names:
        a, b = load_file(str(tmp_path / "lat" / "train" / name)), load_file(str(tmp_path / "whole" / "train" / name))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_rerun_over_complete_shards_says_nothing_to_encode_without_loading_the_vae(tmp_path, monkeypatch, capfd):
    """A rerun when every shard existed loaded the VAE, showed a bar at millions of img/s and never said that
    nothing was encoded (found by a new-user trial)."""
    import dit_train.diffusion.vae as vae_module

    save_tiny_vae(tmp_path / "vae")
    image_folder(tmp_path / "img")
    args = ["--vae", str(tmp_path / "vae"), "--images", str(tmp_path / "img"), "--out", str(tmp_path / "lat"),
            "--image-size", "16", "--shard-size", "2", "--splits", "train"]
    first = load_encoder()(args)
    capfd.readouterr()
    shards = {n: os.path.getmtime(tmp_path / "lat" / "train" / n) for n in os.listdir(tmp_path / "lat" / "train")}

    def no_vae(*a, **k):
        raise AssertionError("the VAE was loaded with nothing to encode")

    monkeypatch.setattr(vae_module, "LatentCodec", no_vae)
    assert load_encoder()(args) == first
    out, err = capfd.readouterr()
    assert out.splitlines()[0] == (f"nothing to encode: every shard of train 5 images is in {tmp_path / 'lat'} "
                                   f"already, made with these settings")
    assert "img/s" not in err and "encoding" not in out
    assert {n: os.path.getmtime(tmp_path / "lat" / "train" / n) for n in shards} == shards
    os.remove(tmp_path / "lat" / "train" / "shard_00001.safetensors")  # one missing: the VAE is needed again
    with pytest.raises(AssertionError, match="the VAE was loaded"):
        load_encoder()(args)


def test_latents_of_one_split_say_how_to_add_the_other_and_image_folder_names_a_latents_folder(tmp_path):
    """Latents encoded with --splits train were refused by training with `no latent shards in .../val`, naming no
    way to add them; data=image_folder on a latents folder said `data.root='.../lat/train' has no class sub-folders`,
    a path the user never typed (found by a new-user trial)."""
    save_tiny_vae(tmp_path / "vae")
    image_folder(tmp_path / "img")
    load_encoder()(["--vae", str(tmp_path / "vae"), "--images", str(tmp_path / "img"), "--out", str(tmp_path / "lat"),
                    "--image-size", "16", "--splits", "train"])
    latents = OmegaConf.create({"name": "latents", "root": str(tmp_path / "lat"), "image_size": 8, "channels": 4})
    with pytest.raises(FileNotFoundError) as e:
        build_dataset(latents, "val")
    assert str(e.value) == (f"data.root={str(tmp_path / 'lat')!r} has train latents but no val latents "
                            f"({tmp_path / 'lat' / 'val'}/*.safetensors): a run opens both, even with "
                            f"train.val_every=0; add them by rerunning the dit-encode-latents command that made these "
                            f"with --splits val instead (every other flag the same; the train shards are kept)")
    images = OmegaConf.create({"name": "image_folder", "root": str(tmp_path / "lat"), "image_size": 16,
                               "skip_corrupt": False})
    with pytest.raises(FileNotFoundError) as e:
        build_dataset(images, "train")
    assert str(e.value) == (f"data.root={str(tmp_path / 'lat')!r} is a latents folder (dit-encode-latents' shards), "
                            f"not images: use data=latents for it")
    (tmp_path / "notes" / "train").mkdir(parents=True)  # no classes inside train/: the root as typed, then where
    with pytest.raises(FileNotFoundError) as e:
        build_dataset(OmegaConf.merge(images, {"root": str(tmp_path / "notes")}), "train")
    assert str(e.value) == (f"data.root={str(tmp_path / 'notes')!r} has no class sub-folders (in its train/ folder); "
                            f"expected root/<class>/<images>, or root/train/<class>/... and root/val/<class>/...")


def encode_args(tmp_path, *more):
    return ["--vae", str(tmp_path / "vae"), "--images", str(tmp_path / "img"), "--out", str(tmp_path / "lat"),
            "--image-size", "16", "--shard-size", "2", "--splits", "train", *more]


def test_a_truncated_shard_is_encoded_again_on_rerun(tmp_path):
    """A shard cut short (a killed copy or encode) was trusted by the rerun because it existed."""
    save_tiny_vae(tmp_path / "vae")
    image_folder(tmp_path / "img")
    load_encoder()(encode_args(tmp_path))
    path = tmp_path / "lat" / "train" / "shard_00001.safetensors"
    whole = path.read_bytes()
    path.write_bytes(whole[: len(whole) - 100])
    assert load_encoder()(encode_args(tmp_path))["complete"]
    from safetensors.torch import load_file

    cfg = OmegaConf.create({"name": "latents", "root": str(tmp_path / "lat"), "image_size": 8, "channels": 4,
                            "num_classes": 2})
    assert len(build_dataset(cfg, "train")) == 5 and len(path.read_bytes()) == len(whole)
    assert load_file(str(path))["latents"].shape[0] == 2


def test_non_finite_latents_are_refused_naming_the_image_and_a_refused_encoding_does_not_block_a_rerun(tmp_path):
    """A scaling_factor that takes latents past fp16's range stored inf latents, exit 0; and the latents_info.json
    of an encoding that wrote no shard refused the corrected rerun (another VAE) into the same --out."""
    save_tiny_vae(tmp_path / "vae")
    config = json.loads((tmp_path / "vae" / "config.json").read_text())
    (tmp_path / "vae" / "config.json").write_text(json.dumps({**config, "scaling_factor": 1e9}))
    image_folder(tmp_path / "img")
    with pytest.raises(ValueError, match=r"image .*img.a.\d\.png encodes to non-finite latents"):
        load_encoder()(encode_args(tmp_path))
    assert not os.listdir(tmp_path / "lat" / "train")
    (tmp_path / "vae" / "config.json").write_text(json.dumps(config))
    assert load_encoder()(encode_args(tmp_path))["complete"]


def test_data_set_with_images_is_one_line(tmp_path):
    save_tiny_vae(tmp_path / "vae")
    image_folder(tmp_path / "img")
    with pytest.raises(ConfigError, match=r"^--data-set image_size=8 is not valid with --images"):
        load_encoder()(encode_args(tmp_path, "--data-set", "image_size=8"))
    assert not (tmp_path / "lat").exists()


def test_data_latents_is_one_line_before_anything_is_written(tmp_path):
    """--data latents fed a latent set's 4-channel latents to the VAE as images: a conv traceback, after the new
    --out's latents_info.json was written."""
    save_tiny_vae(tmp_path / "vae")
    image_folder(tmp_path / "img")
    load_encoder()(encode_args(tmp_path)[:-2])  # both splits
    with pytest.raises(ConfigError, match=r"^--data latents is not valid: dit-encode-latents encodes images, and "
                                          r"latents are encoded already; pass the images they were made from"):
        load_encoder()(["--vae", str(tmp_path / "vae"), "--data", "latents", "--data-set",
                        f"root={tmp_path / 'lat'}", "--out", str(tmp_path / "again")])
    assert not (tmp_path / "again").exists()


def test_sigterm_while_encoding_is_one_line_exit_75_and_the_same_command_continues(tmp_path, monkeypatch):
    import signal

    import dit_train.data.encode as encode_module

    save_tiny_vae(tmp_path / "vae")
    image_folder(tmp_path / "img")
    save = encode_module.atomic_save_tensors

    def sigterm_after_the_first_shard(tensors, path, meta):
        save(tensors, path, meta)
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(encode_module, "atomic_save_tensors", sigterm_after_the_first_shard)
    before = signal.getsignal(signal.SIGTERM)
    r = run_entry_in_process(encode_module.cli, *encode_args(tmp_path), prog="dit-encode-latents")
    assert (r.returncode, r.stderr.splitlines()[-1]) == (75, encode_module.TERMINATED), r.stderr
    assert "Traceback" not in r.stderr and signal.getsignal(signal.SIGTERM) == before
    assert os.listdir(tmp_path / "lat" / "train") == ["shard_00000.safetensors"]
    monkeypatch.setattr(encode_module, "atomic_save_tensors", save)
    assert run_entry_in_process(encode_module.cli, *encode_args(tmp_path), prog="dit-encode-latents").returncode == 0


def test_skip_corrupt_does_not_store_the_next_image_in_place_of_an_unreadable_one(tmp_path):
    """--data image_folder with data.skip_corrupt=true: the trainer's substitute for an unreadable image (the next
    one) was encoded in its place, so the next image's latent was stored twice under the shard's count. The encoder
    names the image instead; skip_corrupt still skips an empty class folder."""
    save_tiny_vae(tmp_path / "vae")
    image_folder(tmp_path / "img")
    (tmp_path / "img" / "a" / "1.png").write_bytes(b"not a png")
    os.makedirs(tmp_path / "img" / "c")  # empty: skipped as asked
    args = ["--vae", str(tmp_path / "vae"), "--data", "image_folder", "--data-set", f"root={tmp_path / 'img'}",
            "image_size=16", "skip_corrupt=true", "--out", str(tmp_path / "lat"), "--shard-size", "8",
            "--splits", "train"]
    with pytest.raises(ValueError, match=r"^corrupt image .*img.a.1\.png: .* \(dit-encode-latents cannot leave an "
                                         r"image out: replace or remove the file, then rerun the same command"):
        load_encoder()(args)
    assert not os.listdir(tmp_path / "lat" / "train")
    Image.new("RGB", (20, 18), (60, 100, 0)).save(tmp_path / "img" / "a" / "1.png")
    assert load_encoder()(args)["complete"]


@pytest.mark.parametrize("change", ["removed image", "added image", "renamed image", "--limit 3", "--limit 8"])
def test_a_rerun_after_the_images_changed_encodes_again_only_the_shards_they_touch(tmp_path, change, capsys):
    """Any change of the image list was refused ('choose another --out'): an unreadable image removed after hours
    of encoding meant encoding everything again elsewhere. Now the shards whose images changed are encoded again
    (or removed, past the new count) and the others kept, file for file: the folder then holds what an encoding
    from scratch writes, and trains."""
    from safetensors.torch import load_file

    save_tiny_vae(tmp_path / "vae")
    image_folder(tmp_path / "img", per_class=4)  # 8 images, 7 train: shards of 2 images
    encode = load_encoder()
    args = ["--vae", str(tmp_path / "vae"), "--images", str(tmp_path / "img"), "--image-size", "16", "--shard-size",
            "2", "--splits", "train"]
    encode([*args, "--out", str(tmp_path / "lat")])
    shard0 = tmp_path / "lat" / "train" / "shard_00000.safetensors"
    kept = os.stat(shard0).st_ino
    cfg = OmegaConf.create({"name": "latents", "root": str(tmp_path / "lat"), "image_size": 8, "channels": 4,
                            "num_classes": 2})
    trained_on = build_dataset(cfg, "train").content_index()  # what a run's checkpoint records of its data
    limit = []
    if change == "removed image":
        os.remove(tmp_path / "img" / "b" / "2.png")
    elif change == "added image":
        Image.new("RGB", (20, 18), (9, 9, 9)).save(tmp_path / "img" / "b" / "9.png")
    elif change == "renamed image":
        os.rename(tmp_path / "img" / "b" / "1.png", tmp_path / "img" / "b" / "8.png")
    else:
        limit = change.split()
    capsys.readouterr()
    info = encode([*args, *limit, "--out", str(tmp_path / "lat")])
    told = capsys.readouterr().out
    fresh = encode([*args, *limit, "--out", str(tmp_path / "fresh")])
    assert info == {**fresh, "vae": info["vae"]} and info["complete"]
    assert sorted(os.listdir(tmp_path / "lat" / "train")) == sorted(os.listdir(tmp_path / "fresh" / "train"))
    for name in os.listdir(tmp_path / "fresh" / "train"):
        a, b = load_file(str(tmp_path / "lat" / "train" / name)), load_file(str(tmp_path / "fresh" / "train" / name))
        assert all(torch.equal(a[k], b[k]) for k in b), name
    if change != "--limit 8":  # more than the 7 images: nothing changed, nothing encoded again
        assert "train shard(s) in" in told and "changed since they were encoded" in told, told
    if change == "--limit 3":  # shards of 2, 2, 2, 1 images become 2, 1: shard 1 again, shards 2 and 3 removed
        assert "1 are encoded again; 2 past the new count are removed" in told, told
    assert os.stat(shard0).st_ino == kept  # class a's first images: the same file, not encoded again
    now = build_dataset(cfg, "train")
    assert len(now) == info["splits"][0]["latents"]
    # a run resumed on them is told its data changed (a renamed image's shard has the same count and size)
    assert (now.content_index() == trained_on) == (change == "--limit 8")


def test_a_rerun_over_an_older_encoders_shards_keeps_its_record_and_the_runs_data_fingerprint(tmp_path):
    """Shards recorded without per-shard image lists (an older encoder's): a rerun that encodes nothing added the
    lists, which changed the fingerprint of the data every run trained on them had recorded (resume refused)."""
    save_tiny_vae(tmp_path / "vae")
    image_folder(tmp_path / "img")
    load_encoder()(encode_args(tmp_path))
    info_path = tmp_path / "lat" / "latents_info.json"
    old = json.loads(info_path.read_text())
    old["splits"] = [{k: v for k, v in s.items() if k not in ("shard_image_lists", "shard_image_stats")}
                     for s in old["splits"]]  # nor stats: they came after the lists
    info_path.write_text(json.dumps(old))
    cfg = OmegaConf.create({"name": "latents", "root": str(tmp_path / "lat"), "image_size": 8, "channels": 4,
                            "num_classes": 2})
    trained_on = build_dataset(cfg, "train").content_index()
    assert load_encoder()(encode_args(tmp_path))["splits"] == old["splits"]
    assert build_dataset(cfg, "train").content_index() == trained_on


def shard_inodes(folder):
    """Each shard's file (inode, mtime): a shard written again is another (its inode number may be reused)."""
    return {name: (os.stat(folder / name).st_ino, os.stat(folder / name).st_mtime_ns)
            for name in sorted(os.listdir(folder))}


def test_an_image_rewritten_in_place_is_encoded_again_and_only_its_shard(tmp_path, capsys):
    """The record listed each shard's images by name only: an image replaced under the same name (a user fixes
    it) kept its stale latent on a rerun, with no word. Each shard's images' sizes and modification times are
    recorded now: the rerun encodes that shard again (the folder then holds what an encoding from scratch writes),
    keeps the others file for file, and the data fingerprint changes with the shard; a rerun with nothing changed
    encodes nothing, and a touched image (no new pixels) costs its shard one encoding, which leaves its latents as
    they were."""
    from safetensors.torch import load_file

    save_tiny_vae(tmp_path / "vae")
    image_folder(tmp_path / "img", per_class=4)  # 7 train images a/0..3, b/0..2 (b/3 held out): shards of 2
    encode = load_encoder()
    load_encoder()(encode_args(tmp_path))
    train = tmp_path / "lat" / "train"
    before = shard_inodes(train)
    cfg = OmegaConf.create({"name": "latents", "root": str(tmp_path / "lat"), "image_size": 8, "channels": 4,
                            "num_classes": 2})
    trained_on = build_dataset(cfg, "train").content_index()
    image = tmp_path / "img" / "a" / "2.png"  # train item 2: shard 1
    stat = os.stat(image)
    stale = load_file(str(train / "shard_00001.safetensors"))["latents"]
    Image.new("RGB", (20, 18), (250, 10, 250)).save(image)  # other pixels, the same name
    assert (os.stat(image).st_size, os.stat(image).st_mtime_ns) != (stat.st_size, stat.st_mtime_ns)
    capsys.readouterr()
    info = encode(encode_args(tmp_path))
    assert ("the images of 1 train shard(s) in" in capsys.readouterr().out)
    fresh = encode(encode_args(tmp_path)[:5] + [str(tmp_path / "fresh")] + encode_args(tmp_path)[6:])
    assert info == fresh and info["complete"]
    assert sorted(os.listdir(train)) == sorted(os.listdir(tmp_path / "fresh" / "train"))
    for name in os.listdir(train):
        a, b = load_file(str(train / name)), load_file(str(tmp_path / "fresh" / "train" / name))
        assert all(torch.equal(a[k], b[k]) for k in b), name
    after = shard_inodes(train)
    assert [n for n in before if after[n] != before[n]] == ["shard_00001.safetensors"]
    assert not torch.equal(load_file(str(train / "shard_00001.safetensors"))["latents"], stale)
    changed = build_dataset(cfg, "train").content_index()
    assert changed != trained_on  # a run resumed on them is told its data changed
    encode(encode_args(tmp_path))  # nothing changed since: nothing encoded again
    assert shard_inodes(train) == after and build_dataset(cfg, "train").content_index() == changed
    os.utime(tmp_path / "img" / "b" / "0.png")  # touched (train item 4: shard 2), the same pixels
    latents = load_file(str(train / "shard_00002.safetensors"))["latents"]
    encode(encode_args(tmp_path))
    assert [n for n in after if shard_inodes(train)[n] != after[n]] == ["shard_00002.safetensors"]
    assert torch.equal(load_file(str(train / "shard_00002.safetensors"))["latents"], latents)


def test_an_older_record_without_image_stats_is_rerun_as_before_and_says_so_once(tmp_path, capsys):
    """A record from before the images' sizes and times were recorded: a rerun keeps its form (stats added to it
    would change the data fingerprint its runs recorded) and its shards, and says in one line that an image
    rewritten in place is not seen there."""
    save_tiny_vae(tmp_path / "vae")
    image_folder(tmp_path / "img", per_class=4)
    load_encoder()(encode_args(tmp_path, "--splits", "train,val"))
    info_path = tmp_path / "lat" / "latents_info.json"
    old = json.loads(info_path.read_text())
    assert all("shard_image_stats" in s for s in old["splits"])
    old["splits"] = [{k: v for k, v in s.items() if k != "shard_image_stats"} for s in old["splits"]]
    info_path.write_text(json.dumps(old))
    cfg = OmegaConf.create({"name": "latents", "root": str(tmp_path / "lat"), "image_size": 8, "channels": 4,
                            "num_classes": 2})
    trained_on = build_dataset(cfg, "train").content_index()
    before = shard_inodes(tmp_path / "lat" / "train")
    Image.new("RGB", (20, 18), (250, 10, 250)).save(tmp_path / "img" / "a" / "2.png")
    capsys.readouterr()
    assert load_encoder()(encode_args(tmp_path, "--splits", "train,val"))["splits"] == old["splits"]
    told = [line for line in capsys.readouterr().out.splitlines() if "rewritten in place" in line]
    assert told == [f"{tmp_path}/lat/latents_info.json records no sizes or modification times of the train and val "
                    f"images (an older dit-encode-latents wrote it): an image rewritten in place under the same name "
                    f"is not seen, and its shard keeps the old latent; encode into a new --out to have that checked"]
    assert shard_inodes(tmp_path / "lat" / "train") == before
    assert build_dataset(cfg, "train").content_index() == trained_on


def test_a_shard_encoded_again_under_a_reader_that_indexed_it_is_refused_not_read(tmp_path):
    """A rerun after the images changed removes and rewrites shards in place; a run training from the folder (its
    loader workers open each shard lazily) read the new shard 2 at the old offsets, another image's latent with no
    word, and the removed shard 3 as a traceback. A shard it has not opened yet is checked against the file it
    indexed; one it holds open is read as indexed (the data its fingerprint names)."""
    save_tiny_vae(tmp_path / "vae")
    image_folder(tmp_path / "img", per_class=4)  # 7 train images: shards of 2, 2, 2, 1
    load_encoder()(encode_args(tmp_path))
    cfg = OmegaConf.create({"name": "latents", "root": str(tmp_path / "lat"), "image_size": 8, "channels": 4,
                            "num_classes": 2})
    ds = build_dataset(cfg, "train")
    first = ds[0][0].clone()  # shard 0 open
    os.remove(tmp_path / "img" / "b" / "0.png")  # train item 4 (b/3 is held out): shard 2 is encoded again, 3 removed
    load_encoder()(encode_args(tmp_path))
    assert torch.equal(ds[0][0], first) and torch.equal(ds[1][0], build_dataset(cfg, "train")[1][0])
    for i, shard in ((4, "shard_00002"), (6, "shard_00003")):
        with pytest.raises(ValueError, match=rf"^latent shard {tmp_path}/lat/train/{shard}.safetensors changed since "
                                             rf"this process indexed {tmp_path}/lat/train \(dit-encode-latents encoded "
                                             rf"it again\?\): "):
            ds[i]


def test_the_same_images_encoded_from_another_folder_are_the_same_data_to_a_resumed_run(tmp_path):
    """The per-shard image lists hashed each image's absolute path, and a latent set's data fingerprint includes
    them: the same images, copied to another machine's path and encoded there, were 'other data' to a resumed run
    (the fingerprint stays the same when a folder moves: an image folder's is its paths relative to the split)."""
    import shutil

    save_tiny_vae(tmp_path / "vae")
    image_folder(tmp_path / "img", per_class=4)
    shutil.copytree(tmp_path / "img", tmp_path / "elsewhere" / "img")
    index = []
    for images, out in ((tmp_path / "img", "lat"), (tmp_path / "elsewhere" / "img", "lat2")):
        load_encoder()(["--vae", str(tmp_path / "vae"), "--images", str(images), "--out", str(tmp_path / out),
                        "--image-size", "16", "--shard-size", "2"])
        cfg = OmegaConf.create({"name": "latents", "root": str(tmp_path / out), "image_size": 8, "channels": 4,
                                "num_classes": 2})
        index.append([build_dataset(cfg, split).content_index() for split in ("train", "val")])
        images_cfg = OmegaConf.create({"name": "image_folder", "root": str(images), "image_size": 16,
                                       "skip_corrupt": False})
        assert build_dataset(images_cfg, "train").content_index() == \
            build_dataset(OmegaConf.merge(images_cfg, {"root": str(tmp_path / "img")}), "train").content_index()
    assert index[0] == index[1]
    os.rename(tmp_path / "elsewhere" / "img" / "a" / "1.png", tmp_path / "elsewhere" / "img" / "a" / "9.png")
    load_encoder()(["--vae", str(tmp_path / "vae"), "--images", str(tmp_path / "elsewhere" / "img"), "--out",
                    str(tmp_path / "lat2"), "--image-size", "16", "--shard-size", "2"])
    cfg = OmegaConf.create({"name": "latents", "root": str(tmp_path / "lat2"), "image_size": 8, "channels": 4,
                            "num_classes": 2})
    assert build_dataset(cfg, "train").content_index() != index[0][0]  # a renamed image is still other data


def test_a_split_whose_encoding_stopped_keeps_the_record_incomplete_after_the_other_split_is_added(tmp_path, capsys):
    """--splits train stopped (an unreadable image), then --splits val: the record said complete, so the trainer's
    check passed a set whose train shards were not all written. It stays incomplete, and the encoder says which
    split to finish."""
    save_tiny_vae(tmp_path / "vae")
    image_folder(tmp_path / "img")
    (tmp_path / "img" / "b" / "2.png").write_bytes(b"not a png")
    with pytest.raises(ValueError, match=r"corrupt image .*2\.png"):
        load_encoder()(encode_args(tmp_path))
    capsys.readouterr()
    info = load_encoder()(encode_args(tmp_path)[:-2] + ["--splits", "val"])
    assert not info["complete"] and not json.loads((tmp_path / "lat" / "latents_info.json").read_text())["complete"]
    assert (f"the train shards in {tmp_path / 'lat'} are not all written (their encoding stopped): rerun with "
            f"--splits train to finish them\n") in capsys.readouterr().out
    with pytest.raises(ConfigError, match=r"its encoding stopped before every shard was written"):
        check_latent_run({"name": "dit_s"}, {"root": str(tmp_path / "lat")}, {"path": str(tmp_path / "vae")}, True)
    Image.new("RGB", (20, 18), (120, 200, 0)).save(tmp_path / "img" / "b" / "2.png")
    assert load_encoder()(encode_args(tmp_path))["complete"]
    check_latent_run({"name": "dit_s"}, {"root": str(tmp_path / "lat")}, {"path": str(tmp_path / "vae")}, True)


def test_adding_a_split_after_the_other_splits_images_changed_says_so(tmp_path, capsys):
    """--splits train with root/train and root/val, then root/val removed and --splits val: val became the images
    held out of root/train, every one of them already encoded as train, with no word. The encoder now compares
    the kept split's images with those its record lists and says how to encode it again."""
    import shutil

    save_tiny_vae(tmp_path / "vae")
    image_folder(tmp_path / "img" / "train")
    image_folder(tmp_path / "img" / "val", per_class=1)
    load_encoder()(encode_args(tmp_path))
    shutil.rmtree(tmp_path / "img" / "val")
    capsys.readouterr()
    load_encoder()(encode_args(tmp_path)[:-2] + ["--splits", "val"])
    assert (f"warning: the train images in {tmp_path / 'img'} are not those its shards in {tmp_path / 'lat'} were "
            f"encoded from (they changed since, or a val/ folder came or went: val may overlap them): rerun with "
            f"--splits train,val to encode the changed train shards again\n") in capsys.readouterr().out
    load_encoder()(encode_args(tmp_path)[:-2] + ["--splits", "train,val"])
    load_encoder()(encode_args(tmp_path)[:-2] + ["--splits", "val"])  # the same images: no word
    assert "warning" not in capsys.readouterr().out
    # a train image rewritten in place under the same name: said too (it was not)
    train = build_dataset(OmegaConf.create({"name": "image_folder", "root": str(tmp_path / "img"), "image_size": 16,
                                            "skip_corrupt": False}), "train")
    Image.new("RGB", (20, 18), (250, 10, 250)).save(train.samples[0][0])
    load_encoder()(encode_args(tmp_path)[:-2] + ["--splits", "val"])
    assert "warning: the train images in" in capsys.readouterr().out


# an encoder (the command, in its own process) that holds --out's lock after its first shard until a line arrives
HOLD_AFTER_FIRST_SHARD = """
import sys

import dit_train.data.encode as encode

save = encode.atomic_save_tensors


def hold(tensors, path, meta):
    save(tensors, path, meta)
    if not hasattr(hold, "held"):
        hold.held = True
        print("holding", flush=True)
        sys.stdin.readline()


encode.atomic_save_tensors = hold
sys.argv = ["dit-encode-latents", *sys.argv[1:]]
sys.exit(encode.cli())
"""


def start_holding_encoder(args):
    """The encoder of `args` in a process of its own, once it holds the lock and has written its first shard."""
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    p = subprocess.Popen([sys.executable, "-c", HOLD_AFTER_FIRST_SHARD, *args], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    for line in p.stdout:
        if line == "holding\n":
            return p
    p.wait()
    pytest.fail(f"the holding encoder ended (exit {p.returncode}) before its first shard: {p.stderr.read()[-2000:]}")


def refusal_line(out, pid):
    """The one line a second job on `out` prints (the start time as a pattern)."""
    import socket

    return (rf"error: --out {re.escape(str(out))} is being written by another dit-encode-latents \(pid {pid}, "
            rf"started at \d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d UTC, host {re.escape(socket.gethostname())}\); wait for "
            rf"it, or choose another --out\n")


def test_a_second_encoder_on_the_same_out_is_refused_in_one_line_before_it_writes_anything(tmp_path):
    """A train and a val split launched on one --out at once (two terminals, two Slurm jobs): each read the record,
    encoded and wrote back its own, so one split's entry was lost. The second is refused in one line while the
    first holds out/.encode.lock, before it reads the record or writes anything; the first finishes undisturbed,
    and the second, rerun after it, adds its split."""
    from dit_train.data.encode import cli

    save_tiny_vae(tmp_path / "vae")
    image_folder(tmp_path / "img")
    holder = start_holding_encoder(encode_args(tmp_path))
    try:
        before = folder_state(tmp_path / "lat")
        assert "latents_info.json" in before and "train/shard_00000.safetensors" in before
        val = [*encode_args(tmp_path)[:-2], "--splits", "val"]
        for second in (val, encode_args(tmp_path)):  # the other split; the same command twice
            r = run_entry_in_process(cli, *second, prog="dit-encode-latents")
            assert r.returncode == 2 and re.fullmatch(refusal_line(tmp_path / "lat", holder.pid), r.stderr), r.stderr
            assert folder_state(tmp_path / "lat") == before  # the first's record and shards, as they were
        out, err = holder.communicate("\n", timeout=120)
    finally:
        if holder.returncode is None:
            holder.kill()
            holder.communicate(timeout=60)
    assert holder.returncode == 0, err[-2000:]
    info = json.loads((tmp_path / "lat" / "latents_info.json").read_text())
    assert info["complete"] and [s["split"] for s in info["splits"]] == ["train"]
    assert not (tmp_path / "lat" / ".encode.lock").exists()  # removed by the job that held it
    assert run_entry_in_process(cli, *val, prog="dit-encode-latents").returncode == 0
    info = json.loads((tmp_path / "lat" / "latents_info.json").read_text())
    assert info["complete"] and [(s["split"], s["images"]) for s in info["splits"]] == [("train", 5), ("val", 1)]


def test_a_lock_file_left_by_a_killed_encoder_does_not_block_a_new_run(tmp_path):
    """The lock is the kernel's flock on out/.encode.lock, not the file: an encoder SIGKILLed (the OOM killer, a
    node lost) leaves the file behind with its pid, and the same command continues its shards."""
    save_tiny_vae(tmp_path / "vae")
    image_folder(tmp_path / "img")
    holder = start_holding_encoder(encode_args(tmp_path))
    holder.kill()
    holder.communicate(timeout=60)
    lock = tmp_path / "lat" / ".encode.lock"
    assert json.loads(lock.read_text())["pid"] == holder.pid  # left behind, naming the dead encoder
    info = load_encoder()(encode_args(tmp_path))
    assert info["complete"] and not lock.exists()
    assert sorted(os.listdir(tmp_path / "lat" / "train")) == [f"shard_0000{k}.safetensors" for k in range(3)]


def test_under_torchrun_every_rank_is_refused_at_once_while_another_job_holds_the_lock(tmp_path):
    """Rank 0 takes the lock for its job and tells the other ranks (they share --out by design): a refused rank 0
    left them waiting in a collective. Both ranks print the line and the job ends."""
    from conftest import free_port

    save_tiny_vae(tmp_path / "vae")
    image_folder(tmp_path / "img")
    holder = start_holding_encoder(encode_args(tmp_path))
    try:
        before = folder_state(tmp_path / "lat")
        env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
        two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                              str(free_port()), "-m", "dit_train.data.encode", *encode_args(tmp_path)[:-2], "--splits",
                              "val"], capture_output=True, text=True, timeout=300, env=env)
        assert two.returncode != 0
        assert len(re.findall(refusal_line(tmp_path / "lat", holder.pid), two.stderr)) == 2, two.stderr[-3000:]
        assert folder_state(tmp_path / "lat") == before
    finally:
        holder.kill()
        holder.communicate(timeout=60)


def test_a_filesystem_without_flock_is_said_in_one_warning_and_the_encoding_proceeds(tmp_path, monkeypatch, capsys):
    """flock failing with ENOSYS (Lustre mounted with noflock) must not stop every encoding there; one warning says
    that a second job on --out would not be refused."""
    import errno
    from types import SimpleNamespace

    import dit_train.data.encode_lock as encode_lock

    def no_flock(fd, op):
        raise OSError(errno.ENOSYS, os.strerror(errno.ENOSYS))

    save_tiny_vae(tmp_path / "vae")
    image_folder(tmp_path / "img")
    fcntl = encode_lock.fcntl  # the module's name for it only: the process's fcntl.flock stays as it is
    monkeypatch.setattr(encode_lock, "fcntl", SimpleNamespace(LOCK_EX=fcntl.LOCK_EX, LOCK_NB=fcntl.LOCK_NB,
                                                              flock=no_flock))
    assert load_encoder()(encode_args(tmp_path))["complete"]
    assert capsys.readouterr().out.splitlines()[0] == (
        f"warning: --out {tmp_path / 'lat'} does not support file locks (flock: {os.strerror(errno.ENOSYS)}): "
        f"another dit-encode-latents on it would not be refused; run one at a time on it")
    assert not (tmp_path / "lat" / ".encode.lock").exists()


def test_an_image_whose_name_is_not_utf8_is_encoded_and_a_rerun_keeps_its_shards(tmp_path):
    """A file name of bytes that are not UTF-8 (a Latin-1 name copied from an old disk: Linux allows any bytes)
    was refused as '--images: 'utf-8' codec can't encode character '\\udcff'...', naming no file: the hold-out,
    the image lists and the data fingerprint hashed str.encode() of the name. They hash the name's bytes now
    (the same bytes as before for every UTF-8 name: no fingerprint or hold-out changes)."""
    import hashlib

    from dit_train.data.image_folder import HOLD_OUT_SEED, held_out

    save_tiny_vae(tmp_path / "vae")
    image_folder(tmp_path / "img", per_class=4)
    odd = os.fsdecode(os.path.join(os.fsencode(str(tmp_path / "img" / "a")), b"caf\xe9.png"))
    Image.new("RGB", (20, 18), (7, 8, 9)).save(odd)
    info = load_encoder()(encode_args(tmp_path, "--splits", "train,val"))
    assert info["complete"]
    cfg = OmegaConf.create({"name": "image_folder", "root": str(tmp_path / "img"), "image_size": 16,
                            "skip_corrupt": False})
    listed = [p for split in ("train", "val") for p, _ in build_dataset(cfg, split).samples]
    assert odd in listed and sum(s["images"] for s in info["splits"]) == len(listed) == 9
    digest = hashlib.sha256(HOLD_OUT_SEED + b"a/0.png").digest()  # a UTF-8 name: hashed as before
    assert held_out("a/0.png") == (int.from_bytes(digest[:8], "big") < 0.05 * 2 ** 64)
    before = shard_inodes(tmp_path / "lat" / "train")
    assert load_encoder()(encode_args(tmp_path, "--splits", "train,val")) == info
    assert shard_inodes(tmp_path / "lat" / "train") == before


def test_a_record_with_image_stats_but_no_image_lists_is_refused_before_anything_changes(tmp_path):
    """shard_image_stats are compared beside the shards' image lists only: a hand-edited record keeping the stats
    but not the lists was rerun as one with neither (an image rewritten in place kept its stale latent) without
    the line that says so, since the record has stats. It is refused as not the encoder's, the folder untouched."""
    save_tiny_vae(tmp_path / "vae")
    image_folder(tmp_path / "img", per_class=4)
    load_encoder()(encode_args(tmp_path))
    info_path = tmp_path / "lat" / "latents_info.json"
    info = json.loads(info_path.read_text())
    info["splits"] = [{k: v for k, v in s.items() if k != "shard_image_lists"} for s in info["splits"]]
    info_path.write_text(json.dumps(info))
    Image.new("RGB", (20, 18), (250, 10, 250)).save(tmp_path / "img" / "a" / "2.png")  # rewritten in place
    before = folder_state(tmp_path / "lat")
    with pytest.raises(ConfigError, match=rf"^{tmp_path}/lat/latents_info.json is not as dit-encode-latents writes it "
                                          rf"\(train records its images' stats \(shard_image_stats\) but not their "
                                          rf"lists") as e:
        load_encoder()(encode_args(tmp_path))
    assert "\n" not in str(e.value) and folder_state(tmp_path / "lat") == before
