"""The DiT block and final layer with fewer operators per call (issue 31 item 4) against the formulas they replaced,
written out here with the blocks' own parameters: outputs, input gradients and every parameter gradient bit for
bit (fp32, fp64 and bf16; qk-norm, SwiGLU and cross-attention on and off); and the parameter names and shapes a
checkpoint holds, unchanged."""

import pytest
import torch
import torch.nn.functional as F

from dit_train.model.dit import DiT, DiTBlock, DiTConfig, FinalLayer


def old_modulate(x, shift, scale):
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


def old_attention(m, x, context=None, context_mask=None, cross=False):
    B, N, D = x.shape
    H, hd = m.num_heads, D // m.num_heads
    if cross:
        q = m.q(x).view(B, N, H, hd)
        k, v = m.kv(context).view(B, context.shape[1], 2, H, hd).unbind(2)
    else:
        q, k, v = m.qkv(x).view(B, N, 3, H, hd).unbind(2)
    if m.q_norm is not None:
        q = F.rms_norm(q, (hd,), m.q_norm.weight, m.q_norm.eps)
        k = F.rms_norm(k, (hd,), m.k_norm.weight, m.k_norm.eps)
    mask = None if context_mask is None else context_mask[:, None, None, :].bool()
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)
    return F.linear(out.transpose(1, 2).reshape(B, N, D), m.proj.weight, m.proj.bias)


def old_mlp(m, x):
    if hasattr(m, "w12"):
        a, b = F.linear(x, m.w12.weight, m.w12.bias).chunk(2, dim=-1)
        return F.linear(F.silu(a) * b, m.w3.weight, m.w3.bias)
    return F.linear(F.gelu(F.linear(x, m.fc1.weight, m.fc1.bias), approximate="tanh"), m.fc2.weight, m.fc2.bias)


def old_block(b, x, c, context=None, context_mask=None):
    lin = b.adaLN_modulation[1]
    shift_a, scale_a, gate_a, shift_m, scale_m, gate_m = F.linear(F.silu(c), lin.weight, lin.bias).chunk(6, dim=1)
    D = x.shape[-1]
    x = x + gate_a.unsqueeze(1) * old_attention(b.attn, old_modulate(F.layer_norm(x, (D,), eps=1e-6), shift_a,
                                                                     scale_a))
    if b.cross_attn is not None and context is not None:
        nc = F.layer_norm(x, (D,), b.norm_cross.weight, b.norm_cross.bias, eps=1e-6)
        x = x + old_attention(b.cross_attn, nc, context, context_mask, cross=True)
    return x + gate_m.unsqueeze(1) * old_mlp(b.mlp, old_modulate(F.layer_norm(x, (D,), eps=1e-6), shift_m, scale_m))


def old_final(f, x, c):
    lin = f.adaLN_modulation[1]
    shift, scale = F.linear(F.silu(c), lin.weight, lin.bias).chunk(2, dim=1)
    D = x.shape[-1]
    return F.linear(old_modulate(F.layer_norm(x, (D,), eps=1e-6), shift, scale), f.linear.weight, f.linear.bias)


def outputs_and_grads(module, fn, *inputs, autocast=False):
    """The output and every gradient; the forward under bf16 autocast if `autocast` (the backward outside it, as
    the trainer runs them)."""
    module.zero_grad(set_to_none=True)
    inputs = [t.clone().requires_grad_() for t in inputs]
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = fn(*inputs)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(out.dtype))
    return [out, *(t.grad for t in inputs), *(p.grad for p in module.parameters())]


