"""Parameter routing (matrix update vs AdamW) on our DiT, diffusers' DiT and SD3 transformers, and plain modules."""

import pytest
import torch
from torch import nn

from conftest import compose
from dit_train.trainer.dry_run import dry_run
from dit_train.model.dit import DiT, DiTConfig
from dit_train.optim.registry import build_optimizer
from dit_train.optim.routing import format_routing_table, name_matches, route_parameters


pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


def names(pairs):
    return {n for n, _ in pairs}


@pytest.mark.parametrize("swiglu", [False, True])
def test_our_dit_routing(swiglu):
    cfg = DiTConfig(image_size=8, in_channels=4, patch_size=2, hidden_size=32, depth=2, num_heads=2,
                    num_classes=10, qk_norm=True, swiglu=swiglu, text_dim=24)
    model = DiT(cfg)
    r = route_parameters(model)
    mlp = ("mlp.w12", "mlp.w3") if swiglu else ("mlp.fc1", "mlp.fc2")
    per_block = ["attn.qkv", "attn.proj", "cross_attn.q", "cross_attn.kv", "cross_attn.proj", *mlp,
                 "adaLN_modulation.1"]
    expected = {f"blocks.{i}.{m}.weight" for i in range(2) for m in per_block}
    expected |= {"t_embedder.mlp.0.weight", "t_embedder.mlp.2.weight", "final_layer.adaLN_modulation.1.weight"}
    assert names(r.matrix) == expected
    adamw = names(r.adamw)
    for n in ("x_embedder.proj.weight", "x_embedder.proj.bias", "y_embedder.embedding_table.weight",
              "context_embedder.weight", "final_layer.linear.weight", "final_layer.linear.bias",
              "blocks.0.attn.q_norm.weight", "blocks.1.cross_attn.k_norm.weight", "blocks.0.attn.qkv.bias"):
        assert n in adamw
    assert adamw | expected == {n for n, _ in model.named_parameters()}
    assert all(p.ndim == 2 for _, p in r.matrix)


def test_routing_on_meta_device_and_table():
    with torch.device("meta"):
        model = DiT(DiTConfig(hidden_size=64, depth=3, num_heads=2))
    r = route_parameters(model)
    n_matrix = sum(p.numel() for _, p in r.matrix)
    n_adamw = sum(p.numel() for _, p in r.adamw)
    table = format_routing_table(r)
    lines = table.splitlines()
    assert lines[0].startswith("| group | tensors | params")
    assert lines[2].startswith(f"| matrix | {len(r.matrix)} | {n_matrix:,}")
    assert lines[3].startswith(f"| adamw | {len(r.adamw)} | {n_adamw:,}")
    assert lines[4] == "per tensor: optimizer.routing.table()" and len(lines) == 5  # DiT: nothing routed by shape
    opt = build_optimizer(model, {"name": "muon"})  # the trainer's dry run builds on meta: nothing allocated
    assert table in opt.routing_table


def test_diffusers_dit_and_sd3_routing():
    diffusers = pytest.importorskip("diffusers")
    dit = diffusers.DiTTransformer2DModel(num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4,
                                          num_layers=2, sample_size=8, patch_size=2, num_embeds_ada_norm=10,
                                          norm_type="ada_norm_zero")
    r = route_parameters(dit)
    matrix = names(r.matrix)
    for i in range(2):
        for m in ("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0", "ff.net.0.proj", "ff.net.2",
                  "norm1.linear", "norm1.emb.timestep_embedder.linear_1", "norm1.emb.timestep_embedder.linear_2"):
            assert f"transformer_blocks.{i}.{m}.weight" in matrix
    assert "proj_out_1.weight" in matrix  # the final adaLN modulation
    adamw = names(r.adamw)
    assert {"pos_embed.proj.weight", "proj_out_2.weight",
            "transformer_blocks.0.norm1.emb.class_embedder.embedding_table.weight"} <= adamw
    assert not any(n.endswith(".bias") for n in matrix)

    sd3 = diffusers.SD3Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, num_layers=2,
                                          attention_head_dim=8, num_attention_heads=2, joint_attention_dim=16,
                                          caption_projection_dim=16, pooled_projection_dim=12, out_channels=4,
                                          pos_embed_max_size=16)
    r = route_parameters(sd3)
    matrix, adamw = names(r.matrix), names(r.adamw)
    for m in ("attn.to_q", "attn.add_q_proj", "attn.to_add_out", "ff.net.0.proj", "ff_context.net.2",
              "norm1.linear", "norm1_context.linear"):
        assert f"transformer_blocks.0.{m}.weight" in matrix
    assert {"time_text_embed.timestep_embedder.linear_1.weight", "time_text_embed.text_embedder.linear_2.weight",
            "norm_out.linear.weight"} <= matrix
    assert {"pos_embed.proj.weight", "context_embedder.weight", "proj_out.weight",
            "time_text_embed.text_embedder.linear_1.weight"} <= adamw
    assert all(p.ndim == 2 for _, p in r.matrix)
    assert len(matrix) + len(adamw) == len(list(sd3.parameters()))


