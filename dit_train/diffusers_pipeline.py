"""The exported model in diffusers (the [latents] extra): our DiT as a diffusers model and a small pipeline around it.

    from dit_train.diffusers_pipeline import DiTTrainPipeline
    pipe = DiTTrainPipeline.from_pretrained("OUT_DIR")   # a folder written by dit-export
    images = pipe(class_labels=[0, 3], num_inference_steps=50, guidance_scale=2.5).images

Not diffusers' DiTTransformer2DModel: its timestep features have other frequencies (downscale_freq_shift=1), so a
conversion would change the outputs, and it has no qk-norm, SwiGLU or text cross-attention. The pipeline is our Euler
sampler with classifier-free guidance (dit_train.diffusion.flow.euler_sample) written with diffusers'
FlowMatchEulerDiscreteScheduler: the same time grid (sigmas 1 -> 0 in equal steps, t = sigma, 1 = noise), the same
null class, and for latent runs the same decoding (vae.LatentCodec: z / scaling_factor + shift_factor). With
`generator=dit_train.seeds.generator("grid_noise", seed)` it gives the images of `dit-sample --seed
seed` for the same labels in one call (both draw the noise of all images at once; fp32 weights, while the sample
command runs under the run's train.precision autocast).

Loading reads local folders only and never runs code from them: the classes are this module's and diffusers'.
"""

from __future__ import annotations

import json
import os

import numpy as np
import torch

from dit_train.extras import require

require("diffusers", "latents", "loading an export with diffusers")

from diffusers import AutoencoderKL, DiffusionPipeline, FlowMatchEulerDiscreteScheduler  # noqa: E402
from diffusers.configuration_utils import ConfigMixin, register_to_config  # noqa: E402
from diffusers.models.modeling_utils import ModelMixin  # noqa: E402
from diffusers.pipelines.pipeline_utils import ImagePipelineOutput  # noqa: E402

from dit_train.evaluation.grids import to_uint8  # noqa: E402
from dit_train.model.dit import DiT, DiTConfig  # noqa: E402
from dit_train.runs.json_file import read_json  # noqa: E402


class DiTTrainTransformer2DModel(ModelMixin, DiT, ConfigMixin):
    """Our DiT with diffusers' config and weight loading (the `transformer` folder of an export): the same modules,
    parameter names and forward(x, t, y, ...) as dit_train.model.dit.DiT. ModelMixin comes first (its loading and saving
    win over DiT's), nn.Module before ConfigMixin (module attributes resolve as in any torch model)."""

    config_name = "config.json"

    @register_to_config
    def __init__(self, image_size: int = 32, in_channels: int = 1, patch_size: int = 2, hidden_size: int = 256,
                 depth: int = 6, num_heads: int = 4, mlp_ratio: float = 4.0, num_classes: int = 10,
                 class_dropout_prob: float = 0.1, qk_norm: bool = False, swiglu: bool = False, text_dim: int = 0,
                 torch_dtype: str | None = None, dit_train: dict | None = None):
        """torch_dtype and dit_train (the provenance export records) are kept in the config, unused by the model."""
        # ModelMixin.__init__'s one attribute (ModelMixin.__init__ itself would call DiT's without a config)
        self._gradient_checkpointing_func = None
        DiT.__init__(self, DiTConfig(image_size, in_channels, patch_size, hidden_size, depth, num_heads, mlp_ratio,
                                     num_classes, class_dropout_prob, qk_norm, swiglu, text_dim))

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, subfolder: str | None = None, **kwargs):
        """diffusers' loader (DiTTrainPipeline's loads the transformer through this too), after checking a local
        folder's config.json against its weights' header: diffusers builds the model before reading the weights
        (allocated without accelerate, its buffers allocated with it), so a config declaring a huge model or
        position table is refused first, in one line (model/pretrained.checked_architecture); integer or
        non-finite weights are refused in one line naming the tensor."""
        from dit_train.model.pretrained import checked_architecture

        from dit_train.model.pretrained import refuse_non_finite

        folder = os.path.join(str(pretrained_model_name_or_path), subfolder or "")
        if os.path.isdir(folder):
            checked_architecture(folder)  # the weights' dtypes too, from the header: diffusers casts integers
        model = super().from_pretrained(pretrained_model_name_or_path, *args, subfolder=subfolder, **kwargs)
        refuse_non_finite(model.state_dict().items(), repr(folder))
        return model

    def reset_parameters(self, seed: int | None = None) -> None:
        if not self.x_embedder.proj.weight.is_meta:  # diffusers with accelerate builds on meta, then loads
            super().reset_parameters(seed)

    @property
    def config(self):
        return self._internal_dict  # diffusers' frozen config: DiT reads the same keys as attributes

    @config.setter
    def config(self, value: DiTConfig) -> None:
        """DiT.__init__ stores its DiTConfig; here that is the registered config, which holds the same fields."""


