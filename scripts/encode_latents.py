#!/usr/bin/env python
"""Encode an image folder (root/<class>/<images>, or root/train + root/val) into latent shards for data=latents.

    python scripts/encode_latents.py --vae /path/to/sd-vae-ft-ema --images /data/imagenet --out /data/latents \
        --image-size 256 --shard-size 4096

The VAE is diffusers' AutoencoderKL loaded from a local folder (config.json + weights). Latents are the mean of
the posterior times the VAE's scaling factor (and minus its shift factor where the VAE has one), stored as fp16
with int64 labels: out/<split>/shard_00000.safetensors. Shards are written atomically; an existing complete
shard is skipped, so an interrupted run continues where it stopped.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from dit_train.data import build_dataset  # noqa: E402


def load_vae(path: str, device):
    from dit_train.extras import MissingExtra, require

    try:
        require("diffusers", "latents", "encoding latents")
    except MissingExtra as e:
        raise SystemExit(f"error: {e}") from None
    from diffusers import AutoencoderKL

    if not os.path.isfile(os.path.join(path, "config.json")):
        raise SystemExit(f"error: --vae {path!r} is not a diffusers AutoencoderKL folder (config.json + weights)")
    return AutoencoderKL.from_pretrained(path).to(device).eval()


@torch.no_grad()
def encode_split(vae, images_root: str, split: str, out_dir: str, image_size: int, shard_size: int,
                 batch_size: int, device) -> dict:
    ds = build_dataset({"name": "image_folder", "root": images_root, "image_size": image_size}, split)
    os.makedirs(os.path.join(out_dir, split), exist_ok=True)
    scale = getattr(vae.config, "scaling_factor", 1.0) or 1.0
    shift = getattr(vae.config, "shift_factor", None) or 0.0
    written, latent_shape = 0, None
    for shard, start in enumerate(range(0, len(ds), shard_size)):
        path = os.path.join(out_dir, split, f"shard_{shard:05d}.safetensors")
        stop = min(start + shard_size, len(ds))
        if os.path.exists(path):
            written += stop - start
            continue
        latents, labels = [], []
        for b in range(start, stop, batch_size):
            items = [ds[i] for i in range(b, min(b + batch_size, stop))]
            x = torch.stack([it[0] for it in items]).to(device)
            z = vae.encode(x).latent_dist.mean
            latents.append(((z - shift) * scale).half().cpu())
            latent_shape = list(z.shape[1:])
            labels += [it[1] for it in items]
        tmp = path + ".tmp"
        save_file({"latents": torch.cat(latents).contiguous(), "labels": torch.tensor(labels, dtype=torch.int64)}, tmp)
        os.replace(tmp, path)
        written += stop - start
    return {"split": split, "images": written, "classes": ds.classes, "latent_shape": latent_shape}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vae", required=True, help="local diffusers AutoencoderKL folder")
    p.add_argument("--images", required=True, help="image folder (class sub-folders, optionally train/ and val/)")
    p.add_argument("--out", required=True)
    p.add_argument("--image-size", type=int, default=256)
    p.add_argument("--shard-size", type=int, default=4096)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--splits", default="train,val")
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    vae = load_vae(args.vae, device)
    report = [encode_split(vae, args.images, s, args.out, args.image_size, args.shard_size, args.batch_size, device)
              for s in args.splits.split(",")]
    with open(os.path.join(args.out, "latents_info.json"), "w") as f:
        json.dump({"vae": os.path.abspath(args.vae), "image_size": args.image_size, "splits": report}, f, indent=2)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