class Plain(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3)
        self.emb = nn.Embedding(10, 8)
        self.table = nn.Parameter(torch.zeros(4, 8))  # free 2-D parameter
        self.experts = nn.Parameter(torch.zeros(2, 4, 8))  # free 3-D parameter: AdamW, no matrix update
        self.hidden = nn.Linear(8, 16)
        self.head = nn.Linear(16, 4)
        self.norm = nn.LayerNorm(16)
        self.frozen = nn.Linear(8, 8)
        self.frozen.requires_grad_(False)


def test_generic_module_rule_and_overrides():
    m = Plain()
    r = route_parameters(m)
    assert names(r.matrix) == {"hidden.weight", "head.weight", "table"}  # a free 2-D parameter: by shape
    assert "frozen.weight" not in names(r.adamw) | names(r.matrix)
    assert {"emb.weight", "stem.weight", "experts"} <= names(r.adamw)
    r = route_parameters(m, matrix_patterns=["table"], adamw_patterns=["head"])
    assert names(r.matrix) == {"hidden.weight", "table"}
    assert "head.weight" in names(r.adamw)
    r = route_parameters(m, adamw_patterns=["table"])
    assert names(r.matrix) == {"hidden.weight", "head.weight"}
    with pytest.raises(ValueError, match="only 2-D"):
        route_parameters(m, matrix_patterns=["stem"])
    with pytest.raises(ValueError, match="adamw_patterns"):
        route_parameters(m, adamw_patterns=[3])
    r = route_parameters(m, matrix_update=False)
    assert not r.matrix and len(r.adamw) == sum(p.requires_grad for p in m.parameters())
    # the AdamW baseline: matrix_patterns (a config's, shared with the matrix optimizers) do not apply
    assert not route_parameters(m, matrix_patterns=["table", "hidden"], matrix_update=False).matrix


def test_config_patterns_reach_routing():
    model = DiT(DiTConfig(image_size=8, patch_size=2, hidden_size=32, depth=1, num_heads=2))
    opt = build_optimizer(model, {"name": "rownorm", "adamw_patterns": ["final_layer", "x_embedder", "blocks.*.attn"]})
    matrix = {id(p) for g in opt.param_groups if g["kind"] == "matrix" for p in g["params"]}
    assert id(model.blocks[0].attn.qkv.weight) not in matrix
    assert id(model.blocks[0].mlp.fc1.weight) in matrix
    assert id(model.final_layer.adaLN_modulation[1].weight) not in matrix


def test_name_matching_is_component_wise():
    assert name_matches("final_layer.linear.weight", "final_layer.linear")
    assert not name_matches("final_layer.linear2.weight", "final_layer.linear")
    assert name_matches("proj_out.weight", "proj_out") and not name_matches("proj_out_1.weight", "proj_out")
    assert name_matches("blocks.3.attn.qkv.weight", "blocks.*.attn.qkv")
    assert name_matches("_orig_mod.x_embedder.proj.weight", "x_embedder")  # torch.compile prefix
    assert not name_matches("my_x_embedder.proj.weight", "x_embedder")


