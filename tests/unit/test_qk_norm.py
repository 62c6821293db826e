"""qk-norm normalised before the heads are permuted (model/dit.py) against the formula it replaced, F.rms_norm on the
permuted [B, H, N, hd] views, written out here: outputs and every gradient bit for bit, self- and cross-attention."""

import pytest
import torch
import torch.nn.functional as F

from dit_train.model.dit import CrossAttention, SelfAttention


def old_self(m, x):
    B, N, D = x.shape
    q, k, v = m.qkv(x).view(B, N, 3, m.num_heads, D // m.num_heads).permute(2, 0, 3, 1, 4)
    q = F.rms_norm(q, (q.shape[-1],), m.q_norm.weight, m.q_norm.eps)
    k = F.rms_norm(k, (k.shape[-1],), m.k_norm.weight, m.k_norm.eps)
    return m.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, N, D))


def old_cross(m, x, context):
    B, N, D = x.shape
    H, hd = m.num_heads, D // m.num_heads
    q = m.q(x).view(B, N, H, hd).transpose(1, 2)
    k, v = m.kv(context).view(B, context.shape[1], 2, H, hd).permute(2, 0, 3, 1, 4)
    q = F.rms_norm(q, (hd,), m.q_norm.weight, m.q_norm.eps)
    k = F.rms_norm(k, (hd,), m.k_norm.weight, m.k_norm.eps)
    return m.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, N, D))


def outputs_and_grads(m, fn, *inputs):
    m.zero_grad(set_to_none=True)
    inputs = [t.clone().requires_grad_() for t in inputs]
    out = fn(*inputs)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(3)))
    return [out, *(t.grad for t in inputs), *(p.grad for p in m.parameters())]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_self_attention_is_bit_for_bit_the_old_formula(dtype):
    torch.manual_seed(0)
    m = SelfAttention(64, 4, qk_norm=True).to(dtype)
    with torch.no_grad():  # weights away from their ones, so the norms' weights matter
        m.q_norm.weight.uniform_(0.5, 1.5), m.k_norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(3, 10, 64, dtype=dtype)
    new, old = outputs_and_grads(m, m, x), outputs_and_grads(m, lambda x: old_self(m, x), x)
    assert len(new) == len(old) == 2 + len(list(m.parameters()))
    for a, b in zip(new, old):
        assert torch.equal(a, b)
    assert new[0].abs().max() > 0.01


def test_cross_attention_is_bit_for_bit_the_old_formula():
    torch.manual_seed(0)
    m = CrossAttention(64, 4, qk_norm=True)
    with torch.no_grad():
        m.q_norm.weight.uniform_(0.5, 1.5), m.k_norm.weight.uniform_(0.5, 1.5)
    x, context = torch.randn(2, 6, 64), torch.randn(2, 5, 64)
    new = outputs_and_grads(m, lambda x, c: m(x, c, None), x, context)
    old = outputs_and_grads(m, lambda x, c: old_cross(m, x, c), x, context)
    for a, b in zip(new, old):
        assert torch.equal(a, b)
