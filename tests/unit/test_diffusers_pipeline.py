"""An export loads with diffusers' own loaders (DiTTrainPipeline / DiTTrainTransformer2DModel.from_pretrained) and
the pipeline gives the images of `dit-sample`: the same time grid, guidance, null class, noise and,
for latent runs, VAE decoding. Exported files are readable like any other output (the umask's mode, not 0600)."""

import json
import os
import stat

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from conftest import compose, needs_fashion
from dit_train import seeds
from dit_train.model.dit import DiT, DiTConfig
from dit_train.model.pretrained import save_export

diffusers = pytest.importorskip("diffusers")
from dit_train.diffusers_pipeline import DiTTrainPipeline, DiTTrainTransformer2DModel  # noqa: E402


def random_dit(**kw) -> DiT:
    torch.manual_seed(0)
    model = DiT(DiTConfig(**{"image_size": 8, "in_channels": 1, "patch_size": 2, "hidden_size": 32, "depth": 1,
                             "num_heads": 2, "num_classes": 10, **kw})).eval()
    with torch.no_grad():
        for p in model.parameters():  # non-zero everywhere (adaLN-Zero starts as the identity)
            p.normal_(0, 0.2)
    return model


def tiny_vae(folder, shift_factor):
    from diffusers import AutoencoderKL

    torch.manual_seed(1)
    vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 16),
                        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                        layers_per_block=1, norm_num_groups=4, sample_size=16, scaling_factor=0.7,
                        shift_factor=shift_factor)
    vae.save_pretrained(folder)
    return str(folder)


@needs_fashion
def test_exported_run_samples_in_diffusers_like_the_sample_command(tmp_path):
    from dit_train.export import main as export_main
    from dit_train.evaluation.grids import to_uint8
    from dit_train.sample import sample
    from dit_train.trainer.loop import run

    folder = tmp_path / "run"
    run(compose([f"run_dir={folder}", "model.hidden_size=32", "model.depth=2", "model.num_heads=2",
                 "model.patch_size=8", "train.steps=3", "train.batch_size=8", "train.val_every=0",
                 "train.sample_every=0", "train.progress=false", "train.ema_decay=0.5", "optimizer.lr=1e-2"]))
    assert export_main([str(folder), str(tmp_path / "out")]) == 0
    pipe = DiTTrainPipeline.from_pretrained(str(tmp_path / "out"))
    assert isinstance(pipe.transformer, DiTTrainTransformer2DModel) and pipe.vae is None
    assert isinstance(pipe.scheduler, diffusers.FlowMatchEulerDiscreteScheduler)
    ours, _, _, _ = sample(str(folder), classes=[0, 3, 7], per_class=1, steps=4, cfg_scale=2.5, seed=5)
    out = pipe(class_labels=[0, 3, 7], num_inference_steps=4, guidance_scale=2.5,
               generator=seeds.generator("grid_noise", 5), output_type="pt").images
    torch.testing.assert_close(out, (ours + 1) / 2, rtol=0, atol=1e-6)
    pil = pipe(class_labels=[0, 3, 7], num_inference_steps=4, guidance_scale=2.5,
               generator=seeds.generator("grid_noise", 5)).images
    assert all(np.abs(to_uint8(a).astype(int) - np.asarray(b).astype(int)).max() <= 1
               for a, b in zip(ours, pil))  # the PNG pixels, up to rounding at float tolerance


@pytest.mark.parametrize("cfg_scale", [1.0, 2.5])
def test_pipeline_equals_our_sampler_and_its_time_grid(tmp_path, cfg_scale):
    from dit_train.diffusion.sampler import make_sampler

    model = random_dit(qk_norm=True, swiglu=True)
    save_export(model.state_dict(), model.config, str(tmp_path / "out"))
    pipe = DiTTrainPipeline.from_pretrained(str(tmp_path / "out"))
    labels = torch.tensor([0, 4, 9, 9])
    steps = 5
    out = pipe(class_labels=labels.tolist(), num_inference_steps=steps, guidance_scale=cfg_scale,
               generator=torch.Generator().manual_seed(3), output_type="pt").images
    assert torch.equal(pipe.scheduler.sigmas, torch.linspace(1, 0, steps + 1))  # t = 1 (noise) -> 0, no shift
    sampler = make_sampler(model, OmegaConf.create({"in_channels": 1, "image_size": 8, "num_classes": 10}), "cpu",
                           steps, cfg_scale)
    torch.testing.assert_close(out, (sampler(labels, torch.Generator().manual_seed(3)) + 1) / 2, rtol=0, atol=1e-6)
    guided = pipe(class_labels=labels.tolist(), num_inference_steps=steps, guidance_scale=cfg_scale + 1,
                  generator=torch.Generator().manual_seed(3), output_type="pt").images
    assert (guided - out).abs().max() > 1e-3  # the comparison above can tell guidance scales apart


