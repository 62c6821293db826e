"""The exported model folder that other code can load. `dit-export` writes a diffusers pipeline folder:

    model_index.json                        the pipeline's parts (dit_train.diffusers_pipeline), written last
    transformer/config.json                 the DiT's architecture keys, plus where the weights came from
    transformer/diffusion_pytorch_model.safetensors   EMA weights under the DiT's parameter names
    scheduler/scheduler_config.json         FlowMatchEulerDiscreteScheduler (shift 1: our Euler grid)
    vae/                                    a latent run's AutoencoderKL (scaling/shift factors written explicitly)

`DiT.save_pretrained` writes the flat model folder (config.json + model.safetensors). Both load without needing
huggingface_hub or diffusers:

    model = DiT.from_pretrained("exported/")      # a local folder, or "hf://OWNER/NAME" with huggingface_hub installed
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, fields

import torch

from dit_train.dtypes import torch_dtypes
from dit_train.runs.atomic_io import atomic_save_tensors, atomic_write_bytes
from dit_train.runs.folder_kind import PIPELINE_FILE, TRANSFORMER, run_folder_hint
from dit_train.runs.json_file import read_json

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
DIFFUSERS_WEIGHTS_FILE = "diffusion_pytorch_model.safetensors"  # the name diffusers' ModelMixin loads
DIFFUSERS_CLASS = "DiTTrainTransformer2DModel"
DTYPES = torch_dtypes("bf16", "fp16", "fp32")  # what an exported file may hold
# the Euler grid of flow.euler_sample: no shift (the pipeline passes sigmas = linspace(1, 0, steps + 1)[:-1])
SCHEDULER_CONFIG = {"_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 1.0,
                    "use_dynamic_shifting": False}


def save_pretrained(state_dict: dict, config, folder: str, dtype: str = "fp32", provenance: dict | None = None,
                    class_name: str = "DiT", weights_file: str = WEIGHTS_FILE) -> str:
    """Write a DiT's `state_dict` and its DiTConfig `config` to `folder` (no model is built: an export of a 15B run
    holds its weights once): the weights first, config.json last, each atomically, so a folder with a config.json
    is complete."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not valid: choose one of {', '.join(DTYPES)}")
    os.makedirs(folder, exist_ok=True)
    tensors = {k: v.detach().to("cpu", DTYPES[dtype]).contiguous() for k, v in state_dict.items()}
    atomic_save_tensors(tensors, os.path.join(folder, weights_file), metadata={"format": "pt"})
    document = {"_class_name": class_name, **asdict(config), "torch_dtype": str(DTYPES[dtype]).removeprefix("torch."),
                "dit_train": provenance or {}}
    atomic_write_bytes(json.dumps(document, indent=2, default=str).encode(), os.path.join(folder, CONFIG_FILE))
    return folder


def save_export(state_dict: dict, config, folder: str, dtype: str = "fp32", provenance: dict | None = None,
                vae_path: str | None = None) -> str:
    """The pipeline folder of `dit-export` (module docstring); model_index.json last, so a folder
    with one is complete. vae/ first: the sha1 of its weights goes into the provenance's latents_vae."""
    if vae_path is not None:
        provenance = dict(provenance or {})
        provenance["latents_vae"] = {**provenance.get("latents_vae", {}),
                                     "weights_sha1": save_vae(vae_path, os.path.join(folder, "vae"))}
    save_pretrained(state_dict, config, os.path.join(folder, TRANSFORMER), dtype, provenance, DIFFUSERS_CLASS,
                    DIFFUSERS_WEIGHTS_FILE)
    os.makedirs(os.path.join(folder, "scheduler"), exist_ok=True)
    atomic_write_bytes(json.dumps(SCHEDULER_CONFIG, indent=2).encode(),
                       os.path.join(folder, "scheduler", "scheduler_config.json"))
    index = {"_class_name": "DiTTrainPipeline",
             TRANSFORMER: ["dit_train.diffusers_pipeline", DIFFUSERS_CLASS],
             "scheduler": ["diffusers", SCHEDULER_CONFIG["_class_name"]],
             "vae": ["diffusers", "AutoencoderKL"] if vae_path is not None else [None, None]}
    atomic_write_bytes(json.dumps(index, indent=2).encode(), os.path.join(folder, PIPELINE_FILE))
    return folder


