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
Images added, removed or renamed (an unreadable one removed, say), or another --limit: the shards whose images
changed are encoded again, the others kept.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import math
import os
import signal
import sys

import torch

from dit_train.runs.atomic_io import atomic_save_tensors, atomic_write_bytes, describe_os_error
from dit_train.config.errors import ConfigError
from dit_train.config.latents import LATENTS_INFO, not_a_vae, read_latents_info, vae_files, vae_scaling
from dit_train.data.datasets import build_dataset
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
    splits = args.splits.split(",")
    if not splits or any(s not in ("train", "val") for s in splits) or len(set(splits)) < len(splits):
        raise ConfigError(f"--splits={args.splits} is not valid: expected train, val or train,val")
    if args.images is not None and args.data_set:  # they were ignored: the folder's own config was encoded
        raise ConfigError(f"--data-set {' '.join(args.data_set)} is not valid with --images: it overrides --data's "
                          f"config; drop it, or use --data image_folder --data-set root=... instead")
    if args.images is not None and not os.path.isdir(args.images):  # was a traceback naming data.root
        raise ConfigError(f"--images {args.images} is not a folder: expected an image folder (root/<class>/<images>, "
                          f"or root/train/<class>/... and root/val/<class>/...)")


def image_list(ds, start: int, stop: int) -> str:
    """Which images items start..stop-1 of the split are: an image folder's files and labels in order, else the
    dataset id (a file added, removed or renamed shifts every later shard's contents)."""
    items = getattr(ds, "samples", None)
    text = "".join(f"{p}\t{y}\n" for p, y in items[start:stop]) if items is not None else \
        f"{ds.dataset_id}:{stop}" if start == 0 else f"{ds.dataset_id}:{start}:{stop}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def encoding_record(args, source: dict, datasets: dict) -> dict:
    """latents_info.json: everything the shards' contents depend on (batch size aside: it only groups the work);
    each shard's image list too, so that a rerun after images changed encodes again only the shards they touch."""
    size = args.shard_size
    splits = [{"split": split, "images": n, "latents": n * (2 if args.flip else 1),
               "shards": math.ceil(n / size), "image_list": image_list(ds, 0, n),
               "shard_image_lists": [image_list(ds, k * size, min((k + 1) * size, n))
                                     for k in range(math.ceil(n / size))]}
              for split, (ds, n) in datasets.items()]
    scale, shift = vae_scaling(args.vae)
    # which folder each label is, for the trainer's start-up line (an image folder's; the image lists cover them)
    classes = next((list(ds.classes) for ds, _ in datasets.values() if getattr(ds, "classes", None)), None)
    return {"vae": os.path.abspath(args.vae), "vae_files": vae_files(args.vae), "scaling_factor": scale,
            "shift_factor": shift, "flip": bool(args.flip), "shard_size": args.shard_size, "source": source,
            "splits": splits, "class_names": classes, "complete": False}


# recorded for the reader, not a setting the shards depend on: a record without it (an older encoder's) continues
INFORMATIONAL = ("class_names",)


def resume_conflict(old: dict, new: dict, out: str) -> str | None:
    """Why the shards in `out` (recorded in `old`) cannot be continued by this run (`new`), and what to do; None:
    they can."""
    if old and not glob.glob(os.path.join(out, "*", "shard_*.safetensors")):
        old = {}  # a refused or stopped encoding that wrote no shard binds nothing: a rerun may change the settings
    if not old:
        if glob.glob(os.path.join(out, "*", "shard_*.safetensors")):
            return f"{out} holds latent shards but no {LATENTS_INFO} that says how they were made; choose another --out"
        return None
    missing = [k for k in new if k not in old and k not in INFORMATIONAL]
    if missing:
        return (f"{out}/{LATENTS_INFO} does not record {', '.join(missing)} (an older dit-encode-latents wrote it); "
                f"choose another --out")
    damaged = damaged_splits(old["splits"])
    if damaged:  # a hand-edited record: its shard lists decide which shards are removed and encoded again
        return f"{out}/{LATENTS_INFO} is not as dit-encode-latents writes it ({damaged}); choose another --out"
    differs = settings_conflict(old, new, out)
    return differs and f"{differs}; rerun with the settings in {out}/{LATENTS_INFO}, or choose another --out"


def damaged_splits(splits) -> str | None:
    """What is wrong with a record's `splits` (a list of one entry per split: its name, counts, image list and,
    from encoders that record them, one image list per shard), or None."""
    if not isinstance(splits, list):
        return f"splits is a {type(splits).__name__}, not a list"
    for s in splits:
        if not (isinstance(s, dict) and isinstance(s.get("split"), str) and isinstance(s.get("images"), int)
                and isinstance(s.get("shards"), int) and isinstance(s.get("image_list"), str)):
            return f"a split entry {json.dumps(s)[:80]} lacks its split name, counts or image list"
        lists = s.get("shard_image_lists", [""] * s["shards"])
        if not (isinstance(lists, list) and len(lists) == s["shards"] and all(isinstance(h, str) for h in lists)):
            return f"{s['split']}'s shard_image_lists is not {s['shards']} image lists, one per shard"
    return None