# the (library, class) each component of an export may be: diffusers builds whatever class a pair names, from that
# component's folder, before reading any weight (["diffusers", "AutoencoderKL"] as the scheduler was built from a
# scheduler/config.json of any width, unchecked; ["diffusers", "DiffusionPipeline"] loaded a nested model_index.json)
COMPONENTS = {"transformer": {("dit_train.diffusers_pipeline", "DiTTrainTransformer2DModel")},
              "scheduler": {("diffusers", "FlowMatchEulerDiscreteScheduler")},
              "vae": {("diffusers", "AutoencoderKL"), (None, None)}}


def check_pipeline_index(folder: str) -> None:
    """One line unless `folder` is a local export whose model_index.json names this pipeline and, for each
    component, exactly a (library, class) pair an export writes (COMPONENTS)."""
    from dit_train.runs.folder_kind import PIPELINE_FILE, run_folder_hint

    path = os.path.join(folder, PIPELINE_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{folder!r} has no {PIPELINE_FILE}: not a local folder written by python -m "
                                f"dit_train.export (an interrupted export writes {PIPELINE_FILE} last)"
                                f"{run_folder_hint(folder)}")
    index = read_json(path, fix="export the model again")
    if not isinstance(index, dict) or index.get("_class_name") != "DiTTrainPipeline":
        raise ValueError(f"{path!r} does not describe a DiTTrainPipeline (its _class_name is "
                         f"{index.get('_class_name') if isinstance(index, dict) else index!r})")
    for name, entry in index.items():
        pair = tuple(entry) if isinstance(entry, list) and len(entry) == 2 else None
        if not name.startswith("_") and pair not in COMPONENTS.get(name, ()):
            valid = " or ".join(json.dumps(list(p)) for p in sorted(COMPONENTS.get(name, ()), key=str)) or "none"
            raise ValueError(f"{path!r}: component {name}={entry!r} is not valid: expected {valid} (an export's "
                             f"transformer, scheduler and vae)")


def check_scheduler_config(folder: str) -> None:
    """One line unless scheduler/scheduler_config.json holds what dit-export writes (SCHEDULER_CONFIG), other keys of
    FlowMatchEulerDiscreteScheduler at diffusers' defaults (a pipeline saved again by diffusers writes them all),
    checked before diffusers builds it: its timestep table has num_train_timesteps entries (10**8 took 2.3 GB and
    36 s), and the pipeline's Euler grid is the exporter's values only."""
    import inspect

    from dit_train.model.pretrained import SCHEDULER_CONFIG

    path = os.path.join(folder, "scheduler", "scheduler_config.json")
    if not os.path.lexists(path):
        return  # diffusers names the missing component
    config = read_json(path, fix="export the model again")
    if not isinstance(config, dict):
        raise ValueError(f"{path!r} is not a scheduler config (a JSON object); export the model again")
    defaults = {k: p.default for k, p in inspect.signature(FlowMatchEulerDiscreteScheduler.__init__).parameters.items()
                if p.default is not inspect.Parameter.empty}
    valid = {**defaults, **SCHEDULER_CONFIG}
    for key, value in config.items():
        if key.startswith("_") and key != "_class_name":  # diffusers' bookkeeping (_diffusers_version): unused
            continue
        want = valid.get(key, inspect.Parameter.empty)
        # the same JSON type and value (an int for a float is the same number; true is not 1, NaN equals nothing)
        same = value == want and (type(value) is type(want) or (type(value), type(want)) == (int, float))
        if want is inspect.Parameter.empty or not same:
            raise ValueError(f"{path!r}: {key}={value!r} is not valid: an export's scheduler is "
                             f"{json.dumps(SCHEDULER_CONFIG)} (other FlowMatchEulerDiscreteScheduler keys at "
                             f"diffusers' defaults); export the model again")