def test_multihead_attention_in_proj_takes_the_matrix_update():
    """nn.Transformer: every 2-D weight takes the matrix update, as torch.optim.Muon's users route them. The
    in_proj_weight of nn.MultiheadAttention is a bare parameter, not an nn.Linear: it used to go to AdamW
    silently (7 of 10 matrices, 52% of the parameters). The table names the ones routed by shape."""
    m = nn.Transformer(d_model=32, nhead=2, num_encoder_layers=1, num_decoder_layers=1, dim_feedforward=64,
                       batch_first=True)
    r = route_parameters(m)
    two_d = {n for n, p in m.named_parameters() if p.ndim == 2}
    assert len(two_d) == 10 and names(r.matrix) == two_d
    in_proj = ["encoder.layers.0.self_attn.in_proj_weight", "decoder.layers.0.self_attn.in_proj_weight",
               "decoder.layers.0.multihead_attn.in_proj_weight"]
    assert all(r.reasons[n] == "2-D, not an nn.Linear weight: by shape" for n in in_proj)
    summary = format_routing_table(r)
    assert f"| matrix | 10 | {sum(p.numel() for n, p in m.named_parameters() if n in two_d):,}" in summary
    assert (f"note: 2-D parameters outside nn.Linear take the matrix update by shape (3): {', '.join(in_proj)}; "
            "optimizer.adamw_patterns keeps them on AdamW") in summary.splitlines()
    opt = build_optimizer(m, {"name": "muon"})
    matrix = {id(p) for g in opt.param_groups if g["kind"] == "matrix" for p in g["params"]}
    assert id(m.encoder.layers[0].self_attn.in_proj_weight) in matrix and len(matrix) == 10


def test_per_tensor_table_from_the_optimizer():
    """optimizer.routing.table(): one row per trainable parameter, in model order, with shape, group and why;
    convolution weights are named as not flattened, in the table and the printed summary."""
    m = Plain()
    opt = build_optimizer(m, {"name": "rownorm"})
    rows = opt.routing.table().splitlines()
    assert rows[:2] == ["| parameter | shape | group | why |", "| --- | --- | --- | --- |"]
    trainable = [n for n, p in m.named_parameters() if p.requires_grad]
    assert [row.split(" | ")[0].lstrip("| ") for row in rows[2:]] == trainable
    assert "| table | (4, 8) | matrix | 2-D, not an nn.Linear weight: by shape |" in rows
    assert "| hidden.weight | (16, 8) | matrix | 2-D nn.Linear weight |" in rows
    assert "| emb.weight | (10, 8) | adamw | embedding table |" in rows
    assert "| experts | (2, 4, 8) | adamw | 3-D |" in rows
    assert ("| stem.weight | (8, 3, 3, 3) | adamw | 4-D convolution weight: not flattened, the matrix update takes "
            "2-D weights |") in rows
    assert ("note: convolution weights take AdamW, not flattened to [out, in*kh*kw] (1): stem.weight"
            in opt.routing_table.splitlines())
    baseline = build_optimizer(m, {"name": "adamw"})
    assert all(row.endswith("| adamw | AdamW for every parameter |") for row in baseline.routing.table().splitlines()[2:])


def test_dry_run_prints_the_per_tensor_table(capsys):
    """`python -m dit_train optimizer=muon train.dry_run=true` shows where each parameter went and why."""
    dry_run(compose(["model=dit_xs", "optimizer=muon", "train.dry_run=true", "run_dir=/tmp/unused"]))
    out = capsys.readouterr().out.splitlines()
    assert "| parameter | shape | group | why |" in out
    assert any(line.startswith("| blocks.0.attn.qkv.weight | (") and line.endswith("| matrix | 2-D nn.Linear weight |")
               for line in out)
    assert any(line.startswith("| final_layer.linear.weight | (") and "| adamw | adamw_patterns 'final_layer.linear' |"
               in line for line in out)
