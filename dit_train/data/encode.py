"""Encode images into the latent shards that data=latents trains on.

    dit-encode-latents --vae /w/sd-vae-ft-ema --images /data/imagenet --out /data/latents \\
        --image-size 256 --flip
    torchrun --nproc_per_node 8 --no-python dit-encode-latents ...             # shards dealt over the ranks
    dit-encode-latents --vae /w/vae --data fashion_mnist --out /tmp/fm_latents --limit 512

Images come from an image folder (--images: root/<class>/<images>, or root/train + root/val; without val/ the
trainer's held-out part is the val split) or any dataset config of the trainer (--data NAME, --data-set KEY=VALUE),
resized to --image-size: by default their own size when they share one square size up to 256 (as a run on them
takes it), else 256 for --images (DiT's size: larger images are downscaled, as the large presets expect 32x32
latents); the first line says which. The VAE is diffusers' AutoencoderKL from a local folder; a
latent is (mean of the posterior - shift_factor) * scaling_factor (dit_train/diffusion/vae.py), stored as fp16 with int64
labels in out/<split>/shard_NNNNN.safetensors (the factors in each shard's metadata too). --flip stores every image
and its horizontal mirror, as DiT's feature extraction does. out/latents_info.json, written before the first shard,
records the VAE (its files' fingerprints), its factors, the source images and the settings that decide what each
shard holds; the trainer (vae.path), dit-sample, dit-export and dit-fd (--vae) check the VAE they decode with
against it, and the source is the FD reference of latent runs.
Shards are written atomically and an existing one is skipped, so an interrupted run continues where it stopped:
only with the VAE, --flip, --shard-size and the source's settings recorded (else one line, and nothing is written).
Images added, removed or renamed (an unreadable one removed, say), rewritten in place under the same name (each
shard's images' sizes and modification times are recorded: one stat per image and run), or another --limit: the
shards whose images changed are encoded again, the others kept. One job writes an --out at a time: it holds a lock
on out/.encode.lock (rank 0 for a torchrun job), and a second job on the same --out (the other split from another
terminal) is refused in one line naming the first's pid, host and start (data/encode_lock.py: what the lock does
not cover).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys

import torch

from dit_train.runs.atomic_io import atomic_save_tensors, atomic_write_bytes, describe_os_error
from dit_train.config.errors import ConfigError
from dit_train.config.latents import LATENTS_INFO, not_a_vae, read_latents_info
from dit_train.data.datasets import build_dataset
from dit_train.data.encode_record import (binding_record, changed_shards, encoding_record, file_stats,
                                          forget_changed_shards, image_list, keep_record_format, resume_conflict,
                                          split_written, stats_hash)
from dit_train.data.encode_lock import encoding_lock
from dit_train.data.latents import shard_name
from dit_train.evaluation.fd.job_config import load_data_cfg
from dit_train.parallel.fsdp import barrier, init_distributed, shutdown_process_group
from dit_train.trainer.preemption import EXIT_PREEMPTED, exit_interrupted
from dit_train.plain_text import print_error


DEFAULT_IMAGE_SIZE = 256  # --images of mixed sizes: DiT's ImageNet resolution
INTERRUPTED = ("dit-encode-latents: interrupted; the shards written so far are kept: rerun the same command to "
               "continue from them")
UNREADABLE_HINT = ("dit-encode-latents cannot leave an image out: replace or remove the file, then rerun the same "
                   "command (the shards before it are kept)")
TERMINATED = ("dit-encode-latents: stopped by SIGTERM; the shards written so far are kept (a shard in progress is "
              "not): rerun the same command to continue from them")


def source_config(args) -> tuple[dict, str]:
    """The dataset config of the images (what FD of a latent run compares with) and where its size came from.
    Without --image-size, the size the images' files decide, as a run on them takes it (an image folder of one
    square size: that size; else 256 for --images, the data option's for --data): 32 px images were encoded at
    256 px unasked."""
    from omegaconf import OmegaConf

    from dit_train.data.shapes import image_folder_shapes, read_data_shapes, with_data_shapes

    if args.images:
        found = None if args.image_size else image_folder_shapes(args.images).get("image_size")
        if found is not None and found.value > DEFAULT_IMAGE_SIZE:  # downscaled to DiT's 256 px, as before: the
            found = None  # large presets take 32x32 latents; 1024 px images would make 16x the tokens unasked
        size = args.image_size or (found.value if found else DEFAULT_IMAGE_SIZE)
        source = {"name": "image_folder", "root": os.path.abspath(args.images), "image_size": size,
                  "channels": 3, "num_classes": None, "skip_corrupt": False}
    else:
        cfg = OmegaConf.to_container(load_data_cfg(args.data, args.data_set), resolve=True)
        if cfg.get("name") == "latents":  # its 4-channel latents went into the VAE: a traceback after the record
            raise ConfigError(f"--data {args.data} is not valid: dit-encode-latents encodes images, and latents are "
                              f"encoded already; pass the images they were made from (--images, or the source named "
                              f"in their latents_info.json)")
        given = {kv.split("=", 1)[0] for kv in args.data_set}
        cfg, _ = with_data_shapes(cfg, given)
        found = "image_size" not in given and "image_size" in read_data_shapes(cfg)  # even if equal to the preset's
        source = {**cfg, "image_size": args.image_size or cfg["image_size"]}
    why = ("--image-size" if args.image_size else "the images' size" if found else
           "the default for images of mixed or larger sizes" if args.images else f"data={args.data}'s")
    return source, why


def check_out_beside_images(out: str, source: dict) -> None:
    """--out inside the image folder (or the folder itself) made its train/ and val/ part of the images: the folder
    then read as root/train/<class> with no class folders, and the latents' own FD reference with it."""
    if source.get("name") != "image_folder" or not source.get("root"):
        return
    root, target = os.path.realpath(source["root"]), os.path.realpath(out)
    if os.path.commonpath([root, target]) == root:
        raise ConfigError(f"--out {out} is inside the image folder {source['root']}: its train/ and val/ would join "
                          f"the images (which then no longer read as root/<class>/<images>); choose a folder "
                          f"outside it")


