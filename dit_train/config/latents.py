"""What a latent run (data=latents) needs before anything is built: the latent shards, and the VAE that made them
to decode samples for grids and FD, with the same scaling as at encoding time. Each missing piece is one line
that says exactly what to pass and how to make it."""

from __future__ import annotations

import logging
import math
import os

from dit_train.config.errors import ConfigError, invalid
from dit_train.parallel.launch_rank import launch_rank
from dit_train.runs.json_file import DamagedJSONFile, read_json
from dit_train.runs.file_fingerprint import file_fingerprint

LATENTS_INFO = "latents_info.json"  # written by dit-encode-latents at the root of the shards
VAE_RECORD = ("vae", "vae_files", "scaling_factor", "shift_factor")  # what latents_info.json says of the VAE

log = logging.getLogger(__name__)


def encode_hint() -> str:
    # no --image-size: the images' own size is the default, and the run takes its shapes from the shards
    return ("make them with `dit-encode-latents --vae /path/to/vae --images /data/images --out /data/latents` "
            "(torchrun for several GPUs), then pass data.root=/data/latents vae.path=/path/to/vae; to measure "
            "throughput without data: data=synthetic")


def vae_scaling(vae_path: str) -> tuple[float, float]:
    """(scaling_factor, shift_factor) of a diffusers AutoencoderKL folder, as dit-encode-latents applies them. A
    damaged or hand-edited config.json (a VAE folder from elsewhere) is one line naming it (DamagedJSONFile)."""
    path = os.path.join(vae_path, "config.json")
    config = read_json(path, fix="use the VAE folder the latents were made with")
    try:
        scale, shift = config.get("scaling_factor"), config.get("shift_factor")
        scale, shift = float(1.0 if scale is None else scale), float(0.0 if shift is None else shift)
    except (AttributeError, TypeError, ValueError):
        raise DamagedJSONFile(f"{path} is not an AutoencoderKL config with numeric scaling_factor and "
                              f"shift_factor") from None
    # JSON files from elsewhere may hold NaN / Infinity (Python's json reads them): NaN latents were written, exit 0
    if not (math.isfinite(scale) and scale > 0 and math.isfinite(shift)):
        raise DamagedJSONFile(f"{path}: scaling_factor={config.get('scaling_factor')!r} / shift_factor="
                              f"{config.get('shift_factor')!r} is not valid: expected a finite scaling_factor > 0 "
                              f"and a finite shift_factor; use the VAE folder the latents were made with")
    return scale, shift


def read_latents_info(root: str) -> dict:
    path = os.path.join(root, LATENTS_INFO)
    if not os.path.isfile(path):
        return {}
    try:
        info = read_json(path, fix="encode the latents again into a new folder with dit-encode-latents")
    except DamagedJSONFile as e:  # a ConfigError: the check before Hydra says it in one line
        raise ConfigError(str(e)) from None
    if not isinstance(info, dict):
        raise ConfigError(f"{path} holds a JSON {type(info).__name__}, expected the object dit-encode-latents writes")
    return info


def check_latent_run(model: dict, data: dict, vae: dict, needs_decoding: bool) -> None:
    root = data["root"]
    if root in (None, "???", ""):
        raise ConfigError(f"data.root is not set: this run trains on VAE latents (data=latents, which the presets "
                          f"dit_1b3 to dit_15b choose), read from a folder of shards; {encode_hint()}")
    if not os.path.isdir(root):
        raise invalid("data.root", root, f"not a folder of latent shards; {encode_hint()}")
    info = read_latents_info(root)
    if info.get("complete") is False:  # written before the first shard, completed after the last
        raise invalid("data.root", root, "its encoding stopped before every shard was written: rerun the same "
                                         "dit-encode-latents command to finish it")
    path = vae["path"]
    if path is None:
        if needs_decoding:
            raise ConfigError("vae.path is not set: a latent run decodes its samples (train.sample_every, "
                              "eval.every_n_steps) with the VAE that made the latents; pass vae.path=/path/to/vae "
                              "(the folder given to dit-encode-latents --vae), or set train.sample_every=0 "
                              "eval.every_n_steps=0")
        return
    problem = not_a_vae(path)
    if problem:
        raise invalid("vae.path", path, problem)
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise invalid("vae.path", path, "expected a diffusers AutoencoderKL folder (config.json + weights)")
    if "scaling_factor" in info:
        differs = vae_mismatch(path, root, info)
        if differs:
            raise invalid("vae.path", path, differs)
    channels = read_json(os.path.join(path, "config.json"), fix="use the VAE folder the latents were made with")
    channels = channels.get("latent_channels") if isinstance(channels, dict) else None
    # latents made elsewhere (no latents_info.json to hold the VAE to): a VAE of other channels decoded nothing but
    # a shape error at the first sample grid, after training steps had been paid for
    if isinstance(channels, int) and data.get("channels") not in (None, "???") and channels != int(data["channels"]):
        raise invalid("vae.path", path, f"its latent_channels={channels} differs from the {data['channels']} channels "
                                        f"of the latents in {root} (data.channels): pass the VAE that made them")


def vae_files(path: str) -> dict:
    """Fingerprints of a VAE folder's config and weights (dit-encode-latents records them in latents_info.json):
    the same VAE wherever its folder lies."""
    out = {}
    for name in sorted(os.listdir(path)):
        file = os.path.join(path, name)
        if (name == "config.json" or name.endswith((".safetensors", ".bin"))) and os.path.isfile(file):
            out[name] = file_fingerprint(file)
    return out