def test_latent_export_decodes_with_the_runs_vae_and_shift(tmp_path):
    from dit_train.diffusion.sampler import make_sampler
    from dit_train.diffusion.vae import LatentCodec

    vae = tiny_vae(tmp_path / "vae", shift_factor=0.3)
    model = random_dit(in_channels=4)
    save_export(model.state_dict(), model.config, str(tmp_path / "out"), vae_path=vae)
    pipe = DiTTrainPipeline.from_pretrained(str(tmp_path / "out"))
    assert (pipe.vae.config.scaling_factor, pipe.vae.config.shift_factor) == (0.7, 0.3)
    labels = torch.tensor([1, 2])
    out = pipe(class_labels=labels.tolist(), num_inference_steps=3, guidance_scale=2.5,
               generator=torch.Generator().manual_seed(0), output_type="pt").images
    sampler = make_sampler(model, OmegaConf.create({"in_channels": 4, "image_size": 8, "num_classes": 10}),
                           "cpu", 3, 2.5, decode=LatentCodec(vae, "cpu").decode)
    reference = sampler(labels, torch.Generator().manual_seed(0))
    assert out.shape == (2, 3, 16, 16)
    torch.testing.assert_close(out, (reference + 1) / 2, rtol=0, atol=1e-4)  # float noise of the VAE


def test_the_transformer_loads_alone_and_nothing_in_the_folder_runs(tmp_path):
    model = random_dit(text_dim=12)
    save_export(model.state_dict(), model.config, str(tmp_path / "out"))
    loaded = DiTTrainTransformer2DModel.from_pretrained(str(tmp_path / "out"), subfolder="transformer")
    x, t, ctx = torch.randn(2, 1, 8, 8), torch.rand(2), torch.randn(2, 5, 12)
    with torch.no_grad():
        assert torch.equal(loaded(x, t, y=torch.tensor([1, 10]), context=ctx),
                           model(x, t, y=torch.tensor([1, 10]), context=ctx))
    # a folder that names code of its own (diffusers would import evil.py with trust_remote_code): refused first
    marker = tmp_path / "ran"
    (tmp_path / "out" / "evil.py").write_text(f"open({str(marker)!r}, 'w').close()\nclass Evil: pass\n")
    index = json.loads((tmp_path / "out" / "model_index.json").read_text())
    (tmp_path / "out" / "model_index.json").write_text(json.dumps({**index, "_class_name": ["evil", "Evil"]}))
    with pytest.raises(ValueError, match="does not describe a DiTTrainPipeline"):
        DiTTrainPipeline.from_pretrained(str(tmp_path / "out"))
    # nor does a component name a module of its own (diffusers imports whatever module model_index.json names)
    (tmp_path / "out" / "transformer" / "evil.py").write_text((tmp_path / "out" / "evil.py").read_text())
    for entry in (["evil", "Evil"], ["antigravity", "X"]):
        (tmp_path / "out" / "model_index.json").write_text(json.dumps({**index, "transformer": entry}))
        with pytest.raises(ValueError, match=f"component transformer=.*{entry[0]}.* is not valid") as e:
            DiTTrainPipeline.from_pretrained(str(tmp_path / "out"))
        assert "\n" not in str(e.value)
    assert not marker.exists()
    (tmp_path / "out" / "model_index.json").write_bytes(b'{"_class_name": "DiT')  # torn
    with pytest.raises(ValueError, match=r"model_index.json is not valid JSON \(.*\): the file is damaged"):
        DiTTrainPipeline.from_pretrained(str(tmp_path / "out"))
    with pytest.raises(FileNotFoundError, match="has no model_index.json"):
        DiTTrainPipeline.from_pretrained(str(tmp_path / "out" / "transformer"))