def check_flags(args) -> None:
    """The flags' values, before the VAE, the images or --out are read: one line naming the flag (--shard-size 0
    and --splits train,test were tracebacks; --batch-size 0 one after latents_info.json was written; --limit -1
    recorded splits of -1 images)."""
    for flag, value, least in (("--image-size", args.image_size, 1), ("--shard-size", args.shard_size, 1),
                               ("--batch-size", args.batch_size, 1), ("--limit", args.limit, 0)):
        if value is not None and value < least:
            raise ConfigError(f"{flag}={value} is not valid: expected an integer >= {least}")
    if not args.out:  # os.makedirs('') after the images were listed: '[Errno 2] No such file or directory'
        raise ConfigError("--out='' is not valid: expected a folder for the shards and latents_info.json")
    splits = args.splits.split(",")
    if not splits or any(s not in ("train", "val") for s in splits) or len(set(splits)) < len(splits):
        raise ConfigError(f"--splits={args.splits} is not valid: expected train, val or train,val")
    if args.images is not None and args.data_set:  # they were ignored: the folder's own config was encoded
        raise ConfigError(f"--data-set {' '.join(args.data_set)} is not valid with --images: it overrides --data's "
                          f"config; drop it, or use --data image_folder --data-set root=... instead")
    if args.images is not None and not os.path.isdir(args.images):  # was a traceback naming data.root
        raise ConfigError(f"--images {args.images} is not a folder: expected an image folder (root/<class>/<images>, "
                          f"or root/train/<class>/... and root/val/<class>/...)")


