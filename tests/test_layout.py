"""Sharding a sequence over ranks and gathering it back."""
import pytest
import torch

import ringfa4
from distributed import run
from ringfa4.ring.layout import chunk_ids


def test_zigzag_pairs_chunk_r_with_its_mirror_and_covers_every_chunk_once():
    for world in (1, 2, 3, 4, 8):
        held = [c for r in range(world) for c in chunk_ids(r, world, "zigzag")]
        assert sorted(held) == list(range(2 * world))
        assert all(chunk_ids(r, world, "zigzag") == (r, 2 * world - 1 - r) for r in range(world))
        assert [c for r in range(world) for c in chunk_ids(r, world, "contiguous")] == list(range(world))


def _round_trip(rank, world):
    x = torch.arange(2 * 24 * 3, dtype=torch.float64).view(2, 24, 3).requires_grad_()
    for layout, dim in (("zigzag", 1), ("contiguous", 1), ("zigzag", 2)):
        full = x if dim == 1 else x.transpose(1, 2)
        local = ringfa4.shard(full, dim=dim, layout=layout)
        step = 24 // (2 * world if layout == "zigzag" else world)
        first = full.narrow(dim, rank * step, step)
        assert torch.equal(local.narrow(dim, 0, step), first), (layout, dim)
        back = ringfa4.unshard(local, dim=dim, layout=layout)
        assert torch.equal(back, full), (layout, dim)
    # unshard is differentiable: each rank's gradient reaches its own local rows.
    local = ringfa4.shard(x, layout="zigzag").detach().requires_grad_()
    ringfa4.unshard(local, layout="zigzag").sum().backward()
    assert torch.equal(local.grad, torch.full_like(local, world))


@pytest.mark.parametrize("world", [2, 3])
def test_shard_then_unshard_gives_back_the_full_sequence(world):
    run(_round_trip, world)


def test_without_a_process_group_shard_and_unshard_are_identity():
    x = torch.randn(2, 10, 3)
    assert torch.equal(ringfa4.shard(x), x) and torch.equal(ringfa4.unshard(x), x)


def test_impossible_heads_x_ring_splits_are_named():
    from ringfa4.ring.heads import check_split
    from ringfa4.ring.layout import check_divisible, required_multiple

    check_split(32, 8, 8)
    check_split(32, 8, 4)
    check_split(32, 2, 8)  # kv heads fewer than U: each replicated to 4 members
    with pytest.raises(ValueError, match=r"q heads \(12\) must be a multiple of the head_group size \(8\)"):
        check_split(12, 4, 8)
    with pytest.raises(ValueError, match=r"k/v heads \(6\) and the head_group size \(4\) must divide one another"):
        check_split(12, 6, 4)
    assert required_multiple(9, "zigzag", 8) == 72 and required_multiple(4, "contiguous", 2) == 8
    with pytest.raises(ValueError, match=r"must be a multiple of 72 .* over 8 x 9 \(head_group x ring group\) ranks"):
        check_divisible(1 << 17, 9, "zigzag", head_world=8)
