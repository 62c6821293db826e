"""A VAE folder's config.json is checked against its safetensors header before diffusers builds the model
(diffusion/vae_shapes.py): without accelerate, diffusers allocated whatever the config declared (a crafted width,
layer count or latent_channels asked for terabytes) before reading a weight. Each crafted folder is refused in one
line naming the folder, the declared value and what the weights hold; the untouched folder still loads."""

import json

import pytest
import torch

from dit_train.diffusion.vae import load_autoencoder

SMALL = dict(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 16),
             down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
             layers_per_block=1, norm_num_groups=4, sample_size=16, scaling_factor=1.5, shift_factor=0.6)


def small_vae(folder, safe=True, **edits):
    """A random-init AutoencoderKL saved by diffusers, then its config.json edited by hand (`edits`)."""
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    vae = AutoencoderKL(**SMALL)
    vae.save_pretrained(folder, safe_serialization=safe)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **edits}))
    return vae


def test_the_saved_vae_loads_with_its_weights(tmp_path):
    vae = small_vae(tmp_path / "vae")
    loaded = load_autoencoder(str(tmp_path / "vae"), "cpu")
    assert loaded.config.shift_factor == 0.6
    for name, tensor in vae.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], tensor)


CRAFTED = {  # edit of config.json -> what the one line names
    "wider channels": ({"block_out_channels": [8, 32]},
                       "block_out_channels=[8, 32]; decoder.conv_in.bias: the config makes [32] (32 values), "
                       "the weights hold [16] (16 values)"),
    "one more block": ({"block_out_channels": [8, 16, 16], "down_block_types": ["DownEncoderBlock2D"] * 3,
                        "up_block_types": ["UpDecoderBlock2D"] * 3},
                       "block_out_channels=[8, 16, 16], but the weights hold 2 blocks"),
    "more layers": ({"layers_per_block": 3}, "layers_per_block=3, but the weights hold 1 per block"),
    "a huge latent_channels": ({"latent_channels": 2**28},
                               "latent_channels=268435456, block_out_channels=[8, 16]; decoder.conv_in.weight: "
                               "the config makes [16, 268435456, 3, 3] (38,654,705,664 values), the weights hold "
                               "[16, 4, 3, 3]"),
    "a huge width": ({"block_out_channels": [8, 2**24]}, "block_out_channels=[8, 16777216]; decoder.conv_in.bias: the config makes [16777216]"),
    "a million blocks": ({"block_out_channels": [8] * 10**6}, "but the weights hold 2 blocks"),
    "a layer count that is not a number": ({"layers_per_block": "1"}, "layers_per_block='1', but the weights"),
}


@pytest.mark.parametrize("case", list(CRAFTED))
def test_a_config_declaring_another_vae_than_its_weights_is_one_line(tmp_path, case):
    edits, names = CRAFTED[case]
    small_vae(tmp_path / "vae", **edits)
    with pytest.raises(ValueError) as e:
        load_autoencoder(str(tmp_path / "vae"), "cpu")
    line = str(e.value)
    assert "\n" not in line and line.startswith(f"VAE folder {str(tmp_path / 'vae')!r}: its config.json"), line
    assert names in line and "refusing it before anything is allocated" in line, line


def test_a_vae_with_pickled_weights_only_is_refused_unread(tmp_path, monkeypatch):
    small_vae(tmp_path / "vae", safe=False)
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("a pickle was loaded"))
    with pytest.raises(ValueError, match=r"has no diffusion_pytorch_model.safetensors .*'diffusion_pytorch_model"
                                         r".bin'.*a \.bin is a pickle and is never loaded"):
        load_autoencoder(str(tmp_path / "vae"), "cpu")


def test_an_export_whose_vae_config_is_crafted_is_refused_before_diffusers_builds_it(tmp_path):
    from dit_train.diffusers_pipeline import DiTTrainPipeline

    small_vae(tmp_path / "export" / "vae", latent_channels=2**28)
    (tmp_path / "export" / "model_index.json").write_text(json.dumps(
        {"_class_name": "DiTTrainPipeline", "vae": ["diffusers", "AutoencoderKL"]}))
    with pytest.raises(ValueError, match=r"VAE folder .*export/vae'.*latent_channels=268435456"):
        DiTTrainPipeline.from_pretrained(str(tmp_path / "export"))
