"""Merging partial (out, lse) pairs through their log-sum-exp."""
import math

import torch

from reference import attention_fp64
from ringfa4.ring.merge import merge_


def _split_attention(q, k, v, cut):
    a = attention_fp64(q, k[:, :cut], v[:, :cut])
    b = attention_fp64(q, k[:, cut:], v[:, cut:])
    return a, b


def test_merging_two_key_halves_equals_attention_over_all_keys():
    q, k, v = (torch.randn(2, 9, 3, 8, dtype=torch.float64) for _ in range(3))
    (oa, la), (ob, lb) = _split_attention(q, k, v, 4)
    out, lse = oa.clone(), la.clone()
    merge_(out, lse, ob, lb)
    ref_out, ref_lse = attention_fp64(q, k, v)
    assert (out - ref_out).abs().max() < 1e-14 and (lse - ref_lse).abs().max() < 1e-14


def test_a_fully_masked_side_has_no_weight_and_gives_no_nan():
    out = torch.randn(1, 4, 2, 8)
    lse = torch.randn(1, 2, 4)
    part = torch.randn(1, 4, 2, 8)
    minus_inf = torch.full((1, 2, 4), -math.inf)
    expected = out.clone(), lse.clone()
    merge_(out, lse, part, minus_inf)  # partial side empty
    assert torch.equal(out, expected[0]) and torch.equal(lse, expected[1])

    empty_out, empty_lse = torch.zeros(1, 4, 2, 8), minus_inf.clone()
    merge_(empty_out, empty_lse, part, expected[1])  # running side empty
    assert torch.allclose(empty_out, part) and torch.equal(empty_lse, expected[1])


def test_both_sides_masked_stay_minus_infinity_with_zero_output():
    out, lse = torch.zeros(1, 3, 2, 4), torch.full((1, 2, 3), -math.inf)
    merge_(out, lse, torch.zeros(1, 3, 2, 4), torch.full((1, 2, 3), -math.inf))
    assert bool((lse == -math.inf).all()) and torch.equal(out, torch.zeros_like(out))


def test_huge_lse_gaps_neither_overflow_nor_underflow_to_nan():
    out, lse = torch.ones(1, 2, 1, 4), torch.tensor([[[1e4, -1e4]]])
    part, lse_part = torch.full((1, 2, 1, 4), 3.0), torch.tensor([[[-1e4, 1e4]]])
    merge_(out, lse, part, lse_part)
    assert torch.equal(lse, torch.tensor([[[1e4, 1e4]]]))
    assert torch.equal(out[0, 0], torch.ones(1, 4)) and torch.equal(out[0, 1], torch.full((1, 4), 3.0))