def randomised(module):
    """Every parameter drawn away from its initialisation (adaLN-Zero's zero gates would hide the attention and MLP
    branches' gradients)."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return module


CONFIGS = [dict(), dict(qk_norm=True), dict(swiglu=True), dict(qk_norm=True, text_dim=12)]


PRECISIONS = [(torch.float32, False), (torch.float64, False), (torch.bfloat16, False), (torch.bfloat16, True)]


@pytest.mark.parametrize("opts", CONFIGS, ids=lambda o: "+".join(o) or "plain")
@pytest.mark.parametrize("dtype, autocast", PRECISIONS, ids=lambda p: str(p).replace("torch.", ""))
def test_block_is_bit_for_bit_the_old_formula(opts, dtype, autocast):
    """autocast: bf16 weights under bf16 autocast, as FSDP2's mixed precision and train.precision=bf16 run it (the
    LayerNorms and modulation in fp32, the projections in bf16)."""
    torch.manual_seed(0)
    block = randomised(DiTBlock(DiTConfig(hidden_size=64, num_heads=4, **opts))).to(dtype)
    x, c = torch.randn(3, 10, 64, dtype=dtype), torch.randn(3, 64, dtype=dtype)
    inputs, mask = [x, c], None
    if opts.get("text_dim"):
        inputs.append(torch.randn(3, 5, 64, dtype=dtype))
        mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])

    def run(fn):
        return outputs_and_grads(block, lambda *a: fn(*a, *([mask] if mask is not None else [])), *inputs,
                                 autocast=autocast)

    new, old = run(block), run(lambda *a: old_block(block, *a))
    assert len(new) == len(old) == 1 + len(inputs) + len(list(block.parameters()))
    for a, b in zip(new, old):
        assert a is not None and torch.equal(a, b)
    assert new[0].sub(x).abs().max() > 0.01  # the branches contribute


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_final_layer_is_bit_for_bit_the_old_formula(dtype):
    torch.manual_seed(0)
    final = randomised(FinalLayer(64, 2, 4)).to(dtype)
    x, c = torch.randn(3, 10, 64, dtype=dtype), torch.randn(3, 64, dtype=dtype)
    new = outputs_and_grads(final, final, x, c)
    old = outputs_and_grads(final, lambda *a: old_final(final, *a), x, c)
    for a, b in zip(new, old):
        assert a is not None and torch.equal(a, b)


def test_checkpoint_names_and_shapes_are_unchanged():
    """What a checkpoint holds, listed by hand from the model as it was before the block lost operators: a
    checkpoint saved before loads after (strict), every option on. d = 32, 2 heads of 16, patch 2 of 3 channels."""
    d, hd, pc = 32, 16, 2 * 2 * 3
    block = {"attn.qkv.weight": (3 * d, d), "attn.qkv.bias": (3 * d,), "attn.proj.weight": (d, d),
             "attn.proj.bias": (d,), "attn.q_norm.weight": (hd,), "attn.k_norm.weight": (hd,),
             "cross_attn.q.weight": (d, d), "cross_attn.q.bias": (d,), "cross_attn.kv.weight": (2 * d, d),
             "cross_attn.kv.bias": (2 * d,), "cross_attn.proj.weight": (d, d), "cross_attn.proj.bias": (d,),
             "cross_attn.q_norm.weight": (hd,), "cross_attn.k_norm.weight": (hd,), "norm_cross.weight": (d,),
             "norm_cross.bias": (d,), "mlp.fc1.weight": (4 * d, d), "mlp.fc1.bias": (4 * d,),
             "mlp.fc2.weight": (d, 4 * d), "mlp.fc2.bias": (d,), "adaLN_modulation.1.weight": (6 * d, d),
             "adaLN_modulation.1.bias": (6 * d,)}
    expected = {"x_embedder.proj.weight": (d, pc), "x_embedder.proj.bias": (d,), "t_embedder.mlp.0.weight": (d, 256),
                "t_embedder.mlp.0.bias": (d,), "t_embedder.mlp.2.weight": (d, d), "t_embedder.mlp.2.bias": (d,),
                "y_embedder.embedding_table.weight": (6, d), "context_embedder.weight": (d, 12),
                "context_embedder.bias": (d,), **{f"blocks.{i}.{k}": v for i in range(2) for k, v in block.items()},
                "final_layer.linear.weight": (pc, d), "final_layer.linear.bias": (pc,),
                "final_layer.adaLN_modulation.1.weight": (2 * d, d), "final_layer.adaLN_modulation.1.bias": (2 * d,)}
    cfg = DiTConfig(image_size=8, in_channels=3, patch_size=2, hidden_size=d, depth=2, num_heads=2, num_classes=5,
                    qk_norm=True, text_dim=12)
    model = DiT(cfg)
    assert {k: tuple(v.shape) for k, v in model.state_dict().items()} == expected
    saved = {k: torch.randn(v) for k, v in expected.items()}
    DiT(cfg).load_state_dict(saved, strict=True)
