#!/usr/bin/env python
"""Encode images into the latent shards that data=latents trains on.

    python scripts/encode_latents.py --vae /w/sd-vae-ft-ema --images /data/imagenet --out /data/latents \
        --image-size 256 --flip
    torchrun --nproc_per_node 8 scripts/encode_latents.py ...             # shards dealt over the ranks
    python scripts/encode_latents.py --vae /w/vae --data fashion_mnist --out /tmp/fm_latents --limit 512

Images come from an image folder (--images: root/<class>/<images>, or root/train + root/val) or any dataset config
of the trainer (--data NAME, --data-set KEY=VALUE). The VAE is diffusers' AutoencoderKL from a local folder; a
latent is (mean of the posterior - shift_factor) * scaling_factor (dit_train/vae.py), stored as fp16 with int64
labels in out/<split>/shard_NNNNN.safetensors (the factors in each shard's metadata too). --flip stores every image
and its horizontal mirror, as DiT's feature extraction does. Shards are written atomically and an existing one is
skipped, so an interrupted run continues where it stopped. out/latents_info.json records the VAE, its factors and
the source images, which the trainer checks against vae.path and uses as the FD reference of latent runs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch
from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from dit_train.atomic_io import atomic_write_bytes  # noqa: E402
from dit_train.config.latents import LATENTS_INFO, read_latents_info  # noqa: E402
from dit_train.data import build_dataset  # noqa: E402
from dit_train.fd.job_config import load_data_cfg  # noqa: E402
from dit_train.parallel import barrier, init_distributed, shutdown_process_group  # noqa: E402


def source_config(args) -> dict:
    """The dataset config of the images (what FD of a latent run compares with)."""
    from omegaconf import OmegaConf

    if args.images:
        return {"name": "image_folder", "root": os.path.abspath(args.images), "image_size": args.image_size,
                "channels": 3, "num_classes": None, "skip_corrupt": False}
    cfg = OmegaConf.to_container(load_data_cfg(args.data, args.data_set), resolve=True)
    return {**cfg, "image_size": args.image_size or cfg["image_size"]}


@torch.no_grad()
def encode_split(codec, source: dict, split: str, args, rank: int, world: int, progress) -> dict:
    ds = build_dataset(source, split)
    n = min(len(ds), args.limit) if args.limit else len(ds)
    folder = os.path.join(args.out, split)
    os.makedirs(folder, exist_ok=True)
    shards = math.ceil(n / args.shard_size)
    meta = {"vae": os.path.abspath(codec.path), "scaling_factor": str(codec.scale), "shift_factor": str(codec.shift),
            "flip": str(bool(args.flip))}
    for shard in range(rank, shards, world):
        path = os.path.join(folder, f"shard_{shard:05d}.safetensors")
        start, stop = shard * args.shard_size, min((shard + 1) * args.shard_size, n)
        if not os.path.exists(path):  # an existing shard is complete (written by rename)
            latents, labels = [], []
            for b in range(start, stop, args.batch_size):
                items = [ds[i] for i in range(b, min(b + args.batch_size, stop))]
                x = torch.stack([it[0] for it in items])
                y = torch.tensor([it[1] for it in items], dtype=torch.int64)
                if args.flip:  # each image, then its mirror
                    x = torch.stack([x, x.flip(-1)], dim=1).flatten(0, 1)
                    y = y.repeat_interleave(2)
                latents.append(codec.encode(x).half().cpu())
                labels.append(y)
            tmp = f"{path}.tmp-{os.getpid()}"
            save_file({"latents": torch.cat(latents).contiguous(), "labels": torch.cat(labels)}, tmp, metadata=meta)
            os.replace(tmp, path)
        if progress is not None:
            progress.update(stop - start)
    return {"split": split, "images": n, "latents": n * (2 if args.flip else 1), "shards": shards}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vae", required=True, help="local diffusers AutoencoderKL folder")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--images", help="image folder (class sub-folders, optionally train/ and val/)")
    src.add_argument("--data", help="a dataset config of the trainer (dit_train/conf/data/<name>.yaml)")
    p.add_argument("--data-set", nargs="*", default=[], metavar="KEY=VALUE", help="overrides of --data's config")
    p.add_argument("--out", required=True)
    p.add_argument("--image-size", type=int, default=None, help="pixels (default 256 for --images, else the data's)")
    p.add_argument("--flip", action="store_true", help="also store each image's horizontal mirror")
    p.add_argument("--limit", type=int, default=0, help="encode only the first N images of each split (0: all)")
    p.add_argument("--shard-size", type=int, default=4096, help="images per shard")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--splits", default="train,val")
    args = p.parse_args(argv)
    if args.images and args.image_size is None:
        args.image_size = 256
    from dit_train.vae import LatentCodec

    dist = init_distributed()
    codec = LatentCodec(args.vae, dist.device, args.batch_size)
    old = read_latents_info(args.out)
    if old and (float(old["scaling_factor"]), float(old["shift_factor"])) != (codec.scale, codec.shift):
        raise SystemExit(f"error: {args.out} holds latents of another VAE ({old['vae']}); choose another --out")
    source = source_config(args)
    progress = None
    if dist.is_main:
        from tqdm import tqdm

        progress = tqdm(desc="encode", unit="img", dynamic_ncols=True)
    splits = [encode_split(codec, source, s, args, dist.rank, dist.world_size, progress) for s in args.splits.split(",")]
    if progress is not None:
        progress.close()
    barrier()  # every rank's shards are on disk
    info = {"vae": os.path.abspath(args.vae), "scaling_factor": codec.scale, "shift_factor": codec.shift,
            "flip": bool(args.flip), "source": source, "splits": splits}
    if dist.is_main:
        atomic_write_bytes(json.dumps(info, indent=2).encode(), os.path.join(args.out, LATENTS_INFO))
        print(json.dumps(splits))
    shutdown_process_group()
    return info


if __name__ == "__main__":
    main()
