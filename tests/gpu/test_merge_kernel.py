"""The ring's merge kernel (ringfa4.kernels.merge, launched by ringfa4.backends.cute.merge and
reached through ringfa4.ring.merge.merge_ on Hopper) gives the fp64 merge of the same inputs, in
place, on views like the ring's.

    python -m pytest -m gpu -q tests/gpu/test_merge_kernel.py
"""
import math

import pytest
import torch

from ringfa4.backends.cute import merge as cute_merge
from ringfa4.ring import merge

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _hopper():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs a Hopper GPU (sm_90)")
    pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed")


def _inputs(b, s, h, d, out_dtype, part_dtype, gen):
    def randn(*shape):
        return torch.randn(*shape, device="cuda", generator=gen)

    out = randn(b, 2 * s, h, d).to(out_dtype)  # the running sum; the merge takes its second half
    lse = randn(b, h, 2 * s) * 4
    part = randn(b, s, h, d).to(part_dtype)
    lse_part = randn(b, h, s) * 4
    # rows with an empty side, and rows empty on both
    lse[:, :, s::7] = -math.inf
    lse_part[:, :, 1::5] = -math.inf
    return out, lse, part, lse_part


@pytest.mark.parametrize("out_dtype,part_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
                                                  (torch.float32, torch.bfloat16), (torch.float32, torch.float32)])
@pytest.mark.parametrize("b,s,h,d", [(2, 1000, 8, 128), (1, 333, 5, 64), (1, 77, 3, 96)])
def test_merge_kernel_matches_fp64_merge_on_half_views(b, s, h, d, out_dtype, part_dtype):
    gen = torch.Generator(device="cuda").manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    out, lse, part, lse_part = _inputs(b, s, h, d, out_dtype, part_dtype, gen)
    assert cute_merge.merge_runs(out[:, s:], lse[:, :, s:], part)
    ref_out, ref_lse = merge._merged(out[:, s:].double(), lse[:, :, s:].double(), part.double(), lse_part.double())
    first = out[:, :s].clone(), lse[:, :, :s].clone()

    merge.merge_(out[:, s:], lse[:, :, s:], part, lse_part)

    assert torch.equal(out[:, :s], first[0]) and torch.equal(lse[:, :, :s], first[1]), "rows outside the view changed"
    got_out, got_lse = out[:, s:], lse[:, :, s:]
    assert torch.equal(got_lse == -math.inf, ref_lse == -math.inf)
    finite = ref_lse != -math.inf
    assert (got_lse[finite].double() - ref_lse[finite]).abs().max().item() < 1e-5
    # per element: one rounding to out's dtype plus fp32 arithmetic on terms of size ~4. An
    # element left unwritten keeps its old value, which the weights (< 1 here) would have changed.
    err = (got_out.double() - ref_out).abs()
    bound = ref_out.abs() * torch.finfo(out_dtype).eps + 4e-6
    assert torch.isfinite(got_out).all() and bool((err <= bound).all()), \
        f"{int((err > bound).sum())} elements off, worst {err.max().item():.3g}"
