"""dit_train/diffusion/vae.py's latent convention against diffusers' own (SD3 / Flux pipelines): latent = (z - shift) * scale
to train on, z = latent / scale + shift to decode, with a VAE whose shift_factor is non-zero as SD3's and Flux's
are (the tests' other VAEs have none, so a sign error in the shift would pass them)."""

import torch

from dit_train.diffusion.vae import LatentCodec

SCALE, SHIFT = 1.5, 0.6


def test_codec_applies_scaling_and_shift_factor_as_diffusers_pipelines_do(tmp_path):
    from diffusers import AutoencoderKL

    vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 16),
                        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                        layers_per_block=1, norm_num_groups=4, sample_size=16, scaling_factor=SCALE,
                        shift_factor=SHIFT).eval()
    vae.save_pretrained(tmp_path / "vae")
    codec = LatentCodec(str(tmp_path / "vae"), "cpu", batch_size=2)
    images = torch.rand(3, 3, 16, 16, generator=torch.Generator().manual_seed(0)) * 2 - 1
    with torch.no_grad():
        z = vae.encode(images).latent_dist.mean
        latents = codec.encode(images)
        torch.testing.assert_close(latents, (z - SHIFT) * SCALE)
        # a latent the model produced: the pipelines decode latent / scale + shift
        made = torch.randn(3, 4, 8, 8, generator=torch.Generator().manual_seed(1))
        torch.testing.assert_close(codec.decode(made), vae.decode(made / SCALE + SHIFT).sample.clamp(-1, 1))
        # encode then decode gives the VAE's own reconstruction of the posterior mean
        torch.testing.assert_close(codec.decode(latents), vae.decode(z).sample.clamp(-1, 1))


def test_loading_the_vae_says_nothing(tmp_path, capfd):
    """dit-encode-latents, sampling and FD of latent runs load the VAE: without accelerate installed (not one of
    our dependencies), diffusers printed a 5-line advice to `pip install accelerate` every time."""
    from diffusers import AutoencoderKL

    AutoencoderKL(in_channels=1, out_channels=1, latent_channels=4, block_out_channels=(8,),
                  down_block_types=("DownEncoderBlock2D",), up_block_types=("UpDecoderBlock2D",),
                  layers_per_block=1, norm_num_groups=4).save_pretrained(tmp_path / "vae")
    capfd.readouterr()
    LatentCodec(str(tmp_path / "vae"), "cpu")
    out, err = capfd.readouterr()
    assert out + err == ""


def test_grey_images_are_encoded_as_three_equal_channels(tmp_path):
    """Fashion-MNIST is grey: a 1-channel batch given to a 3-channel VAE is its image repeated on every channel."""
    from diffusers import AutoencoderKL

    vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8,),
                        down_block_types=("DownEncoderBlock2D",), up_block_types=("UpDecoderBlock2D",),
                        layers_per_block=1, norm_num_groups=4, scaling_factor=SCALE, shift_factor=SHIFT).eval()
    vae.save_pretrained(tmp_path / "vae")
    grey = torch.rand(2, 1, 8, 8, generator=torch.Generator().manual_seed(2)) * 2 - 1
    with torch.no_grad():
        z = vae.encode(torch.cat([grey, grey, grey], dim=1)).latent_dist.mean
        torch.testing.assert_close(LatentCodec(str(tmp_path / "vae"), "cpu").encode(grey), (z - SHIFT) * SCALE)


def test_a_nan_or_non_positive_scaling_factor_is_refused_where_the_config_is_read(tmp_path):
    """json reads NaN / Infinity: a VAE config.json with "scaling_factor": NaN made dit-encode-latents write all-NaN
    latents with exit 0, and the pipeline decode NaN images; both read the factors through vae_scaling."""
    import json

    import pytest
    from diffusers import AutoencoderKL

    from dit_train.config.latents import vae_scaling
    from dit_train.diffusion.vae_shapes import check_vae_folder
    from dit_train.runs.json_file import DamagedJSONFile

    AutoencoderKL(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8,),
                  down_block_types=("DownEncoderBlock2D",), up_block_types=("UpDecoderBlock2D",),
                  layers_per_block=1, norm_num_groups=4, sample_size=8).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    for key, value in [("scaling_factor", float("nan")), ("scaling_factor", float("inf")), ("scaling_factor", 0),
                       ("scaling_factor", -0.5), ("shift_factor", float("nan")), ("shift_factor", float("-inf"))]:
        (tmp_path / "config.json").write_text(json.dumps({**config, "shift_factor": 0.1, key: value}))
        for read in (vae_scaling, check_vae_folder):
            with pytest.raises(DamagedJSONFile, match=rf"config.json: scaling_factor=.* / shift_factor=.* is not "
                                                      rf"valid: expected a finite scaling_factor > 0") as e:
                read(str(tmp_path))
            assert f"{key}={value!r}" in str(e.value) and "\n" not in str(e.value)
    (tmp_path / "config.json").write_text(json.dumps({**config, "scaling_factor": None, "shift_factor": None}))
    assert vae_scaling(str(tmp_path)) == (1.0, 0.0)  # absent: the codec's identity, as before
    (tmp_path / "config.json").write_text(json.dumps({**config, "scaling_factor": 0.18, "shift_factor": -0.2}))
    assert vae_scaling(str(tmp_path)) == (0.18, -0.2)
    check_vae_folder(str(tmp_path))
