"""Sample from a trained run without writing Python: EMA weights, Euler steps with classifier-free guidance (the
one sampler, dit_train.diffusion.sampler), a grid with one row per class and/or a folder of PNGs.

    dit-sample RUN_OR_CHECKPOINT [--classes 0 3 7] [--per-class 8] [--steps 50] [--cfg-scale 2.5]
                               [--seed 0] [--grid samples.png] [--out-dir samples/] [--batch-size 64]

Everything left out is the run's own grids' (classes 0..9, train.samples_per_class per class, train.sample_steps,
train.cfg_scale, seed; the noise is the training grids' stream, drawn once for all images; a latent run's VAE
decodes them all after sampling in vae.decode_batch_size batches), so `dit-sample RUN` is the
run's last grid pixel for pixel (tests/integration/test_sample.py, tests/integration/test_latents_e2e.py) on the
CPU. The noise does not depend on the batch size. The Euler steps equal diffusers' FlowMatchEulerDiscreteScheduler
with `sigmas = linspace(1, 0, steps + 1)[:-1]` bit for bit (tests/integration/test_sample.py), so a diffusers
scheduler can replace them: feed the model t = the scheduler's sigma (our t runs from 1 = noise to 0). A progress bar counts the model
calls on a terminal (--no-progress: none).
"""

from __future__ import annotations

import argparse
import errno
import math
import os
import sys

import torch
from omegaconf import OmegaConf

from dit_train import seeds
from dit_train.devices import check_device
from dit_train.runs.atomic_io import check_folder_can_be_made, describe_os_error
from dit_train.runs.checkpoint import (is_complete, literal_config, load_for_inference, read_saved_state,
                                       resolve_checkpoint)
from dit_train.evaluation.grids import save_grid, save_image
from dit_train.diffusion.sampler import as_latents, make_sampler, noise_shape
from dit_train.evaluation.during_training import grid_classes
from dit_train.plain_text import print_error, printable
from dit_train.telemetry.progress import model_call_bar
from dit_train.trainer.preemption import ctrl_c_exits


def decoding_vae(cfg, vae_path: str | None, recorded: dict | None = None, checkpoint: str = "") -> str | None:
    """A latent run's VAE folder (vae.path, or --vae), checked to be the one that made its latents (their
    latents_info.json, else the checkpoint's record `recorded`) before any weights are read; None for image runs."""
    if cfg.data.get("name") != "latents":
        if vae_path is not None:  # ignored before: the user believed the images were decoded by it
            raise ValueError(f"--vae={vae_path!r} is not valid here: this run trained on images (data="
                             f"{cfg.data.get('name')}); only a latent run (data=latents) is decoded by a VAE")
        return None
    path = vae_path or (cfg.get("vae") or {}).get("path")
    if not path:
        raise ValueError(f"{cfg.model.get('name')} was trained on latents (data=latents) and its run names no VAE: "
                         f"pass --vae /path/to/vae (the folder given to dit-encode-latents --vae)")
    from dit_train.config.latents import check_decoding_vae

    check_decoding_vae(path, cfg.data.get("root"), "--vae" if vae_path else "vae.path", recorded, checkpoint)
    return path


def latent_codec(cfg, vae_path: str | None, device, recorded: dict | None = None, checkpoint: str = "",
                 checked: bool = False):
    """A latent run's samples are VAE latents: decoded by the run's VAE (vae.path, or --vae) in batches of its
    vae.decode_batch_size, as its grids were; None for image runs. `checked`: decoding_vae has judged it."""
    if cfg.data.get("name") != "latents":
        return None
    path = (vae_path or cfg.vae.path) if checked else decoding_vae(cfg, vae_path, recorded, checkpoint)
    from dit_train.diffusion.vae import LatentCodec

    return LatentCodec(path, device, (cfg.get("vae") or {}).get("decode_batch_size", 16))


def class_labels(cfg, classes: list[int] | None, per_class: int) -> torch.Tensor:
    """`per_class` labels of each class (by default the classes of the run's grids); an unconditional model:
    `per_class` images."""
    num_classes = int(cfg.model.get("num_classes", 0) or 0)
    if num_classes == 0:
        return torch.zeros(per_class, dtype=torch.long)
    classes = list(range(grid_classes(cfg.model))) if classes is None else classes
    bad = [c for c in classes if not 0 <= c < num_classes]
    if bad:
        raise ValueError(f"--classes {bad[0]} is not valid: this model has classes 0..{num_classes - 1}")
    return torch.tensor(classes).repeat_interleave(per_class)


