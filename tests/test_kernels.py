"""The kernel registry and the `torch` backend against plain dense references (FP8 backends:
test_fp8.py)."""

from __future__ import annotations

import pytest
import torch

from moeplan.errors import NotYetAvailable
from moeplan.kernels import TorchBackend, available_backends, get_backend, te_importable


def _grouped_reference(x, w, counts):
    outs, start = [], 0
    for e, n in enumerate(counts.tolist()):
        outs.append(x[start:start + n] @ w[e])
        start += n
    return torch.cat(outs)


@pytest.mark.parametrize("dims", [(16, 24), (6, 10)])  # aligned → _grouped_mm, odd → loop
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_mm_matches_per_expert_gemms_forward_and_backward(dims, dtype):
    torch.manual_seed(0)
    d_in, d_out = dims
    counts = torch.tensor([3, 0, 5, 2])
    x = torch.randn(10, d_in, dtype=dtype, requires_grad=True)
    w = torch.randn(4, d_in, d_out, dtype=dtype, requires_grad=True)
    y = get_backend("torch").grouped_mm(x, w, counts)
    y.sum().backward()  # an expanded gradient, which _grouped_mm alone rejects
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ref = _grouped_reference(x2, w2, counts)
    ref.sum().backward()
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(y, ref, rtol=tol, atol=tol)
    torch.testing.assert_close(x.grad, x2.grad, rtol=tol, atol=tol)
    torch.testing.assert_close(w.grad, w2.grad, rtol=tol, atol=tol)


def test_permute_then_unpermute_is_the_probability_weighted_sum():
    torch.manual_seed(0)
    T, h, E, k = 7, 4, 5, 2
    x = torch.randn(T, h)
    experts = torch.stack([torch.randperm(E)[:k] for _ in range(T)])  # (T, k)
    probs = torch.rand(T, k)
    b = TorchBackend()
    copies, order, counts = b.permute(x, experts, E)
    sorted_ids = experts.reshape(-1)[order]
    assert torch.equal(sorted_ids, torch.sort(sorted_ids).values)  # grouped by expert
    assert counts.tolist() == torch.bincount(experts.reshape(-1), minlength=E).tolist()
    scale = torch.arange(1, E + 1, dtype=x.dtype)
    y = copies * scale[sorted_ids].unsqueeze(1)  # "expert e multiplies by e + 1"
    out = b.unpermute(y, order, probs, T)
    ref = (x.unsqueeze(1) * (scale[experts] * probs).unsqueeze(-1)).sum(1)
    torch.testing.assert_close(out, ref)


def test_unknown_backend_is_refused_by_name():
    assert {"torch", "emulated", "torch-fp8"} <= set(available_backends())
    with pytest.raises(NotYetAvailable, match="no-such-backend"):
        get_backend("no-such-backend")
    if not te_importable():  # `te` registers only where Transformer Engine imports on a GPU
        with pytest.raises(NotYetAvailable, match="'te'"):
            get_backend("te")
