"""Sample from a trained run without writing Python: EMA weights, Euler steps with classifier-free guidance (the
one sampler, dit_train.diffusion.sampler), a grid with one row per class and/or a folder of PNGs.

    python -m dit_train.sample RUN_OR_CHECKPOINT [--classes 0 3 7] [--per-class 8] [--steps 50] [--cfg-scale 2.5]
                               [--seed 0] [--grid samples.png] [--out-dir samples/] [--batch-size 64]

Steps, guidance and seed default to the run's own (train.sample_steps, train.cfg_scale, seed), and the noise is
the training grids' stream: with --per-class train.samples_per_class and classes 0..9 the grid is the run's last
sample grid, pixel for pixel. The same seed and batch size give the same images. The Euler steps equal diffusers' FlowMatchEulerDiscreteScheduler with
`sigmas = linspace(1, 0, steps + 1)[:-1]` bit for bit (tests/test_sample.py), so a diffusers scheduler can replace
them: feed the model t = the scheduler's sigma (our t runs from 1 = noise to 0).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from dit_train import seeds
from dit_train.runs.checkpoint import load_for_inference
from dit_train.evaluation.grids import save_grid, save_image
from dit_train.diffusion.sampler import make_sampler


def latent_decoder(cfg, vae_path: str | None, device):
    """A latent run's samples are VAE latents: decoded by the run's VAE (vae.path, or --vae); None for image runs."""
    if cfg.data.get("name") != "latents":
        return None
    path = vae_path or cfg.get("vae", {}).get("path")
    if not path:
        raise ValueError(f"{cfg.model.get('name')} was trained on latents (data=latents) and its run names no VAE: "
                         f"pass --vae /path/to/vae (the folder given to encode_latents.py --vae)")
    from dit_train.diffusion.vae import LatentCodec

    return LatentCodec(path, device).decode


def class_labels(cfg, classes: list[int] | None, per_class: int) -> torch.Tensor:
    """`per_class` labels of each class (all classes by default); an unconditional model: `per_class` images."""
    num_classes = int(cfg.model.get("num_classes", 0) or 0)
    if num_classes == 0:
        return torch.zeros(per_class, dtype=torch.long)
    classes = list(range(num_classes)) if classes is None else classes
    bad = [c for c in classes if not 0 <= c < num_classes]
    if bad:
        raise ValueError(f"--classes {bad[0]} is not valid: this model has classes 0..{num_classes - 1}")
    return torch.tensor(classes).repeat_interleave(per_class)


def sample(source: str, classes: list[int] | None = None, per_class: int = 8, steps: int | None = None,
           cfg_scale: float | None = None, seed: int | None = None, batch_size: int = 64,
           device: str = "cpu", vae: str | None = None) -> tuple:
    """(images [N, C, H, W] in [-1, 1], labels [N], run config, checkpoint meta) from the EMA weights of `source`."""
    if per_class < 1 or batch_size < 1:
        raise ValueError(f"--per-class={per_class} / --batch-size={batch_size} is not valid: expected integers >= 1")
    model, cfg, meta = load_for_inference(source, device)
    if int(cfg.model.get("text_dim", 0) or 0):
        raise ValueError(f"model.text_dim={cfg.model.text_dim}: a text-conditioned model needs caption embeddings, "
                         f"which this command does not take")
    decode = latent_decoder(cfg, vae, device)
    steps = cfg.train.sample_steps if steps is None else steps
    cfg_scale = cfg.train.cfg_scale if cfg_scale is None else cfg_scale
    seed = cfg.seed if seed is None else seed
    if steps < 1 or cfg_scale < 0:
        raise ValueError(f"--steps={steps} / --cfg-scale={cfg_scale} is not valid: expected steps >= 1, scale >= 0")
    labels = class_labels(cfg, classes, per_class)
    sampler = make_sampler(model, cfg.model, device, steps, cfg_scale, cfg.train.precision, decode=decode)
    generator = seeds.generator("grid_noise", seed, device=torch.device(device))  # the training grids' noise
    images = []
    for batch in labels.split(batch_size):
        images.append(sampler(batch, generator).cpu())
    return torch.cat(images), labels, cfg, {**meta, "steps": steps, "cfg_scale": cfg_scale, "seed": seed}


def write_folder(images: torch.Tensor, labels: torch.Tensor, folder: str) -> list[str]:
    """One PNG per image: class{c:03d}_{i:04d}.png, i counting within the class."""
    os.makedirs(folder, exist_ok=True)
    counts: dict[int, int] = {}
    paths = []
    for image, label in zip(images, labels.tolist()):
        i = counts[label] = counts.get(label, -1) + 1
        paths.append(save_image(image, os.path.join(folder, f"class{label:03d}_{i:04d}.png")))
    return paths


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dit_train.sample", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("source", help="run folder (its newest checkpoint) or a step_N.dcp checkpoint folder")
    ap.add_argument("--classes", type=int, nargs="+", default=None, help="class ids (default: every class)")
    ap.add_argument("--per-class", type=int, default=8, help="images per class (default 8): one grid row per class")
    ap.add_argument("--steps", type=int, default=None, help="Euler steps (default: the run's train.sample_steps)")
    ap.add_argument("--cfg-scale", type=float, default=None, help="guidance scale, 1 = off (default: the run's)")
    ap.add_argument("--seed", type=int, default=None, help="noise seed (default: the run's seed)")
    ap.add_argument("--grid", default=None, help="grid PNG path (default samples.png unless --out-dir is given)")
    ap.add_argument("--out-dir", default=None, help="folder for one PNG per image")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--vae", default=None, help="VAE folder of a latent run (default: the run's vae.path)")
    args = ap.parse_args(argv)
    grid = args.grid or (None if args.out_dir else "samples.png")
    try:
        images, labels, _, meta = sample(args.source, args.classes, args.per_class, args.steps, args.cfg_scale,
                                         args.seed, args.batch_size, args.device, args.vae)
    except (FileNotFoundError, KeyError, ValueError) as e:  # CheckpointError is a ValueError
        print(f"error: {e}", file=sys.stderr)
        return 2
    written = []
    if grid:
        os.makedirs(os.path.dirname(os.path.abspath(grid)), exist_ok=True)
        written.append(save_grid(images, grid, nrow=args.per_class))
    if args.out_dir:
        written.append(f"{len(write_folder(images, labels, args.out_dir))} PNGs in {args.out_dir}")
    print(f"{len(images)} samples from {meta['path']} (step {meta['step']}, {meta['steps']} Euler steps, CFG "
          f"{meta['cfg_scale']:g}, seed {meta['seed']}): {', '.join(written)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