def test_bad_requests_are_one_line_before_any_work(tmp_path):
    from dit_train.export import latent_vae

    with pytest.raises(ValueError, match="--vae=None is not valid") as e:  # a latent run whose VAE is not given
        latent_vae({"data": {"name": "latents"}, "vae": {"path": None}}, None)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="only a latent run's export includes a VAE"):
        latent_vae({"data": {"name": "fashion_mnist"}}, "/some/vae")
    model = random_dit()
    save_export(model.state_dict(), model.config, str(tmp_path / "out"))
    pipe = DiTTrainPipeline.from_pretrained(str(tmp_path / "out"))
    for kwargs, match in [({"class_labels": [10]}, "class_labels=\\[10\\] is not valid: .* 0..9"),
                          ({"class_labels": [[1, 2]]}, "is not valid"), ({"class_labels": []}, "is not valid"),
                          ({}, "class_labels is required"),
                          ({"class_labels": [1], "num_inference_steps": 0}, "num_inference_steps=0")]:
        with pytest.raises(ValueError, match=match):
            pipe(**kwargs)
    text = random_dit(text_dim=12)
    save_export(text.state_dict(), text.config, str(tmp_path / "text"))
    with pytest.raises(ValueError, match="text-conditioned model needs caption embeddings"):
        DiTTrainPipeline.from_pretrained(str(tmp_path / "text"))(class_labels=[1])


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_exported_files_get_the_umasks_mode(tmp_path, umask):
    vae = tiny_vae(tmp_path / "vae", shift_factor=0.0)
    model = random_dit(in_channels=4)
    old = os.umask(umask)
    try:
        save_export(model.state_dict(), model.config, str(tmp_path / "out"), vae_path=vae)
        model.save_pretrained(str(tmp_path / "flat"))
    finally:
        os.umask(old)
    files = [os.path.join(d, f) for top in ("out", "flat") for d, _, names in os.walk(tmp_path / top) for f in names]
    assert any(f.endswith("diffusion_pytorch_model.safetensors") for f in files) and len(files) == 8
    assert {f: stat.S_IMODE(os.stat(f).st_mode) for f in files} == {f: 0o666 & ~umask for f in files}


def test_each_component_is_exactly_the_class_an_export_writes_and_the_scheduler_its_values(tmp_path):
    """model_index.json checked by (library, class), not by library alone: a scheduler slot naming diffusers'
    AutoencoderKL was built from the folder's config.json unchecked (any width), one naming DiffusionPipeline loaded
    a nested index; scheduler_config.json checked by value before diffusers builds its timestep table."""
    model = random_dit()
    out = tmp_path / "out"
    save_export(model.state_dict(), model.config, str(out))
    index = json.loads((out / "model_index.json").read_text())
    scheduler = json.loads((out / "scheduler" / "scheduler_config.json").read_text())
    (out / "scheduler" / "config.json").write_text(json.dumps(  # a small VAE: on the old check it was built
        {"_class_name": "AutoencoderKL", "block_out_channels": [8], "norm_num_groups": 4, "latent_channels": 4}))
    (out / "scheduler" / "model_index.json").write_text(json.dumps({"_class_name": "DiTTrainPipeline"}))
    for entry in (["diffusers", "AutoencoderKL"], ["diffusers", "DiffusionPipeline"],
                  ["dit_train.diffusers_pipeline", "DiTTrainPipeline"]):
        (out / "model_index.json").write_text(json.dumps({**index, "scheduler": entry}))
        with pytest.raises(ValueError, match=r"component scheduler=.* is not valid: expected "
                                             r"\[\"diffusers\", \"FlowMatchEulerDiscreteScheduler\"\]") as e:
            DiTTrainPipeline.from_pretrained(str(out))
        assert "\n" not in str(e.value)
    (out / "model_index.json").write_text(json.dumps({**index, "vae": ["diffusers", "UNet2DModel"]}))
    with pytest.raises(ValueError, match=r"component vae=.* is not valid: expected .*AutoencoderKL"):
        DiTTrainPipeline.from_pretrained(str(out))
    (out / "model_index.json").write_text(json.dumps(index))
    for key, value in [("num_train_timesteps", 10**8), ("shift", float("nan")), ("use_dynamic_shifting", 1),
                       ("base_shift", 0.7), ("sigma_max", 3.0)]:
        (out / "scheduler" / "scheduler_config.json").write_text(json.dumps({**scheduler, key: value}))
        with pytest.raises(ValueError, match=rf"scheduler_config.json'?: {key}={value!r} is not valid: an "
                                             rf"export's scheduler is .*\"num_train_timesteps\": 1000") as e:
            DiTTrainPipeline.from_pretrained(str(out))
        assert "\n" not in str(e.value)
    (out / "scheduler" / "scheduler_config.json").write_text(json.dumps(scheduler))
    DiTTrainPipeline.from_pretrained(str(out)).save_pretrained(str(tmp_path / "again"))  # diffusers writes all keys
    again = DiTTrainPipeline.from_pretrained(str(tmp_path / "again"))
    assert isinstance(again.scheduler, diffusers.FlowMatchEulerDiscreteScheduler)
    assert again.scheduler.config.num_train_timesteps == 1000