def not_a_vae(path: str) -> str | None:
    """What the folder `path` is when it is not a diffusers AutoencoderKL, from its config.json's `_class_name` (a
    transformers model's `architectures`), or None: a DINOv2 folder was refused for its scaling factors, a DiT
    transformer/ for its block counts, a pipeline root for its missing config.json, with no word of what they are.
    Every place that opens a VAE folder asks this first. None also where the folder or its config.json is missing
    or unreadable: the callers' own messages say so."""
    pipeline_vae = os.path.join(path, "vae")
    if os.path.isfile(os.path.join(pipeline_vae, "config.json")):  # a pipeline root (dit-export's, diffusers')
        return f"it is a diffusers pipeline folder, not its VAE: pass {pipeline_vae}"
    try:
        config = read_json(os.path.join(path, "config.json"), fix="")
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    name = config.get("_class_name")
    if name is None and (config.get("architectures") or config.get("model_type")):
        model = (config.get("architectures") or [config.get("model_type")])[0]
        return f"its config.json describes a transformers {model} model, not a diffusers AutoencoderKL"
    if name is not None and name != "AutoencoderKL":
        return f"its config.json describes a {name} (_class_name), not a diffusers AutoencoderKL"
    return None


def vae_record(info: dict) -> dict | None:
    """What latents_info.json says of the VAE that made the latents (its folder, its files' fingerprints, its
    factors), or None where it records none: a run keeps this in its checkpoints (TrainState.latents_vae) to check
    the VAE it is decoded with once the latents folder has moved."""
    return {k: info[k] for k in VAE_RECORD if k in info} if "scaling_factor" in info else None


def latents_vae(data_cfg) -> dict | None:
    """A latent run's VAE record from its data.root (None for image runs, or without latents_info.json)."""
    if data_cfg.get("name") != "latents" or not data_cfg.get("root"):
        return None
    return vae_record(read_latents_info(str(data_cfg["root"])))


def vae_mismatch(path: str, root: str, info: dict, where: str | None = None) -> str | None:
    """Why the VAE folder `path` is not the one that made the latents in `root` (`info`: their latents_info.json,
    or the record a checkpoint kept of it, named `where`), or None: its scaling/shift factors, then the
    fingerprints of the weight files both hold. A VAE of the same factors (two SD VAEs, a fine-tune) decoded a
    run's grids, FD and dit-sample images unasked, although latents_info.json recorded which one made them."""
    said = f" as {where} recorded" if where else ""  # the latents' own latents_info.json needs no naming
    try:
        now = vae_scaling(path)
        then = (float(info["scaling_factor"]), float(info.get("shift_factor") or 0.0))
    except (TypeError, ValueError) as e:  # a damaged config.json, or latents_info.json edited by hand
        return str(e) if isinstance(e, DamagedJSONFile) else \
            f"{where or os.path.join(root, LATENTS_INFO)} holds factors that are not numbers ({e})"
    if not all(math.isclose(a, b, rel_tol=1e-6) for a, b in zip(now, then)):
        return (f"its scaling/shift factors {now} differ from those the latents in {root} were made with {then} "
                f"({info.get('vae', '?')}{said})")
    recorded = info.get("vae_files")
    if isinstance(recorded, dict):  # older records have none; a file of another name (converted weights) passes
        files = vae_files(path)
        for name in sorted((set(recorded) & set(files)) - {"config.json"}):
            if recorded[name] != files[name]:
                return (f"its {name} is not the one the latents in {root} were made with ({info.get('vae', '?')}; "
                        f"size-sha1 {files[name]}, recorded {recorded[name]}{said}): pass that VAE folder")
    return None


def check_decoding_vae(path: str, root, what: str, recorded: dict | None = None, checkpoint: str = "") -> None:
    """dit-sample / dit-export / dit-fd of a latent run, before any weights are read: `path` (named `what`: --vae,
    or the run's vae.path) is an AutoencoderKL folder and the VAE that made the run's latents, as their
    latents_info.json in data.root records it, else as the `checkpoint`'s train state `recorded` it (the latents
    folder moved, a run copied to another machine: the wrong VAE was accepted silently). A checkpoint written
    before it recorded the VAE, with no latents_info.json beside it: one warning line. The trainer checks vae.path
    the same way (check_latent_run)."""
    problem = not_a_vae(path)
    if problem:
        raise invalid(what, path, problem)
    if not os.path.isfile(os.path.join(path, "config.json")):  # missing: LatentCodec says so in one line
        return
    info = read_latents_info(str(root)) if root and os.path.isfile(os.path.join(str(root), LATENTS_INFO)) else {}
    if "scaling_factor" in info:
        differs = vae_mismatch(path, str(root), info)
    elif isinstance(recorded, dict) and "scaling_factor" in recorded:
        differs = vae_mismatch(path, str(root), recorded, where=f"checkpoint {checkpoint}")
    else:  # the same on every rank (dit-fd under torchrun): said once
        if launch_rank() == 0:
            log.warning(f"warning: {what} {path} cannot be checked against the VAE that made the latents: "
                        f"{os.path.join(str(root), LATENTS_INFO)} is absent and checkpoint {checkpoint or '?'} "
                        f"records no VAE (written before checkpoints did); make sure it is that VAE")
        return
    if differs:
        raise invalid(what, path, differs)
