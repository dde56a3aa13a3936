"""Ranks of a ring that disagree on what the ring depends on all raise the same named ValueError
before anything travels: none hangs, none returns a result (issue: gloo aborted one rank while the
other returned, and causal/layout mismatches returned wrong results silently)."""
import random

import pytest
import torch
import torch.distributed as dist

import ringfa4
from distributed import run
from ringfa4.ring import agree

B, CHUNK, H, D = 1, 4, 4, 16


def _qkv(world, seed, kv_heads=2, head_dim=D, dtype=torch.float64, chunk=CHUNK):
    gen = torch.Generator().manual_seed(seed)
    seq = 2 * world * chunk
    return [torch.randn(B, seq, n, head_dim, dtype=dtype, generator=gen) for n in (H, kv_heads, kv_heads)]


def _sharded(world, seed, **kw):
    return [ringfa4.shard(t) for t in _qkv(world, seed, **kw)]


# name -> (what the last rank changes, the words its error must hold). The last rank disagrees with the
# others; every rank must raise the same message.
def _cases(rank, world, seed):
    last = rank == world - 1
    return {
        "kv_heads": (dict(qkv=_sharded(world, seed, kv_heads=1 if last else 2)), "kv heads (k.shape[2])"),
        "local length": (dict(qkv=_sharded(world, seed, chunk=2 * CHUNK if last else CHUNK)),
                         "local sequence length (q.shape[1])"),
        "dtype": (dict(qkv=_sharded(world, seed, dtype=torch.float32 if last else torch.float64)), "dtype"),
        "head_dim": (dict(qkv=_sharded(world, seed, head_dim=2 * D if last else D)), "head_dim (q.shape[3])"),
        "causal": (dict(causal=not last), "causal"),
        "layout": (dict(layout="contiguous" if last else "zigzag"), "layout"),
        "softmax_scale": (dict(softmax_scale=0.5 if last else None), "softmax_scale"),
        "deterministic": (dict(deterministic=last), "deterministic"),
        "unsharded": (dict(qkv=_qkv(world, seed)), "every rank must pass its own shard"),
    }


def _each_rank_raises_the_same_error(rank, world, seed):
    for name, (change, words) in _cases(rank, world, seed).items():
        q, k, v = change.pop("qkv", None) or _sharded(world, seed)
        args = dict(causal=True, layout="zigzag", backend="torch") | change
        with pytest.raises(ValueError) as caught:
            ringfa4.ring_attention(q, k, v, **args)
        message = str(caught.value)
        assert words in message, f"rank {rank}, {name}: {message}"
        messages = [None] * world
        dist.all_gather_object(messages, message)
        assert len(set(messages)) == 1, f"{name}: ranks raised different errors {messages}"
    # The group is still usable: an agreeing call runs.
    q, k, v = _sharded(world, seed)
    out = ringfa4.ring_attention(q, k, v, causal=True, backend="torch")
    assert out.shape == q.shape and torch.isfinite(out).all()


def test_ranks_that_disagree_all_raise_the_same_named_error():
    run(_each_rank_raises_the_same_error, 3, random.randrange(2**31))


def _groups_that_overlap_are_refused(rank, world, seed):
    q, k, v = _sharded(world, seed)
    with pytest.raises(ValueError, match="group and head_group must share exactly one rank"):
        # the default group as the ring and as the head group: every rank twice
        ringfa4.ring_attention(q, k, v, head_group=dist.group.WORLD, backend="torch")


def _exchange_once_per_signature(rank, world, seed):
    gathers = []
    gather = agree._gather
    agree._gather = lambda vec, group: gathers.append(vec.numel()) or gather(vec, group)
    try:
        q, k, v = _sharded(world, seed)
        for _ in range(3):
            ringfa4.ring_attention(q, k, v, causal=True, backend="torch")
        assert len(gathers) == 1, gathers
        ringfa4.ring_attention(q, k, v, causal=False, backend="torch")  # a new signature: checked again
        assert len(gathers) == 2, gathers
    finally:
        agree._gather = gather


def _overlap_and_cache(rank, world, seed):
    _groups_that_overlap_are_refused(rank, world, seed)
    _exchange_once_per_signature(rank, world, seed)


def test_overlapping_groups_are_refused_and_agreement_is_exchanged_once_per_new_signature():
    run(_overlap_and_cache, 2, random.randrange(2**31))


def test_the_table_check_names_the_first_field_and_two_ranks():
    row = [2, 1, 1, 8, 4, 2, 16, 3, 1, 0, 0.25, 0, 1, 0, 0]
    table = [row + [r, r, 1.0, r, 2.0] for r in range(3)]
    table[2][5] = 1  # kv heads on rank 2
    with pytest.raises(ValueError, match=r"kv heads \(k.shape\[2\]\): rank 0 has 2, rank 2 has 1"):
        agree.check_table(table)
