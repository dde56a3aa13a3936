"""The backward kernel accumulates dQ in wgmma register ("fragment") order; the host reorders it.
This checks that reordering against the register layout the PTX ISA documents for a
m64nNk16 fp32 accumulator, built here element by element, for both ways the kernel splits a dQ
tile over its two warp groups (rows at head_dim 64, columns at 128) and for lengths that are and
are not whole tiles."""
import pytest
import torch

from ringfa4.kernels import bwd_sm90


def fragment_order(dq, tile_m):
    """Lay out dq (b, s, h, d) the way the kernel's warp groups store it: per (b, h, tile), each
    warp group's 64 x 64 part as [register group j][thread t][register 2 * hh + e]."""
    b, s, h, d = dq.shape
    n_m = -(-s // tile_m)
    padded = torch.zeros(b, n_m * tile_m, h, d, dtype=dq.dtype)
    padded[:, :s] = dq
    acc = torch.empty(b, h, n_m, 2, 8, 128, 4, dtype=dq.dtype)
    for wg in range(2):
        for j in range(8):
            for t in range(128):
                warp, r, c = t // 32, t % 32 // 4, t % 4
                for hh in range(2):
                    for e in range(2):
                        row, col = 16 * warp + 8 * hh + r, 8 * j + 2 * c + e
                        if tile_m == 128:
                            row += 64 * wg
                        else:
                            col += 64 * wg
                        acc[:, :, :, wg, j, t, 2 * hh + e] = (
                            padded[:, row::tile_m].transpose(1, 2)[..., col])
    return acc.reshape(b, h, -1)


@pytest.mark.parametrize("d,s", [(64, 256), (64, 200), (128, 128), (128, 100)])
@pytest.mark.parametrize("add", [False, True])
def test_fragment_order_dq_is_put_back_in_rows_and_columns(d, s, add):
    tile_m = bwd_sm90._tile_m(d)
    dq = torch.randn(2, s, 3, d, dtype=torch.float64)
    acc = fragment_order(dq, tile_m)
    start = torch.randn_like(dq) if add else torch.full_like(dq, float("nan"))
    dst = start.clone()
    bwd_sm90._dq_into(acc, dst, tile_m, add=add)
    torch.testing.assert_close(dst, start + dq if add else dq, rtol=0, atol=1e-12)
