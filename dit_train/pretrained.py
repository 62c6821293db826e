"""The exported model folder that other code can load: `config.json` (the DiT's architecture keys, plus where the
weights came from) and `model.safetensors` (EMA weights under the DiT's parameter names) — the layout of
huggingface_hub's `save_pretrained`/`from_pretrained`, without needing huggingface_hub or diffusers to read it.

    model = DiT.from_pretrained("exported/")      # a local folder, or a Hub repo id when huggingface_hub is installed
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, fields

import torch

from .atomic_io import atomic_write_bytes
from .json_file import read_json

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def save_pretrained(state_dict: dict, config, folder: str, dtype: str = "fp32", provenance: dict | None = None,
                    class_name: str = "DiT") -> str:
    """Write a DiT's `state_dict` and its DiTConfig `config` to `folder` (no model is built: an export of a 15B run
    holds its weights once): the weights first, config.json last, each atomically, so a folder with a config.json
    is complete."""
    from safetensors.torch import save_file

    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not valid: choose one of {', '.join(DTYPES)}")
    os.makedirs(folder, exist_ok=True)
    tensors = {k: v.detach().to("cpu", DTYPES[dtype]).contiguous() for k, v in state_dict.items()}
    weights = os.path.join(folder, WEIGHTS_FILE)
    tmp = f"{weights}.tmp-{os.getpid()}"
    try:
        save_file(tensors, tmp, metadata={"format": "pt"})
        os.replace(tmp, weights)
    except Exception as e:  # safetensors reports a full disk as its own error, "... (os error 28)"
        code = re.search(r"os error (\d+)", str(e))
        if code is None or isinstance(e, OSError):
            raise
        raise OSError(int(code.group(1)), os.strerror(int(code.group(1))), weights) from None
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    document = {"_class_name": class_name, **asdict(config), "torch_dtype": str(DTYPES[dtype]).removeprefix("torch."),
                "dit_train": provenance or {}}
    atomic_write_bytes(json.dumps(document, indent=2, default=str).encode(), os.path.join(folder, CONFIG_FILE))
    return folder


def _local_folder(path: str) -> str:
    """`path` itself, or the Hub snapshot of the repo id `path` (huggingface_hub: the [latents] or [eval] extra)."""
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, CONFIG_FILE)):
            raise FileNotFoundError(f"{path!r} has no {CONFIG_FILE}: not a folder written by python -m "
                                    f"dit_train.export (an interrupted export writes config.json last)")
        return path
    from .extras import installed

    if os.path.exists(path) or not installed("huggingface_hub") or path.count("/") != 1:
        raise FileNotFoundError(f"{path!r} is not an exported model folder (config.json + {WEIGHTS_FILE})")
    from huggingface_hub import snapshot_download

    return snapshot_download(path, allow_patterns=[CONFIG_FILE, WEIGHTS_FILE])


def load_pretrained(cls, path: str, device="cpu"):
    """A `cls` (DiT) built from config.json with the weights of model.safetensors, in eval mode."""
    from safetensors.torch import load_file

    from .model import DiTConfig

    folder = _local_folder(path)
    config = read_json(os.path.join(folder, CONFIG_FILE), fix="export the model again")
    names = {f.name for f in fields(DiTConfig)}
    model = cls(DiTConfig(**{k: v for k, v in config.items() if k in names}))
    model.load_state_dict(load_file(os.path.join(folder, WEIGHTS_FILE)))
    return model.to(device).eval()