def refuse_links_in_export(folder: str, with_vae: bool) -> None:
    """ConfigError (one line) when a path save_export writes inside `folder` is a symbolic link or reached through one
    (an existing OUT_DIR with `transformer -> /elsewhere` had /elsewhere/config.json overwritten), or is not a plain
    file (folder); checked before the checkpoint is read or anything is written."""
    from dit_train.runs.atomic_io import refuse_links_on_the_way

    parts = {TRANSFORMER: [CONFIG_FILE, DIFFUSERS_WEIGHTS_FILE], "scheduler": ["scheduler_config.json"],
             **({"vae": [CONFIG_FILE, DIFFUSERS_WEIGHTS_FILE]} if with_vae else {})}
    for part, files in parts.items():
        refuse_links_on_the_way(folder, os.path.join(folder, part), "dit-export", folder=True)
        for name in files:
            refuse_links_on_the_way(folder, os.path.join(folder, part, name), "dit-export")
    refuse_links_on_the_way(folder, os.path.join(folder, PIPELINE_FILE), "dit-export")


def save_vae(vae_path: str, folder: str) -> str:
    """Write a copy of the AutoencoderKL at `vae_path` with the scaling/shift factors that encoded the latents written
    explicitly; returns the sha1 of its weights (vae.weights_digest) (vae_scaling reads a missing one as 1 / 0, diffusers as its class default)."""
    from dit_train.runs.atomic_io import make_readable
    from dit_train.config.latents import vae_scaling
    from dit_train.diffusion.vae import load_autoencoder, weights_digest

    scale, shift = vae_scaling(vae_path)
    vae = load_autoencoder(vae_path, "cpu")
    vae.register_to_config(scaling_factor=scale, shift_factor=shift)
    vae.save_pretrained(folder)
    for name in os.listdir(folder):  # diffusers writes its safetensors 0600
        make_readable(os.path.join(folder, name))
    return weights_digest(vae)


HUB_PREFIX = "hf://"  # huggingface_hub's own spelling of a Hub repo (HfFileSystem)


def _local_folder(path: str) -> str:
    """The folder holding the DiT's config.json: `path` (a DiT.save_pretrained folder), its transformer/ (an export),
    or the same in the Hub snapshot of `hf://OWNER/NAME` (huggingface_hub: the [latents] or [eval] extra). Only that
    spelling downloads: "exported/my_dit" is also a valid repo id, and a local folder that is missing (a typo, another
    working directory) fetched whatever weights the owner of that Hub name put there."""
    if path.startswith(HUB_PREFIX):
        from dit_train.extras import installed

        repo = path[len(HUB_PREFIX):]
        if repo.count("/") != 1 or not installed("huggingface_hub"):
            raise FileNotFoundError(f"{path!r} is not valid: a Hugging Face Hub model is {HUB_PREFIX}OWNER/NAME, "
                                    f"loaded with huggingface_hub installed (the [latents] or [eval] extra)")
        from huggingface_hub import snapshot_download

        return _local_folder(snapshot_download(repo, allow_patterns=[CONFIG_FILE, WEIGHTS_FILE, PIPELINE_FILE,
                                                                     f"{TRANSFORMER}/*"]))
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, PIPELINE_FILE)):
            return os.path.join(path, TRANSFORMER)
        if not os.path.isfile(os.path.join(path, CONFIG_FILE)):
            raise FileNotFoundError(f"{path!r} has no {PIPELINE_FILE} or {CONFIG_FILE}: not a folder written by "
                                    f"dit-export (an interrupted export writes {PIPELINE_FILE} last)"
                                    f"{run_folder_hint(path)}")
        return path
    what = "no such folder" if not os.path.lexists(path) else "not a folder"
    raise FileNotFoundError(f"{path!r}: {what} (an exported model is a folder holding {PIPELINE_FILE} + "
                            f"{TRANSFORMER}/); a Hugging Face Hub repo loads only when named {HUB_PREFIX}OWNER/NAME")