def latent_export(tmp_path, **provenance):
    """An export of a latent run (provenance as dit-export writes it) with the VAE `vae` (shift 0.3)."""
    vae = tiny_vae(tmp_path / "vae", shift_factor=0.3)
    model = random_dit(in_channels=4)
    record = {"vae": vae, "scaling_factor": 0.7, "shift_factor": 0.3}
    save_export(model.state_dict(), model.config, str(tmp_path / "out"),
                provenance={"run_config": {"data": {"name": "latents"}}, "latents_vae": record, **provenance},
                vae_path=vae)
    return str(tmp_path / "out"), vae


def test_a_latent_exports_pipeline_refuses_a_vae_other_than_the_recorded_one(tmp_path):
    """Before: any AutoencoderKL passed as vae= decoded the latents silently (another shift, other weights), and an
    index edited to vae [null, null] sampled latents as if they were images."""
    from diffusers import AutoencoderKL

    out, vae = latent_export(tmp_path)
    recorded = json.loads((tmp_path / "out" / "transformer" / "config.json").read_text())["dit_train"]["latents_vae"]
    assert recorded["vae"] == vae and len(recorded["weights_sha1"]) == 40
    same = AutoencoderKL.from_pretrained(vae)
    assert DiTTrainPipeline.from_pretrained(out, vae=same).vae is same  # the recorded VAE: accepted
    shifted = AutoencoderKL.from_pretrained(tiny_vae(tmp_path / "shifted", shift_factor=-1.0))
    with pytest.raises(ValueError, match=r"factors \(0.7, -1.0\) is not valid for .*expected the VAE that made") as e:
        DiTTrainPipeline.from_pretrained(out, vae=shifted)
    assert "\n" not in str(e.value)
    other = AutoencoderKL.from_pretrained(vae)
    with torch.no_grad():
        next(other.parameters()).add_(0.01)
    with pytest.raises(ValueError, match=r"vae with other weights .* is not valid for .*sha1 " + recorded["weights_sha1"]):
        DiTTrainPipeline.from_pretrained(out, vae=other)
    index = json.loads((tmp_path / "out" / "model_index.json").read_text())
    for edited in ({**index, "vae": [None, None]}, {k: v for k, v in index.items() if k != "vae"}):
        (tmp_path / "out" / "model_index.json").write_text(json.dumps(edited))
        with pytest.raises(ValueError, match=r"its latent run needs the VAE that made its latents, but model_index"
                                             r".json's vae is (\[null, null\]|\"missing\")") as e:
            DiTTrainPipeline.from_pretrained(out)
        assert "\n" not in str(e.value)


def test_an_image_runs_pipeline_refuses_a_vae(tmp_path):
    from diffusers import AutoencoderKL

    model = random_dit()
    save_export(model.state_dict(), model.config, str(tmp_path / "out"),
                provenance={"run_config": {"data": {"name": "fashion_mnist"}}})
    vae = AutoencoderKL.from_pretrained(tiny_vae(tmp_path / "vae", shift_factor=0.0))
    with pytest.raises(ValueError, match=r"vae=AutoencoderKL is not valid for .*its run trained on images "
                                         r"\(data=fashion_mnist\); only a latent run") as e:
        DiTTrainPipeline.from_pretrained(str(tmp_path / "out"), vae=vae)
    assert "\n" not in str(e.value)
    assert DiTTrainPipeline.from_pretrained(str(tmp_path / "out")).vae is None


@pytest.mark.parametrize("bad", ["int", "nan", "inf"])
def test_both_loaders_refuse_integer_or_non_finite_weights_naming_the_tensor(tmp_path, bad):
    """Before: integer weights were cast to float and a NaN/inf weight loaded silently (NaN images later)."""
    model = random_dit()
    state = dict(model.state_dict())
    name = "blocks.0.attn.qkv.weight"
    if bad == "int":
        state[name] = (state[name] * 100).to(torch.int32)
    else:
        state[name] = state[name].clone()
        state[name][0, 0] = float(bad)
    save_export({}, model.config, str(tmp_path / "out"))  # the folder, then the bad weights written as they are
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in state.items()},
              str(tmp_path / "out" / "transformer" / "diffusion_pytorch_model.safetensors"), metadata={"format": "pt"})
    says = "has dtype I32, not valid" if bad == "int" else "holds a NaN or an infinity, not valid"
    for load in (DiT.from_pretrained, DiTTrainPipeline.from_pretrained):
        with pytest.raises(ValueError, match=f"tensor {name} {says}") as e:
            load(str(tmp_path / "out"))
        assert "\n" not in str(e.value)
