"""The chunked LM-head loss equals the plain cross-entropy over full logits, which never exist."""
import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from ringfa4.nn.loss import linear_cross_entropy

TOKENS, DIM, VOCAB = 2 * 32, 8, 50


def inputs(dtype=torch.float64):
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(2, TOKENS // 2, DIM, generator=gen, dtype=dtype, requires_grad=True)
    weight = torch.randn(VOCAB, DIM, generator=gen, dtype=dtype, requires_grad=True)
    labels = torch.randint(VOCAB, (2, TOKENS // 2), generator=gen)
    return h, weight, labels


def plain_loss(h, weight, labels):
    logits = F.linear(h, weight).to(torch.promote_types(h.dtype, torch.float32))
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")


@pytest.mark.parametrize("chunk", [1, 7, 64, 100])
def test_chunked_loss_and_grads_equal_the_plain_loss_fp64(chunk):
    h, weight, labels = inputs()
    ref = plain_loss(h, weight, labels)
    ref_dh, ref_dw = torch.autograd.grad(ref * 0.37, (h, weight))
    loss = linear_cross_entropy(h, weight, labels, chunk)
    dh, dw = torch.autograd.grad(loss * 0.37, (h, weight))  # scaled like the trainer's share
    assert loss.dtype == torch.float64
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=0)
    torch.testing.assert_close(dh, ref_dh, rtol=1e-10, atol=1e-13)
    torch.testing.assert_close(dw, ref_dw, rtol=1e-10, atol=1e-13)


def test_chunked_loss_without_grad_equals_the_plain_loss():
    h, weight, labels = inputs()
    with torch.no_grad():
        torch.testing.assert_close(linear_cross_entropy(h, weight, labels, 7), plain_loss(h, weight, labels),
                                   rtol=1e-12, atol=0)


def test_bf16_loss_is_fp32_and_close_to_the_plain_loss():
    h, weight, labels = inputs(torch.bfloat16)
    loss = linear_cross_entropy(h, weight, labels, 16)
    dh, dw = torch.autograd.grad(loss, (h, weight))
    ref = plain_loss(h, weight, labels)
    ref_dh, ref_dw = torch.autograd.grad(ref, (h, weight))
    assert loss.dtype == torch.float32 and dh.dtype == dw.dtype == torch.bfloat16
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=0)
    torch.testing.assert_close(dh, ref_dh, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(dw, ref_dw, rtol=2e-2, atol=2e-2)


class LargestTensor(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


def test_no_tensor_as_large_as_the_logits_exists_in_forward_or_backward():
    h, weight, labels = inputs()
    with LargestTensor() as largest:
        loss = linear_cross_entropy(h, weight, labels, 8)
        loss.backward()
    # Largest legitimate tensors: h and its gradient (TOKENS x DIM), the weight gradient, one chunk's logits.
    assert largest.numel == max(TOKENS * DIM, VOCAB * DIM, 8 * VOCAB) < TOKENS * VOCAB
    with LargestTensor() as largest:
        plain_loss(h, weight, labels).backward()
    assert largest.numel == TOKENS * VOCAB  # the check sees logits where they exist


@pytest.mark.parametrize("chunk", [0, -4, 2.5, True])
def test_bad_chunk_is_named(chunk):
    h, weight, labels = inputs()
    with pytest.raises(ValueError, match="loss chunk must be a positive integer"):
        linear_cross_entropy(h, weight, labels, chunk)


def test_labels_of_another_shape_are_refused():
    h, weight, labels = inputs()
    with pytest.raises(ValueError, match=r"labels must have the shape of h without its last dim, \(2, 32\)"):
        linear_cross_entropy(h, weight, labels[:, :-1], 8)