def check_vae_matches_run(folder: str, vae) -> None:
    """One line unless the VAE this load would decode with is the run's: a latent run's export records the VAE that
    made its latents (transformer/config.json dit_train.latents_vae) and names it in model_index.json; `vae`, the
    one passed to from_pretrained (None: the folder's vae/), must have its factors and weights (sha1); an image
    run takes none."""
    from dit_train.diffusion.vae import weights_digest

    index = read_json(os.path.join(folder, "model_index.json"), fix="export the model again")
    config = read_json(os.path.join(folder, "transformer", "config.json"), fix="export the model again")
    provenance = config.get("dit_train") if isinstance(config, dict) else None
    provenance = provenance if isinstance(provenance, dict) else {}
    data = ((provenance.get("run_config") or {}).get("data") or {}).get("name")
    record = provenance.get("latents_vae")
    if data is None and record is None:
        return  # a folder of save_export without a run (no provenance): nothing recorded to hold it to
    if data != "latents" and record is None:
        if vae is not None:
            raise ValueError(f"vae={type(vae).__name__} is not valid for {folder!r}: its run trained on images "
                             f"(data={data}); only a latent run's pipeline decodes with a VAE (pass none)")
        return
    entry = index.get("vae", "missing")
    if entry != ["diffusers", "AutoencoderKL"] or not isinstance(record, dict):
        raise ValueError(f"{folder!r}: its latent run needs the VAE that made its latents, but model_index.json's vae "
                         f"is {json.dumps(entry)} and the record of it is {json.dumps(record)}: expected "
                         f"[\"diffusers\", \"AutoencoderKL\"] and a dit_train.latents_vae; export the run again")
    if vae is None:
        return  # the folder's own vae/, written from the checked VAE by the export
    factors = (float(vae.config.scaling_factor or 1.0), float(vae.config.shift_factor or 0.0))
    then = (float(record.get("scaling_factor", 1.0)), float(record.get("shift_factor") or 0.0))
    said = f"the VAE that made the latents ({record.get('vae', '?')}: factors {then}"
    if factors != then:
        raise ValueError(f"vae with scaling/shift factors {factors} is not valid for {folder!r}: expected {said}), "
                         f"or pass no vae to use the folder's vae/")
    if record.get("weights_sha1") and weights_digest(vae) != record["weights_sha1"]:
        raise ValueError(f"vae with other weights (sha1 {weights_digest(vae)}) is not valid for {folder!r}: "
                         f"expected {said}, sha1 {record['weights_sha1']}), or pass no vae to use the folder's vae/")