def warn_if_images_changed(carried: list[dict], source: dict, args) -> None:
    """A split kept from an earlier encoding (--splits val after --splits train) whose images are no longer those
    its record lists (or were rewritten in place, where it records their sizes and modification times): one warning
    line. A val/ folder removed in between made val the images held out of train/,
    every one of them encoded as train, with no word; a refusal would block adding val after train's images were
    deleted to save disk."""
    for entry in carried:
        try:
            ds = build_dataset(source, entry["split"])
            changed = len(ds) < entry["images"] or image_list(ds, 0, entry["images"]) != entry["image_list"]
            if not changed and "shard_image_stats" in entry:  # an image rewritten in place
                stats = file_stats(ds, entry["images"])
                size = args.shard_size  # the record's (settings_conflict)
                changed = stats is not None and entry["shard_image_stats"] != [
                    stats_hash(stats, k * size, (k + 1) * size) for k in range(entry["shards"])]
        except (FileNotFoundError, ValueError):  # the images are gone
            changed = True
        if changed:
            other = ",".join(sorted({entry["split"], *args.splits.split(",")}, key=("train", "val").index))
            print(f"warning: the {entry['split']} images in {source.get('root') or '--data ' + str(args.data)} are "
                  f"not those its shards in {args.out} were encoded from (they changed since, or a val/ folder came "
                  f"or went: {args.splits} may overlap them): rerun with --splits {other} to encode the changed "
                  f"{entry['split']} shards again", flush=True)


def images_of_rank(n: int, shard_size: int, rank: int, world: int) -> int:
    """The images of an n-image split that `rank` encodes: its shards, dealt round-robin as in encode_split."""
    return sum(min(shard_size, n - s * shard_size) for s in range(rank, math.ceil(n / shard_size), world))


def shard_path(out: str, split: str, shard: int) -> str:
    return os.path.join(out, split, shard_name(shard))


def shards_to_write(out: str, datasets: dict, shard_size: int, rank: int = 0, world: int = 1) -> int:
    """How many of `rank`'s shards (dealt as in encode_split) are not on disk whole yet. 0: the VAE is not loaded."""
    return sum(not shard_is_whole(shard_path(out, split, shard), shard_items(n, shard_size, shard))
               for split, (_, n) in datasets.items() for shard in range(rank, math.ceil(n / shard_size), world))


def shard_items(n: int, shard_size: int, shard: int) -> int:
    return min(shard_size, n - shard * shard_size)


def shard_is_whole(path: str, images: int) -> bool:
    """Whether the shard at `path` opens and holds latents of its `images` (either flip): a file cut short (a
    copy or a disk that failed, a kill outside the atomic rename) was trusted because it existed."""
    from safetensors import safe_open

    if not os.path.isfile(path):
        return False
    try:
        with safe_open(path, framework="pt") as f:
            count = f.get_slice("latents").get_shape()[0]
            f.get_slice("latents")[count - 1 : count]  # the last row: a cut-off tail fails here
    except Exception:  # safetensors' errors are not one class
        return False
    return count in (images, 2 * images)


@torch.no_grad()
def encode_split(codec, ds, n: int, split: str, args, rank: int, world: int, progress) -> None:
    os.makedirs(os.path.join(args.out, split), exist_ok=True)
    shards = math.ceil(n / args.shard_size)
    for shard in range(rank, shards, world):
        path = shard_path(args.out, split, shard)
        start, stop = shard * args.shard_size, min((shard + 1) * args.shard_size, n)
        if not shard_is_whole(path, stop - start):  # a truncated one is written again
            meta = {"vae": os.path.abspath(codec.path), "scaling_factor": str(codec.scale),
                    "shift_factor": str(codec.shift), "flip": str(bool(args.flip))}
            latents, labels = [], []
            for b in range(start, stop, args.batch_size):
                items = [ds[i] for i in range(b, min(b + args.batch_size, stop))]
                x = torch.stack([it[0] for it in items])
                y = torch.tensor([it[1] for it in items], dtype=torch.int64)
                if args.flip:  # each image, then its mirror
                    x = torch.stack([x, x.flip(-1)], dim=1).flatten(0, 1)
                    y = y.repeat_interleave(2)
                z = codec.encode(x).half().cpu()
                check_finite(z, ds, b, 2 if args.flip else 1)
                latents.append(z)
                labels.append(y)
            atomic_save_tensors({"latents": torch.cat(latents).contiguous(), "labels": torch.cat(labels)}, path,
                                meta)
        if progress is not None:
            progress.update(stop - start)