def checked_architecture(folder: str):
    """(DiTConfig, its config.json, the weights file) of a local model folder, the config checked as data from
    elsewhere: types and ranges, then against the shapes in the weights file's header (model/stored_shapes.py), so
    a config.json declaring a huge model, or a huge image_size whose position table no weight pins down, is refused
    in one line before anything is built or allocated."""
    from dit_train.model.dit import DiTConfig
    from dit_train.model.stored_shapes import check_stored_shapes, safetensors_shapes

    file = os.path.join(folder, CONFIG_FILE)
    config = read_json(file, fix="export the model again")
    if not isinstance(config, dict):
        raise ValueError(f"{file!r} is not a model config (expected a JSON object of the DiT's architecture keys)")
    names = {f.name for f in fields(DiTConfig)}
    architecture = DiTConfig(**{k: v for k, v in config.items() if k in names})
    try:
        architecture.validate()
    except ValueError as e:
        raise ValueError(f"{file!r}: {e}") from None
    weights = os.path.join(folder, WEIGHTS_FILE)
    if not os.path.isfile(weights):  # the transformer/ folder of an export: diffusers' name
        weights = os.path.join(folder, DIFFUSERS_WEIGHTS_FILE)
    check_stored_shapes(architecture, safetensors_shapes(weights), file, weights)
    refuse_non_float_dtypes(weights)
    return architecture, file, weights


def refuse_non_float_dtypes(weights: str) -> None:
    """One line naming the first tensor of the safetensors file `weights` (its header: no data read) stored in a
    dtype other than an exported one (bf16/fp16/fp32): integer weights were cast to float and loaded silently."""
    from safetensors import safe_open

    valid = {"BF16", "F16", "F32"}
    with safe_open(weights, "pt") as f:
        for name in f.keys():
            dtype = f.get_slice(name).get_dtype()
            if dtype not in valid:
                raise ValueError(f"{weights!r}: tensor {name} has dtype {dtype}, not valid: an exported model's "
                                 f"weights are {', '.join(sorted(valid))}; export the model again")


def refuse_non_finite(tensors, where: str) -> None:
    """One line naming the first tensor of (name, tensor) pairs holding a NaN or an infinity (the model sampled NaN
    images). One aminmax per tensor (NaN propagates to it, an infinity is its min or max): one pass, no boolean
    copy of the weights (docs/sampling_export.md)."""
    for name, tensor in tensors:
        if tensor.numel() and not bool(torch.isfinite(torch.stack(torch.aminmax(tensor.float()
                                                                                  if tensor.dtype != torch.float32
                                                                                  else tensor))).all()):
            raise ValueError(f"{where}: tensor {name} holds a NaN or an infinity, not valid: an exported model's "
                             f"weights are finite; export a checkpoint from before the run diverged")


def load_pretrained(cls, path: str, device="cpu"):
    """A `cls` (DiT) built from config.json with the weights of model.safetensors, in eval mode."""
    from safetensors.torch import load_file

    architecture, _, weights = checked_architecture(_local_folder(path))
    with torch.device("meta"):  # shapes only, checked: the file's own tensors are assigned below
        model = cls(architecture)
    expected = model.state_dict()
    loaded = load_file(weights)
    refuse_non_finite(loaded.items(), repr(weights))
    state = {k: v.to(expected[k].dtype) for k, v in loaded.items()}
    model.load_state_dict(state, assign=True)  # of the model's dtype
    model.pos_embed = torch.empty(model.pos_embed.shape)  # not saved: computed
    model.reset_buffers()
    return model.to(device).eval()