class DiTTrainPipeline(DiffusionPipeline):
    """Class-conditional (or unconditional) sampling of an exported DiT: `transformer` + `scheduler` (+ `vae` for a
    latent run)."""

    model_cpu_offload_seq = "transformer->vae"
    _optional_components = ["vae"]

    def __init__(self, transformer: DiTTrainTransformer2DModel, scheduler: FlowMatchEulerDiscreteScheduler,
                 vae: AutoencoderKL | None = None):
        super().__init__()
        self.register_modules(transformer=transformer, scheduler=scheduler, vae=vae)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, **kwargs):
        """diffusers' loader on a local export folder, without remote code: model_index.json is checked first, so
        the components come from this module and diffusers only (diffusers would import any module it names) and a
        .py file in the folder is never imported. Its vae/ is checked against its weights' header first, as the
        transformer is (diffusers builds both before reading any weight)."""
        from dit_train.diffusion.vae_shapes import check_vae_folder

        check_pipeline_index(str(pretrained_model_name_or_path))
        check_scheduler_config(str(pretrained_model_name_or_path))
        vae = os.path.join(str(pretrained_model_name_or_path), "vae")
        if os.path.isdir(vae):  # first: a crafted vae/ config is refused before anything else is read of it
            check_vae_folder(vae)
        check_vae_matches_run(str(pretrained_model_name_or_path), kwargs.get("vae"))
        kwargs.update(trust_remote_code=False, local_files_only=True, custom_pipeline=None)
        return super().from_pretrained(pretrained_model_name_or_path, **kwargs)

    def _labels(self, class_labels, batch_size: int | None) -> torch.Tensor:
        num_classes = int(self.transformer.config.num_classes)
        if num_classes == 0:  # unconditional: class_labels only says how many images
            n = batch_size or (len(class_labels) if class_labels is not None else 1)
            return torch.zeros(n, dtype=torch.long)
        if class_labels is None:
            raise ValueError(f"class_labels is required: this model has classes 0..{num_classes - 1}")
        labels = torch.as_tensor(class_labels if not isinstance(class_labels, int) else [class_labels]).long()
        if labels.dim() != 1 or len(labels) == 0 or not ((labels >= 0) & (labels < num_classes)).all():
            raise ValueError(f"class_labels={class_labels!r} is not valid: a non-empty list of class ids in "
                             f"0..{num_classes - 1}")
        return labels

    @torch.no_grad()
    def __call__(self, class_labels=None, num_inference_steps: int = 50, guidance_scale: float = 1.0,
                 generator: torch.Generator | None = None, batch_size: int | None = None, output_type: str = "pil",
                 return_dict: bool = True):
        """Images for `class_labels` (for an unconditional model: `batch_size` images). guidance_scale 1 = no
        guidance; output_type "pil", "np" (HWC in [0, 1]) or "pt" (CHW in [0, 1])."""
        if num_inference_steps < 1 or guidance_scale < 0:
            raise ValueError(f"num_inference_steps={num_inference_steps} / guidance_scale={guidance_scale} is not "
                             f"valid: expected steps >= 1, scale >= 0")
        if output_type not in ("pil", "np", "pt"):
            raise ValueError(f"output_type={output_type!r} is not valid: choose pil, np or pt")
        model, device = self.transformer, self._execution_device
        cfg = model.config
        if int(cfg.text_dim):
            raise ValueError(f"text_dim={cfg.text_dim}: a text-conditioned model needs caption embeddings, which this "
                             f"pipeline does not take")
        labels = self._labels(class_labels, batch_size).to(device)
        conditional = int(cfg.num_classes) > 0
        shape = (labels.shape[0], int(cfg.in_channels), int(cfg.image_size), int(cfg.image_size))
        x = torch.randn(shape, generator=generator, device=device)
        # our grid: t = 1, 1 - 1/N, ..., 1/N, then 0 (the scheduler appends the terminal sigma)
        self.scheduler.set_timesteps(sigmas=np.linspace(1.0, 0.0, num_inference_steps + 1)[:-1], device=device)
        guided = conditional and guidance_scale != 1.0
        n = x.shape[0]
        drop = torch.arange(2 * n, device=device) >= n  # second half: the null class
        for i, timestep in enumerate(self.progress_bar(self.scheduler.timesteps)):
            t = self.scheduler.sigmas[i].to(device).expand(n)
            if guided:
                v_c, v_u = model(torch.cat([x, x]), torch.cat([t, t]), y=torch.cat([labels, labels]),
                                 drop_mask=drop).chunk(2)
                v = v_u + guidance_scale * (v_c - v_u)
            else:
                v = model(x, t, y=labels if conditional else None)
            x = self.scheduler.step(v.to(x.dtype), timestep, x).prev_sample
        images = self._decode(x)
        if output_type == "pt":
            images = (images + 1) / 2
        elif output_type == "np":
            images = ((images + 1) / 2).permute(0, 2, 3, 1).cpu().numpy()
        else:
            from PIL import Image

            images = [Image.fromarray(to_uint8(image)) for image in images]  # the PNG pixels of dit_train.sample
        self.maybe_free_model_hooks()
        return ImagePipelineOutput(images=images) if return_dict else (images,)

    def _decode(self, x: torch.Tensor) -> torch.Tensor:
        """Images in [-1, 1]: the latents decoded by the VAE as vae.LatentCodec.decode does, or x itself."""
        if self.vae is None:
            return x.float().clamp(-1, 1)
        from dit_train.diffusion.vae import decode_latents

        scale = self.vae.config.scaling_factor
        shift = self.vae.config.shift_factor
        return decode_latents(self.vae, x, float(scale or 1.0), float(shift or 0.0))
