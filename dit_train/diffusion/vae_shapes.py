"""A VAE folder's config.json (`vae.path`, an export's `vae/`) checked against the tensors stored beside it, before
diffusers builds the AutoencoderKL it declares: without accelerate, diffusers allocates and initialises the whole
model before reading any weight, so a crafted block_out_channels, layers_per_block or latent_channels asked for
terabytes. The safetensors header is the truth (no tensor data is read; safetensors refuses a header over 100 MB):
- the declared block counts and layers per block are compared with the blocks the weights hold first, so the
  build on meta below makes no more modules than the weights name;
- then every parameter of that meta build must have its stored shape, and no stored tensor may be left over.
Only `diffusion_pytorch_model.safetensors` is accepted: a `.bin` is a pickle, never loaded.
"""

from __future__ import annotations

import os
import re
from typing import Mapping, Sequence

import torch

WEIGHTS_FILE = "diffusion_pytorch_model.safetensors"
WIDTHS = ("in_channels", "out_channels", "latent_channels", "block_out_channels")  # named in a shape mismatch
DEPRECATED_ATTENTION = {"query": "to_q", "key": "to_k", "value": "to_v", "proj_attn": "to_out.0"}  # diffusers renames


def check_vae_folder(folder: str) -> None:
    """ValueError (one line naming the folder) unless `folder`'s config.json describes exactly the AutoencoderKL
    whose tensors its safetensors file stores."""
    from dit_train.config.latents import not_a_vae, vae_scaling
    from dit_train.model.stored_shapes import safetensors_shapes
    from dit_train.runs.json_file import read_json

    problem = not_a_vae(folder)  # what the folder is, before its weights are judged as a VAE's
    if problem:
        raise ValueError(f"VAE folder {folder!r}: {problem}")
    weights = os.path.join(folder, WEIGHTS_FILE)
    if not os.path.isfile(weights):
        found = sorted(f for f in os.listdir(folder) if f.endswith((".bin", ".safetensors")))
        raise ValueError(f"VAE folder {folder!r} has no {WEIGHTS_FILE} (it holds {found or 'no weights'}): only "
                         f"safetensors weights are read, a .bin is a pickle and is never loaded; save the VAE with "
                         f"save_pretrained(safe_serialization=True)")
    config = read_json(os.path.join(folder, "config.json"), fix="the VAE folder is damaged")
    vae_scaling(folder)  # a NaN or non-positive scaling factor decodes to NaN images: refused here too
    try:
        stored = safetensors_shapes(weights)
    except Exception as e:  # safetensors' own errors (a header too large, truncated) are not one class
        raise ValueError(f"VAE folder {folder!r}: {weights} is not a readable safetensors file ({e})") from None
    detail = vae_mismatch(config, {_current_name(n): s for n, s in stored.items()})
    if detail:
        raise ValueError(f"VAE folder {folder!r}: its config.json does not describe the weights in {WEIGHTS_FILE} "
                         f"({detail}); refusing it before anything is allocated")


def vae_mismatch(config, stored: Mapping[str, Sequence[int]]) -> str | None:
    """What differs between the AutoencoderKL `config` (a dict) declares and the `stored` tensor shapes, or None."""
    from diffusers import AutoencoderKL

    from dit_train.model.stored_shapes import describe_shape

    if not isinstance(config, dict):
        return f"the config is {type(config).__name__}, not a JSON object"
    down = _count(stored, r"encoder\.down_blocks\.(\d+)\.")
    up = _count(stored, r"decoder\.up_blocks\.(\d+)\.")
    layers = _count(stored, r"encoder\.down_blocks\.0\.resnets\.(\d+)\.")
    declared = {key: config.get(key, default) for key, default in
                (("block_out_channels", [64]), ("down_block_types", ["DownEncoderBlock2D"]),
                 ("up_block_types", ["UpDecoderBlock2D"]), ("layers_per_block", 1))}
    for key in ("block_out_channels", "down_block_types", "up_block_types"):
        holds = up if key == "up_block_types" else down
        if not isinstance(declared[key], list) or len(declared[key]) != holds:
            return f"{key}={_short(declared[key])}, but the weights hold {holds} blocks"
    if type(declared["layers_per_block"]) is not int or declared["layers_per_block"] != layers:
        return f"layers_per_block={_short(declared['layers_per_block'])}, but the weights hold {layers} per block"
    try:
        with torch.device("meta"):  # shapes only: the module counts are now those of the stored weights
            model = AutoencoderKL.from_config(config)
    except Exception as e:  # any value diffusers or torch cannot build with (a string, a negative width)
        return f"it cannot be built: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    for name in sorted(expected.keys() | stored.keys()):
        want, have = expected.get(name), tuple(stored[name]) if name in stored else None
        if want != have:
            widths = ", ".join(f"{key}={_short(config.get(key))}" for key in WIDTHS if key in config)
            return (f"it declares {widths}; {name}: the config makes {describe_shape(want)}, the weights hold "
                    f"{describe_shape(have)}")
    return None


def _count(stored, pattern: str) -> int:
    regex = re.compile(pattern)
    return len({m.group(1) for name in stored if (m := regex.match(name))})


def _current_name(name: str) -> str:
    """A VAE saved by an old diffusers names its attention tensors query/key/value/proj_attn; diffusers renames them
    on load, so they are compared under today's names."""
    if ".attentions." not in name:
        return name
    head, _, leaf = name.rpartition(".")
    head, _, part = head.rpartition(".")
    return f"{head}.{DEPRECATED_ATTENTION.get(part, part)}.{leaf}"


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:40]}... ({len(value) if isinstance(value, list) else '?'} items)"
