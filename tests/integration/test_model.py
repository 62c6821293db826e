import pytest
import torch
from omegaconf import OmegaConf

from conftest import CONF_DIR, compose
from dit_train.model.dit import DiT, DiTConfig, build_model, count_parameters, sincos_pos_embed_2d

LARGE = ["dit_1b3", "dit_4b", "dit_9b", "dit_15b"]


@pytest.mark.parametrize("name", LARGE)
def test_large_presets_match_nominal_size_on_meta(name):
    cfg = OmegaConf.load(f"{CONF_DIR}/model/{name}.yaml")
    model = build_model(cfg, device="meta")
    n = count_parameters(model)
    assert abs(n / cfg.nominal_params - 1) <= 0.05, (name, n)
    assert all(p.is_meta for p in model.parameters())
    assert cfg.hidden_size // cfg.num_heads == 128  # head dim 128 for the large presets


def small(**kw):
    base = dict(image_size=16, in_channels=3, patch_size=4, hidden_size=32, depth=2, num_heads=2, num_classes=5)
    base.update(kw)
    return DiT(DiTConfig(**base))


def test_patchify_unpatchify_roundtrip():
    m = small()
    x = torch.randn(2, 3, 16, 16)
    tokens = m.patchify(x)
    assert tokens.shape == (2, 16, 4 * 4 * 3)
    assert torch.equal(m.unpatchify(tokens), x)
    # a patch is a contiguous spatial block: token 1 is rows 0-3, cols 4-7
    assert torch.equal(tokens[0, 1].view(4, 4, 3).permute(2, 0, 1), x[0, :, 0:4, 4:8])


def test_adaln_zero_init_outputs_zero_and_blocks_are_identity():
    m = small()
    x = torch.randn(3, 3, 16, 16)
    out = m(x, torch.rand(3), torch.tensor([0, 1, 2]))
    assert out.shape == x.shape
    assert torch.count_nonzero(out) == 0  # zero final layer
    h = torch.randn(3, 16, 32)
    c = torch.randn(3, 32)
    assert torch.equal(m.blocks[0](h, c), h)  # gates start at zero


@pytest.mark.parametrize("opts", [dict(qk_norm=True), dict(swiglu=True), dict(qk_norm=True, swiglu=True)])
def test_options_forward_backward(opts):
    m = small(**opts)
    torch.nn.init.normal_(m.final_layer.linear.weight)
    x = torch.randn(2, 3, 16, 16)
    m(x, torch.rand(2), torch.tensor([0, 4])).square().mean().backward()
    assert all(p.grad is not None for p in m.parameters())


def test_swiglu_keeps_parameter_count_close():
    a, b = count_parameters(small().blocks[0].mlp), count_parameters(small(swiglu=True).blocks[0].mlp)
    assert abs(a / b - 1) < 0.02


def test_class_dropout_uses_null_class_and_changes_output():
    m = small()
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.05)
    x, t, y = torch.randn(2, 3, 16, 16), torch.rand(2), torch.tensor([1, 2])
    null = torch.full((2,), 5)
    dropped = m(x, t, y, drop_mask=torch.tensor([True, True]))
    assert torch.allclose(dropped, m(x, t, null))
    assert not torch.allclose(dropped, m(x, t, y))



def test_the_blocks_see_patch_embeddings_plus_positions_and_an_unconditional_call_is_the_null_class():
    m = small()
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.05)
    x, t = torch.randn(2, 3, 16, 16), torch.rand(2)
    seen = []
    m.blocks[0].register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    with torch.no_grad():
        out = m(x, t)  # no labels: the null class, index num_classes
        torch.testing.assert_close(seen[0], m.x_embedder.proj(m.patchify(x)) + sincos_pos_embed_2d(32, 4))
        assert torch.equal(out, m(x, t, torch.full((2,), 5)))
        assert not torch.allclose(out, m(x, t, torch.zeros(2, dtype=torch.long)))


