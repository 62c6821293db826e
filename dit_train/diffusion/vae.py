"""The VAE of latent runs: one place for the latent convention, z = (mean of the posterior - shift) * scale with
the VAE's own scaling_factor / shift_factor, used by dit-encode-latents to encode and by sampling, grids
and FD to decode. A diffusers AutoencoderKL from a local folder (no hub access)."""

from __future__ import annotations

import os

import torch

from dit_train.config.latents import not_a_vae, vae_scaling
from dit_train.diffusion.vae_shapes import check_vae_folder


def load_autoencoder(path: str, device):
    from dit_train.extras import installed, require

    require("diffusers", "latents", "the VAE of latent runs")
    from diffusers import AutoencoderKL

    problem = not_a_vae(path)  # a DINOv2 or DiT folder, a pipeline root: named, before anything is read as a VAE
    if problem:
        raise ValueError(f"VAE folder {path!r}: {problem}")
    if not os.path.isfile(os.path.join(path, "config.json")):
        what = "has no config.json" if os.path.isdir(path) else "does not exist"
        raise FileNotFoundError(f"VAE folder {path!r} {what}: expected a local diffusers AutoencoderKL folder "
                                f"(config.json and its weights), the one given to dit-encode-latents --vae")
    check_vae_folder(path)  # a config.json declaring a huge model is refused before diffusers allocates it
    # a local folder only: a path that is not one must not become a Hub download. Without accelerate, diffusers'
    # default low_cpu_mem_usage=True falls back to False after a 5-line warning to `pip install accelerate`
    return AutoencoderKL.from_pretrained(path, local_files_only=True, use_safetensors=True,
                                         low_cpu_mem_usage=installed("accelerate")).to(device).eval() \
        .requires_grad_(False)


class LatentCodec:
    def __init__(self, path: str, device, batch_size: int = 16):
        self.path, self.device, self.batch_size = path, torch.device(device), int(batch_size)
        self.vae = load_autoencoder(path, self.device)
        self.scale, self.shift = vae_scaling(path)
        self.channels = int(self.vae.config.in_channels)

    @torch.no_grad()
    def encode(self, images: torch.Tensor) -> torch.Tensor:
        """Images in [-1, 1] (grey ones repeated to the VAE's channels) -> latents as training sees them."""
        if images.shape[1] == 1 and self.channels == 3:
            images = images.repeat(1, 3, 1, 1)
        out = [(self.vae.encode(x.to(self.device)).latent_dist.mean - self.shift) * self.scale
               for x in images.split(self.batch_size)]
        return torch.cat(out)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents -> images in [-1, 1], float32, `batch_size` latents per VAE call."""
        return decode_latents(self.vae, latents, self.scale, self.shift, self.batch_size)


@torch.no_grad()
def decode_latents(vae, latents: torch.Tensor, scale: float, shift: float, batch_size: int = 16) -> torch.Tensor:
    """The inverse of the encoding convention, also used by the diffusers pipeline of an export."""
    device = next(vae.parameters()).device
    out = [vae.decode(z.to(device, torch.float32) / scale + shift).sample.float() for z in latents.split(batch_size)]
    return torch.cat(out).clamp(-1, 1)


def weights_digest(vae) -> str:
    """sha1 of a VAE module's tensors (names and fp32 bytes, in state-dict order): the same weights wherever they
    were loaded from. dit-export records it; DiTTrainPipeline compares a VAE passed to it."""
    import hashlib

    digest = hashlib.sha1()
    for name, tensor in vae.state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return digest.hexdigest()
