"""What the ring sends, counted on gloo: the forward moves W - 1 KV blocks; the turned-around
backward moves only W - 2 (it starts on the forward's last block and ends on the local one) plus
W - 1 hops of dK/dV sums, in the input dtype for W = 2 (one rounding, half the bytes of fp32)."""
import random

import pytest
import torch

import ringfa4
from distributed import run
from ringfa4.ring import comm


def _count_sends(rank, world, seed, dtype):
    sent = []
    start = comm.Ring.start

    def counting(self, send, recv, send_rows=slice(None), recv_rows=slice(None), tag=0, span=None):
        sent.append((span[0], span[2], tuple(t.dtype for t in send), tuple(t[:, send_rows].shape for t in send)))
        return start(self, send, recv, send_rows, recv_rows, tag, span)

    comm.Ring.start = counting
    try:
        gen = torch.Generator().manual_seed(seed)
        q, k, v, dout = (torch.randn(1, 8 * world, n, 16, dtype=dtype, generator=gen) for n in (4, 2, 2, 4))
        local = [ringfa4.shard(t).requires_grad_() for t in (q, k, v)]
        out = ringfa4.ring_attention(*local, causal=True, backend="torch")
        torch.autograd.grad(out, local, ringfa4.shard(dout))
    finally:
        comm.Ring.start = start
    kv_shape = tuple(local[1].shape)
    count = {key: sum(1 for p, kind, _, _ in sent if (p, kind) == key) for key in
             (("fwd", "kv"), ("bwd", "kv"), ("bwd", "dkv"))}
    assert count == {("fwd", "kv"): world - 1, ("bwd", "kv"): world - 2, ("bwd", "dkv"): world - 1}, count
    assert all(shapes == (kv_shape, kv_shape) for _, _, _, shapes in sent)
    sum_dtype = dtype if world == 2 else torch.promote_types(dtype, torch.float32)
    assert all(dtypes == (sum_dtype, sum_dtype) for p, kind, dtypes, _ in sent if kind == "dkv")


@pytest.mark.parametrize("world", [2, 3])
def test_backward_moves_w_minus_2_kv_blocks_and_w_minus_1_gradient_hops(world):
    run(_count_sends, world, random.randrange(2**31), torch.float32)


def test_two_rank_gradient_sums_travel_in_the_input_dtype():
    run(_count_sends, 2, random.randrange(2**31), torch.bfloat16)