def sample(source: str, classes: list[int] | None = None, per_class: int | None = None, steps: int | None = None,
           cfg_scale: float | None = None, seed: int | None = None, batch_size: int | None = None,
           device: str = "cpu", vae: str | None = None, progress: bool = False) -> tuple:
    """(images [N, C, H, W] in [-1, 1], labels [N], run config, meta: the checkpoint's and the settings used) from
    the EMA weights of `source`. Left as None, a setting is the run's own grids'; the noise of all N images is one
    draw, as in the run's grids, so the batch size does not change the images."""
    check_device(device)
    path = resolve_checkpoint(source)
    state = read_saved_state(path) if is_complete(path) else None
    if state is not None:  # the saved settings and the VAE judged before the weights are read (a legacy .pt holds both)
        early = OmegaConf.create(literal_config(state["config"]))
        grid_settings(early, path, per_class, steps, cfg_scale, seed, batch_size)
        decoding_vae(early, vae, state.get("latents_vae"), path)
    model, cfg, meta = load_for_inference(path, device)
    if int(cfg.model.get("text_dim", 0) or 0):
        raise ValueError(f"model.text_dim={cfg.model.text_dim}: a text-conditioned model needs caption embeddings, "
                         f"which this command does not take")
    per_class, steps, cfg_scale, seed, batch_size, precision = grid_settings(cfg, path, per_class, steps, cfg_scale,
                                                                             seed, batch_size)
    labels = class_labels(cfg, classes, per_class)
    codec = latent_codec(cfg, vae, device, meta["latents_vae"], path, checked=state is not None)
    # latents are decoded after sampling, all together, as the run's grid decodes them
    sampler = make_sampler(model, cfg.model, device, steps, cfg_scale, precision,
                           decode=None if codec is None else as_latents)
    generator = seeds.generator("grid_noise", seed, device=torch.device(device))  # the training grids' noise
    noise = torch.randn((len(labels), *noise_shape(cfg.model)), generator=generator, device=device)
    batches = list(zip(labels.split(batch_size), noise.split(batch_size)))
    with model_call_bar(model, len(batches) * steps, "sample", enabled=progress):
        images = torch.cat([sampler(y, None, noise=z).cpu() for y, z in batches])
    if codec is not None:
        images = codec.decode(images).cpu()
    return images, labels, cfg, {**meta, "steps": steps, "cfg_scale": cfg_scale, "seed": seed, "per_class": per_class}


def grid_settings(cfg, path: str, per_class, steps, cfg_scale, seed, batch_size) -> tuple:
    """(per_class, steps, cfg_scale, seed, batch_size, precision): the flags' values, each one left out the run's
    own, read from the checkpoint's saved config and checked against its schema first (a config from elsewhere
    asked for 10^12 images per class: a traceback or an out-of-memory when the noise was drawn; a string or NaN
    scale, or an unknown precision, was a traceback)."""
    if per_class is None or batch_size is None:
        run_per_class = saved_setting(cfg, "train.samples_per_class", path, "--per-class and --batch-size")
        per_class = run_per_class if per_class is None else per_class
        batch_size = grid_classes(cfg.model) * run_per_class if batch_size is None else batch_size  # the run's call
    if per_class < 1 or batch_size < 1:
        raise ValueError(f"--per-class={per_class} / --batch-size={batch_size} is not valid: expected integers >= 1")
    steps = saved_setting(cfg, "train.sample_steps", path, "--steps") if steps is None else steps
    cfg_scale = saved_setting(cfg, "train.cfg_scale", path, "--cfg-scale") if cfg_scale is None else cfg_scale
    seed = saved_setting(cfg, "seed", path, "--seed") if seed is None else seed
    if steps < 1:  # each flag named alone: `--steps=0 / --cfg-scale=2.5` named a scale nobody had typed
        raise ValueError(f"--steps={steps} is not valid: expected an integer >= 1")
    if not 0 <= cfg_scale < math.inf:  # a NaN scale would sample NaN images
        raise ValueError(f"--cfg-scale={cfg_scale} is not valid: expected a finite scale >= 0")
    return per_class, steps, cfg_scale, seed, batch_size, saved_setting(cfg, "train.precision", path)