def settings_conflict(old: dict, new: dict, out: str) -> str | None:
    """The first setting of this run that differs from the one the shards were made with; None: none does."""
    if (old["vae_files"], old["scaling_factor"], old["shift_factor"]) != \
            (new["vae_files"], new["scaling_factor"], new["shift_factor"]):
        return f"{out} holds latents made with another VAE ({old['vae']}), not --vae {new['vae']}"
    if old["flip"] != new["flip"]:
        return f"{out} holds latents made {'with' if old['flip'] else 'without'} --flip"
    if old["shard_size"] != new["shard_size"]:
        return f"{out} holds latents made with --shard-size {old['shard_size']}, not {new['shard_size']}"
    for key in sorted(set(old["source"]) | set(new["source"])):
        if old["source"].get(key) != new["source"].get(key):
            return (f"{out} holds latents made from source {key}={old['source'].get(key)!r}, not "
                    f"{new['source'].get(key)!r} (--images/--data/--data-set/--image-size)")
    recorded = {s["split"]: s for s in old["splits"]}
    for s in new["splits"]:
        then = recorded.get(s["split"], s)
        if "shard_image_lists" in then:  # the shards whose images changed are encoded again (changed_shards)
            continue
        if (then["images"], then["image_list"]) != (s["images"], s["image_list"]):
            return (f"{out} holds {s['split']} latents of {then['images']} images, now {s['images']} images or "
                    f"other files (--limit, or images added, removed or renamed)")
    return None


def changed_shards(old: dict, new: dict, out: str) -> dict[str, list[str]]:
    """Per split, the shard files in `out` whose images are not those the new record lists for them (a file added,
    removed or renamed, --limit changed): shards of other images, and shards past the new count (the trainer
    refuses a shard its record does not list). Shards before the change keep their latents."""
    recorded = {s["split"]: s for s in old.get("splits") or ()}
    changed = {}
    for s in new["splits"]:
        then = recorded.get(s["split"], {}).get("shard_image_lists")
        if then is None or then == s["shard_image_lists"]:
            continue
        paths = sorted(glob.glob(os.path.join(out, s["split"], "shard_*.safetensors")))
        keep = {shard_name(k) for k, (a, b) in enumerate(zip(then, s["shard_image_lists"])) if a == b}
        changed[s["split"]] = [p for p in paths if os.path.basename(p) not in keep]
    return changed


def keep_record_format(old: dict, new: dict, out: str) -> None:
    """A split whose shards an older encoder recorded without per-shard image lists stays so: its shards' image
    lists are not known, and lists added to its record would change the data fingerprint of runs trained on it
    (a resume of them refused as 'other data' after a rerun that encoded nothing)."""
    recorded = {s["split"]: s for s in old.get("splits") or ()}
    for s in new["splits"]:
        then = recorded.get(s["split"])
        if then is not None and "shard_image_lists" not in then and \
                glob.glob(os.path.join(out, s["split"], "shard_*.safetensors")):
            del s["shard_image_lists"]


def forget_changed_shards(changed: dict[str, list[str]], out: str) -> None:
    """Remove the shards of images that changed, before the new record is written: a shard on disk always holds
    the images the record on disk lists for it, wherever a rerun is interrupted."""
    for split, paths in changed.items():
        if paths:
            print(f"the images of {len(paths)} {split} shard(s) in {out} changed since they were encoded (--limit, or "
                  f"images added, removed or renamed): they are encoded again ({os.path.basename(paths[0])} on)",
                  flush=True)
        for path in paths:
            os.remove(path)


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
    from dit_train.diffusion.vae import LatentCodec
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
    keep_record_format(old, info, args.out)
    changed = changed_shards(old, info, args.out)
    # a rerun over complete shards loads no VAE (seconds, or a GPU's memory): it has nothing to encode
    codec = LatentCodec(args.vae, dist.device, args.batch_size) \
        if any(changed.values()) or shards_to_write(args.out, datasets, args.shard_size, dist.rank,
                                                    dist.world_size) else None
    this_run = {s["split"] for s in info["splits"]}
    info["splits"] = [s for s in old.get("splits", []) if s["split"] not in this_run] + info["splits"]
    info_path = os.path.join(args.out, LATENTS_INFO)
    if dist.is_main:  # before the first shard: an interrupted run's shards are never without their record
        os.makedirs(args.out, exist_ok=True)
        forget_changed_shards(changed, args.out)
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
    info["complete"] = True
    if dist.is_main:
        atomic_write_bytes(json.dumps(info, indent=2).encode(), info_path)
        print(json.dumps([s for s in info["splits"] if s["split"] in this_run]))
    shutdown_process_group()
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
