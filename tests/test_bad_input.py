"""Bad input is refused with an error that names the argument and what was expected."""
import pytest
import torch

import ringfa4
from distributed import run


def qkv(b=1, sq=8, h=4, hk=2, d=16, sk=None, dtype=torch.float32):
    sk = sq if sk is None else sk
    return torch.randn(b, sq, h, d, dtype=dtype), torch.randn(b, sk, hk, d, dtype=dtype), torch.randn(b, sk, hk, d, dtype=dtype)


def _replace(args, index, value):
    args = list(args)
    args[index] = value
    return args


CASES = {
    "q is not a tensor": (lambda: _replace(qkv(), 0, [[1.0]]), {}, TypeError, "q must be a torch.Tensor"),
    "k is 3-D": (lambda: _replace(qkv(), 1, torch.randn(1, 8, 16)), {}, ValueError, "k must be 4-D"),
    "integer dtype": (lambda: [t.long() for t in qkv()], {}, TypeError, "q.dtype must be one of"),
    "float8 dtype": (lambda: [t.to(torch.float8_e4m3fn) for t in qkv()], {}, TypeError, "q.dtype must be one of"),
    "head_dim 0": (lambda: qkv(d=0), {}, ValueError, "must be positive, got shape (1, 8, 4, 0)"),
    "k dtype differs": (lambda: _replace(qkv(), 1, torch.randn(1, 8, 2, 16, dtype=torch.float64)), {}, TypeError, "k.dtype must equal q.dtype"),
    "v on another device": (lambda: _replace(qkv(), 2, torch.randn(1, 8, 2, 16, device="meta")), {}, ValueError, "v must be on q's device"),
    "k and v shapes differ": (lambda: _replace(qkv(), 2, torch.randn(1, 9, 2, 16)), {}, ValueError, "k and v must have the same shape"),
    "batch differs": (lambda: _replace(_replace(qkv(), 1, torch.randn(2, 8, 2, 16)), 2, torch.randn(2, 8, 2, 16)), {}, ValueError, "k/v batch must equal q batch 1"),
    "head_dim differs": (lambda: [qkv()[0]] + [torch.randn(1, 8, 2, 32)] * 2, {}, ValueError, "k/v head_dim must equal q head_dim 16"),
    "heads not a multiple of kv_heads": (lambda: qkv(h=5, hk=2), {}, ValueError, "q heads (5) must be a multiple of k/v heads (2)"),
    "causal with unequal lengths": (lambda: qkv(sq=8, sk=12), {"causal": True}, ValueError, "causal attention needs equal q and k/v sequence lengths"),
    "negative softmax_scale": (qkv, {"softmax_scale": -1.0}, ValueError, "softmax_scale must be a positive finite number"),
    "nan softmax_scale": (qkv, {"softmax_scale": float("nan")}, ValueError, "softmax_scale must be a positive finite number"),
    "boolean softmax_scale": (qkv, {"softmax_scale": True}, ValueError, "softmax_scale must be a positive finite number"),
    "causal not a bool": (qkv, {"causal": "yes"}, TypeError, "causal must be True or False"),
    "unknown backend": (qkv, {"backend": "triton"}, ValueError, "backend must be one of"),
    "cute on CPU tensors": (qkv, {"backend": "cute"}, ValueError, "backend 'cute' cannot run these inputs"),
    "fa4 on CPU tensors": (qkv, {"backend": "fa4"}, ValueError, "backend 'fa4' cannot run these inputs: fa4 runs on CUDA"),
}


@pytest.mark.parametrize("case", CASES)
def test_attention_refuses_bad_input_naming_the_argument(case):
    make, kwargs, error, message = CASES[case]
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        ringfa4.attention(*make(), **kwargs)


@pytest.mark.parametrize("case", CASES)
def test_ring_attention_refuses_the_same_bad_input(case):
    make, kwargs, error, _ = CASES[case]
    with pytest.raises(error):
        ringfa4.ring_attention(*make(), **kwargs)


@pytest.mark.parametrize("flag", ["deterministic", "return_lse"])
def test_ring_flags_must_be_booleans(flag):
    with pytest.raises(TypeError, match=f"{flag} must be True or False"):
        ringfa4.ring_attention(*qkv(), **{flag: "yes"})


def test_unknown_layout_is_refused():
    with pytest.raises(ValueError, match="layout must be one of"):
        ringfa4.ring_attention(*qkv(), layout="striped")
    with pytest.raises(ValueError, match="layout must be one of"):
        ringfa4.shard(torch.randn(1, 8), layout="striped")


def test_odd_local_length_is_refused_by_zigzag_even_on_one_rank():
    with pytest.raises(ValueError, match="must be a multiple of 2 for layout 'zigzag'"):
        ringfa4.ring_attention(*qkv(sq=7))


def _ring_errors(rank, world):
    q, k, v = qkv(sq=5)  # global 10: fine for contiguous over 2 ranks, zigzag needs a multiple of 4
    with pytest.raises(ValueError, match=r"global sequence length \(q.shape\[1\] = 5 x 2 ranks\) = 10 must be a multiple of 4"):
        ringfa4.ring_attention(q, k, v, layout="zigzag", backend="torch")
    assert ringfa4.ring_attention(q, k, v, layout="contiguous", backend="torch").shape == q.shape
    with pytest.raises(ValueError, match="same local length"):
        ringfa4.ring_attention(q, *qkv(sq=8)[1:], layout="contiguous", backend="torch")
    with pytest.raises(ValueError, match=r"x.shape\[1\] = 10 must be a multiple of 4"):
        ringfa4.shard(torch.randn(1, 10))


def test_ring_refuses_lengths_the_layout_cannot_split_before_any_transfer():
    run(_ring_errors, 2)
