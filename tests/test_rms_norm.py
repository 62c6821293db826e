"""The qk-norm's CPU path (dit_train/model/rms_norm.py) against the formula it replaces, F.rms_norm on the permuted q/k
views of SelfAttention: the output bit for bit, the gradients of the input and the weight to float rounding."""

import pytest
import torch
import torch.nn.functional as F

from dit_train.model.rms_norm import rms_norm

B, N, H, HD = 3, 5, 2, 16


def qk_view(dtype):
    """q as SelfAttention makes it: a permuted, non-contiguous view of the qkv projection's output."""
    qkv = torch.randn(B, N, 3 * H * HD, generator=torch.Generator().manual_seed(0)).to(dtype).requires_grad_()
    return qkv, qkv.view(B, N, 3, H, HD).permute(2, 0, 3, 1, 4)[0]


def forward_backward(norm, dtype):
    qkv, q = qk_view(dtype)
    weight = (1 + 0.3 * torch.randn(HD, generator=torch.Generator().manual_seed(1))).to(dtype).requires_grad_()
    out = norm(q, weight)
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(out.dtype)
    out.backward(upstream)
    return out, qkv.grad, weight.grad


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.float64, 1e-14), (torch.bfloat16, 1e-2)])
def test_cpu_path_equals_f_rms_norm(dtype, tol):
    new = forward_backward(lambda q, w: rms_norm(q, w, 1e-6), dtype)
    old = forward_backward(lambda q, w: F.rms_norm(q, (HD,), w, 1e-6), dtype)
    assert torch.equal(new[0], old[0])  # the same forward ops: bit for bit
    for got, want in zip(new[1:], old[1:]):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    assert new[1].abs().max() > 0.1  # the gradients compared are not vanishing


def test_gradient_against_finite_differences():
    """An independent check of the hand-derived backward (fp64 gradcheck), not only agreement with autograd."""
    x = torch.randn(2, 3, HD, dtype=torch.float64, requires_grad=True)
    w = torch.randn(HD, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w: rms_norm(x, w, 1e-6), (x, w))


def test_no_grad_and_eps():
    x = torch.zeros(2, HD)
    with torch.no_grad():
        assert torch.equal(rms_norm(x, torch.ones(HD), 1e-6), torch.zeros(2, HD))  # eps keeps 0/0 away