def check_finite(z: torch.Tensor, ds, first: int, per_image: int) -> None:
    """Refuse inf/nan latents (a VAE's fp32 output past fp16's range, a broken VAE) naming the image: they were
    stored and trained on."""
    bad = (~torch.isfinite(z.flatten(1))).any(1).nonzero()
    if len(bad):
        i = first + int(bad[0]) // per_image
        items = getattr(ds, "samples", None)
        name = items[i][0] if items is not None else f"item {i} of {ds.dataset_id}"
        raise ValueError(f"image {name} encodes to non-finite latents (inf or nan as fp16, max |finite| 65504): "
                         f"check the VAE (its scaling_factor) or the image; nothing of its shard was written")


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="dit-encode-latents", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vae", required=True, help="local diffusers AutoencoderKL folder")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--images", help="image folder (class sub-folders, optionally train/ and val/)")
    src.add_argument("--data", help="a dataset option of the trainer (data=<name>: fashion_mnist, image_folder, ...)")
    p.add_argument("--data-set", nargs="*", default=[], metavar="KEY=VALUE", help="overrides of --data's config")
    p.add_argument("--out", required=True,
                   help="folder for the shards (<split>/shard_*.safetensors) and latents_info.json; a rerun with the "
                        "same settings continues an interrupted encoding there")
    p.add_argument("--image-size", type=int, default=None,
                   help="pixels (default: the images' size when they share one square size up to 256, else 256 "
                        "for --images; the data option's for --data)")
    p.add_argument("--flip", action="store_true", help="also store each image's horizontal mirror")
    p.add_argument("--limit", type=int, default=0, help="encode only the first N images of each split (0: all)")
    p.add_argument("--shard-size", type=int, default=4096, help="images per shard")
    p.add_argument("--batch-size", type=int, default=32,
                   help="images per VAE forward pass (memory only: the shards do not depend on it)")
    p.add_argument("--splits", default="train,val",
                   help="comma-separated splits to encode, of train and val (default: both)")
    args = p.parse_args(argv)
    check_flags(args)
    from dit_train.diffusion.vae_shapes import check_vae_folder

    problem = not_a_vae(args.vae)  # a DINOv2 folder was told to save with safe_serialization
    if problem:
        raise ConfigError(f"--vae={args.vae!r} is not valid: {problem}")
    if not os.path.isfile(os.path.join(args.vae, "config.json")):
        raise ConfigError(f"--vae {args.vae} is not a diffusers AutoencoderKL folder (config.json + weights)")
    try:
        check_vae_folder(args.vae)  # before any data is read or latents_info.json written
    except ValueError as e:
        raise ConfigError(f"--vae: {e}") from None
    dist = init_distributed()
    source, size_from = source_config(args)
    check_out_beside_images(args.out, source)
    # one job per --out (rank 0 holds it; every rank is refused at once), before the record is read: two jobs
    # each wrote back their own record, one split's entry lost (encode_lock.py, and what it does not cover)
    with encoding_lock(args.out, dist.is_main):
        info = encode(args, dist, source, size_from)
    shutdown_process_group()
    return info