def saved_setting(cfg, key: str, path: str, flags: str | None = None):
    """The run's own value of `key` (its schema's default when the saved config lacks it), valid by its schema;
    `flags`: those that choose it instead."""
    from dit_train.config.fields import MISSING, accepted, default_of, type_ok
    from dit_train.config.schemas import every_key

    f, tp = next((f, tp) for k, f, tp in every_key() if k == key)
    value = OmegaConf.select(cfg, key, default=MISSING)
    value = default_of(f) if value is MISSING else value
    rule = f.metadata.get("rule")
    if not type_ok(tp, value) or (rule is not None and not rule.ok(value)):
        fix = f"pass {flags} to choose it" if flags else "this checkpoint cannot be sampled as saved"
        raise ValueError(f"{path}: the run's saved {key}={value!r} is not valid ({accepted(f, tp)}); {fix}")
    return value


def write_folder(images: torch.Tensor, labels: torch.Tensor, folder: str) -> list[str]:
    """One PNG per image: class{c:03d}_{i:04d}.png, i counting within the class."""
    os.makedirs(folder, exist_ok=True)
    counts: dict[int, int] = {}
    paths = []
    for image, label in zip(images, labels.tolist()):
        i = counts[label] = counts.get(label, -1) + 1
        paths.append(save_image(image, os.path.join(folder, f"class{label:03d}_{i:04d}.png")))
    return paths


@ctrl_c_exits("dit-sample: interrupted before every image was written; rerun the same command")
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="dit-sample", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("source", help="run folder (its newest checkpoint) or a step_N.dcp checkpoint folder")
    ap.add_argument("--classes", type=int, nargs="+", default=None,
                    help="class ids (default: the run's grid's, classes 0..9 or every class when fewer)")
    ap.add_argument("--per-class", type=int, default=None,
                    help="images per class, one grid row per class (default: the run's train.samples_per_class)")
    ap.add_argument("--steps", type=int, default=None, help="Euler steps (default: the run's train.sample_steps)")
    ap.add_argument("--cfg-scale", type=float, default=None, help="guidance scale, 1 = off (default: the run's)")
    ap.add_argument("--seed", type=int, default=None, help="noise seed (default: the run's seed)")
    ap.add_argument("--grid", default=None, help="grid PNG path (default samples.png unless --out-dir is given)")
    ap.add_argument("--out-dir", default=None, help="folder for one PNG per image")
    ap.add_argument("--batch-size", type=int, default=None,
                    help="images per model call (default: the run's grid size, which the run sampled in one call)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--vae", default=None, help="VAE folder of a latent run (default: the run's vae.path)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar (there is none when stderr is not "
                                                                  "a terminal)")
    args = ap.parse_args(argv)
    grid = args.grid or (None if args.out_dir else "samples.png")
    try:  # the output places first: a bad one is found now, not after loading and sampling
        if grid and os.path.isdir(grid):
            raise IsADirectoryError(errno.EISDIR, "--grid is a folder, expected a PNG path", grid)
        for folder in ([os.path.dirname(os.path.abspath(grid))] if grid else []) + [args.out_dir or ""]:
            if folder:
                check_folder_can_be_made(folder)
    except OSError as e:
        print_error(describe_os_error(e))
        return 1
    try:
        images, labels, _, meta = sample(args.source, args.classes, args.per_class, args.steps, args.cfg_scale,
                                         args.seed, args.batch_size, args.device, args.vae,
                                         progress=not args.no_progress)
    except (FileNotFoundError, KeyError, ValueError) as e:  # CheckpointError is a ValueError
        print_error(str(e))
        return 2
    written = []
    try:
        if grid:
            os.makedirs(os.path.dirname(os.path.abspath(grid)), exist_ok=True)
            written.append(save_grid(images, grid, nrow=meta["per_class"]))
        if args.out_dir:
            written.append(f"{len(write_folder(images, labels, args.out_dir))} PNGs in {args.out_dir}")
    except OSError as e:  # a full disk
        print_error(describe_os_error(e))
        return 1
    print(printable(f"{len(images)} samples from {meta['path']} (step {meta['step']}, {meta['steps']} Euler steps, "
                    f"CFG {meta['cfg_scale']:g}, seed {meta['seed']}): {', '.join(written)}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