def test_a_dropped_text_condition_is_the_same_whatever_the_text():
    """drop_mask on a text model: the embedded context is zeroed (the text 'null'), so what the text was no longer
    matters; not dropped, it does."""
    m = small(text_dim=24, num_classes=0)
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.05)
    x, t, a, b = torch.randn(2, 3, 16, 16), torch.rand(2), torch.randn(2, 7, 24), torch.randn(2, 7, 24)
    drop = torch.tensor([True, True])
    with torch.no_grad():
        torch.testing.assert_close(m(x, t, context=a, drop_mask=drop), m(x, t, context=b, drop_mask=drop))
        assert not torch.allclose(m(x, t, context=a), m(x, t, context=b))

def test_cross_attention_with_random_text_embeddings():
    m = small(text_dim=24, num_classes=0)
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.05)
    x, t = torch.randn(2, 3, 16, 16), torch.rand(2)
    ctx = torch.randn(2, 7, 24)
    mask = torch.ones(2, 7, dtype=torch.bool)
    mask[1, 5:] = False
    out = m(x, t, context=ctx, context_mask=mask)
    assert out.shape == x.shape
    # masked tokens do not matter; unmasked ones do
    ctx2 = ctx.clone()
    ctx2[1, 6] += 10
    assert torch.allclose(m(x, t, context=ctx2, context_mask=mask)[1], out[1], atol=1e-5)
    ctx2[1, 0] += 10
    assert not torch.allclose(m(x, t, context=ctx2, context_mask=mask)[1], out[1], atol=1e-5)
    with pytest.raises(ValueError, match="text_dim"):
        small()(x, t, context=ctx)


def test_sincos_positions_distinct_and_bounded():
    pe = sincos_pos_embed_2d(32, 4)
    assert pe.shape == (16, 32)
    assert pe.abs().max() <= 1.0
    assert torch.cdist(pe, pe).add(torch.eye(16)).min() > 0.1  # all positions distinct