def encode(args, dist, source: dict, size_from: str) -> dict:
    """The encoding into args.out, under its lock: the record read, checked and written before the first shard,
    the shards, then the record again (complete)."""
    from dit_train.diffusion.vae import LatentCodec

    datasets = {}
    for split in args.splits.split(","):
        try:
            ds = build_dataset(source, split)
        except (FileNotFoundError, ValueError) as e:  # the dataset's words (data.root=...), under the flag given
            raise ConfigError(f"{'--images' if args.images else f'--data {args.data}'}: {e}") from None
        if hasattr(ds, "in_order_only"):  # data.skip_corrupt's substitute would be stored as the skipped image
            ds.in_order_only(UNREADABLE_HINT)
        datasets[split] = ds, min(len(ds), args.limit) if args.limit else len(ds)
    info = encoding_record(args, source, datasets)
    try:
        old = read_latents_info(args.out)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    conflict = resume_conflict(old, info, args.out)
    if conflict:
        raise ConfigError(conflict)
    old = binding_record(old, args.out)  # a record of no shard: none of it is read or kept (resume_conflict)
    unseen = keep_record_format(old, info, args.out)
    if unseen and dist.is_main:
        print(f"{args.out}/{LATENTS_INFO} records no sizes or modification times of the {' and '.join(unseen)} "
              f"images (an older dit-encode-latents wrote it): an image rewritten in place under the same name is "
              f"not seen, and its shard keeps the old latent; encode into a new --out to have that checked",
              flush=True)
    changed = changed_shards(old, info, args.out)
    # a rerun over complete shards loads no VAE (seconds, or a GPU's memory): it has nothing to encode
    codec = LatentCodec(args.vae, dist.device, args.batch_size) \
        if any(changed.values()) or shards_to_write(args.out, datasets, args.shard_size, dist.rank,
                                                    dist.world_size) else None
    this_run = {s["split"] for s in info["splits"]}
    carried = [s for s in old.get("splits", []) if s["split"] not in this_run]  # encoded by an earlier run
    info["splits"] = carried + info["splits"]
    if dist.is_main:
        warn_if_images_changed(carried, source, args)
    info_path = os.path.join(args.out, LATENTS_INFO)
    if dist.is_main:  # before the first shard: an interrupted run's shards are never without their record
        os.makedirs(args.out, exist_ok=True)
        forget_changed_shards(changed, args.out, info)
        atomic_write_bytes(json.dumps(info, indent=2).encode(), info_path)
    barrier()
    progress = None
    if dist.is_main:
        from tqdm import tqdm

        size, counts = source["image_size"], ", ".join(f"{split} {n}" for split, (_, n) in datasets.items())
        if shards_to_write(args.out, datasets, args.shard_size):
            print(f"encoding {counts} images at {size}x{size} px ({size_from}) with --vae {args.vae} into "
                  f"{args.out}", flush=True)
            # rank 0 counts only its own shards: the bar says so, and its total is their images
            mine = sum(images_of_rank(n, args.shard_size, 0, dist.world_size) for _, n in datasets.values())
            label = "encode" if dist.world_size == 1 else f"encode (rank 0's shards of {dist.world_size} ranks)"
            progress = tqdm(desc=label, total=mine, unit="img", dynamic_ncols=True)
        else:  # a bar over skipped shards showed millions of img/s and never said that nothing was encoded
            print(f"nothing to encode: every shard of {counts} images is in {args.out} already, made with these "
                  f"settings", flush=True)
    try:
        for split, (ds, n) in datasets.items():
            encode_split(codec, ds, n, split, args, dist.rank, dist.world_size, progress)
    finally:  # ended on its own line before an error or Ctrl-C's line (else that line joined the bar's)
        if progress is not None:
            progress.close()
    barrier()  # every rank's shards are on disk
    unfinished = [s["split"] for s in carried if not split_written(args.out, s)]  # --splits val after train stopped
    info["complete"] = not unfinished
    if dist.is_main:
        atomic_write_bytes(json.dumps(info, indent=2).encode(), info_path)
        print(json.dumps([s for s in info["splits"] if s["split"] in this_run]))
        if unfinished:
            print(f"the {' and '.join(unfinished)} shards in {args.out} are not all written (their encoding stopped): "
                  f"rerun with --splits {','.join(unfinished)} to finish them", flush=True)
    return info


class Terminated(Exception):
    """SIGTERM (scancel, a job's time limit): raised where the encoding is, ended as Ctrl-C is."""


def raise_terminated(signum, frame):
    raise Terminated


def cli() -> int:
    """The command (main returns the latents_info.json record to callers; a console script exits with what it
    returns): a refusal is one line and exit status 2, a failing disk one line and 1, as in every dit-* command;
    Ctrl-C one line and 130 (the shards written are kept: the same command continues)."""
    previous = signal.signal(signal.SIGTERM, raise_terminated)  # the default killed it mid-shard, with no word
    try:
        main()
    except Terminated:
        print(TERMINATED, file=sys.stderr)
        return EXIT_PREEMPTED
    except (ConfigError, FileNotFoundError, ValueError) as e:  # a ConfigError is a ValueError; so is a corrupt image
        print_error(str(e))
        return 2
    except OSError as e:  # a full disk, an unwritable --out: the path and the operation
        print_error(describe_os_error(e))
        return 1
    except KeyboardInterrupt:
        exit_interrupted(INTERRUPTED)
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0


if __name__ == "__main__":
    sys.exit(cli())