def test_sincos_positions_by_hand_and_against_mae_dits_table():
    """Token k is the patch at row k // grid, column k % grid (patchify's order); its row's sin-cos features fill the
    first half, its column's the second, each [sin(pos omega), cos(pos omega)] with omega_i = 10000^(-i / (dim/4)).
    MAE's and DiT's table (diffusers' get_2d_sincos_pos_embed) holds the same two halves the other way round,
    column first. The table is not saved in checkpoints (recomputed on load), so its convention is pinned here: a
    change would silently move every trained model's positions."""
    omega = torch.tensor([1.0, 0.01], dtype=torch.float64)  # dim 8: 10000^(-0/2), 10000^(-1/2)
    row, col = 1.0, 2.0  # token 5 of a 3 x 3 grid
    by_hand = torch.cat([(row * omega).sin(), (row * omega).cos(), (col * omega).sin(), (col * omega).cos()])
    torch.testing.assert_close(sincos_pos_embed_2d(8, 3)[5], by_hand.float(), rtol=0, atol=1e-7)
    embeddings = pytest.importorskip("diffusers.models.embeddings")
    for dim, grid in ((32, 4), (64, 6)):
        # base_size = grid: integer coordinates, as in MAE and DiT
        ref = embeddings.get_2d_sincos_pos_embed(dim, grid, base_size=grid, output_type="pt").float()
        torch.testing.assert_close(sincos_pos_embed_2d(dim, grid), torch.cat([ref[:, dim // 2:], ref[:, :dim // 2]], 1),
                                   rtol=0, atol=1e-6)


def test_timestep_features_are_dits_sinusoids_of_1000_t():
    """The features TimestepEmbedder feeds its MLP, by hand in float64: [cos(1000 t f_i), sin(1000 t f_i)] with
    f_i = 10000^(-i/128), i < 128 (DiT's timestep_embedding; diffusers' get_timestep_embedding with
    flip_sin_to_cos=True, downscale_freq_shift=0). The MLP's first layer is replaced by the identity to read them."""
    from dit_train.model.dit import TimestepEmbedder

    embedder = TimestepEmbedder(16)
    embedder.mlp = torch.nn.Sequential(torch.nn.Linear(256, 256, bias=False))
    with torch.no_grad():
        embedder.mlp[0].weight.copy_(torch.eye(256))
        t = torch.tensor([0.0, 0.013, 0.5, 1.0])
        args = (t.double() * 1000)[:, None] * 10000.0 ** (-torch.arange(128, dtype=torch.float64) / 128)[None]
        ref = torch.cat([args.cos(), args.sin()], dim=1)
        # float32 arguments up to 1000 radians: ~1e-4 of rounding
        torch.testing.assert_close(embedder(t).double(), ref, rtol=0, atol=5e-4)


def test_bad_model_config_is_one_line():
    with pytest.raises(ValueError, match=r"model.patch_size=3 is not valid: must divide model.image_size=16 \(valid: 1, 2, 4, 8\)$"):
        small(patch_size=3)


def test_every_small_preset_composes_and_builds():
    for name in ["dit_xs", "dit_s", "dit_m"]:
        cfg = compose([f"model={name}", "run_dir=/tmp/unused"])
        m = build_model(cfg.model, device="meta")
        assert count_parameters(m) > 0


def test_every_preset_is_its_own_size():
    """One preset per model size: no two presets build the same architecture."""
    import glob
    import os

    sizes = {}
    for path in sorted(glob.glob(os.path.join(CONF_DIR, "model", "*.yaml"))):
        name = os.path.basename(path)[:-5]
        cfg = compose([f"model={name}", "run_dir=/tmp/unused"])
        sizes.setdefault(count_parameters(build_model(cfg.model, device="meta")), []).append(name)
    assert all(len(names) == 1 for names in sizes.values()), sizes


def test_readme_presets_table_has_every_preset_with_its_exact_count():
    import glob
    import os
    import re

    readme = open(os.path.join(os.path.dirname(CONF_DIR), "..", "README.md")).read()
    for path in sorted(glob.glob(f"{CONF_DIR}/model/*.yaml")):
        cfg = OmegaConf.load(path)
        n = count_parameters(build_model(cfg, device="meta"))
        row = re.search(rf"^\| `{cfg.name}` \|.*\| ([\d,]+) \|$", readme, re.M)
        assert row, f"{cfg.name} missing from the README presets table"
        assert row.group(1) == f"{n:,}", (cfg.name, row.group(1), n)


def test_load_preset_resizes_for_benchmarks_and_names_valid_presets():
    from dit_train.model.dit import load_preset

    cfg = load_preset("dit_m", hidden_size=512, depth=3)
    assert (cfg.hidden_size, cfg.num_heads, cfg.depth) == (512, 8, 3)  # head dim 64 kept
    assert load_preset("dit_m", hidden_size=512, num_heads=4).num_heads == 4
    assert load_preset("dit_4b").hidden_size == OmegaConf.load(f"{CONF_DIR}/model/dit_4b.yaml").hidden_size
    with pytest.raises(ValueError, match=r"model preset 'dit_5b' does not exist; valid: .*dit_4b"):
        load_preset("dit_5b")


def test_benchmark_scripts_run_on_a_tiny_model(tmp_path, capsys):
    """The optimizer benchmark and the memory table are what the README's figures come from: keep them runnable.
    The benchmark's compiled contenders (an inductor compile, the most of this test's time) run in
    test_readme_commands, from docs/optimizers.md's command; the memory table's `python -m` form is
    test_entry_point's."""
    import subprocess
    import sys

    from conftest import ROOT
    from dit_train.parallel import memory_formula

    bench = subprocess.run([sys.executable, "-m", "benchmarks.bench_optimizer", "--preset", "dit_s", "--depth",
                            "1", "--hidden-size", "64", "--repeats", "1", "--warmup", "0", "--quick", "--no-compile"],
                           cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert bench.returncode == 0, bench.stderr[-2000:]
    assert "periodic_rowwise" in bench.stdout and "muon" in bench.stdout
    memory_formula.main(["--presets", "dit_1b3", "--world-sizes", "8"])
    assert "dit_1b3" in capsys.readouterr().out
