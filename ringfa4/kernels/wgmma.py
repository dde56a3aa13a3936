"""Warpgroup matrix-multiply helpers (operand layouts, the wgmma call) shared by the Hopper forward and
backward kernels."""
from typing import Optional

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import const_expr
from cutlass.cute.nvgpu import warpgroup
from cutlass.tensor_utils import LayoutEnum


def smem_layout(dtype, rows: int, cols: int, stages: Optional[int] = None):
    """Swizzled (rows, cols[, stages]) shared-memory tile, cols contiguous: what TMA writes and
    wgmma reads, K-major or MN-major alike."""
    atom = warpgroup.make_smem_layout_atom(
        sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, dtype, cols), dtype
    )
    if stages is None:
        return cute.tile_to_shape(atom, (rows, cols), order=(0, 1))
    return cute.tile_to_shape(atom, (rows, cols, stages), order=(0, 1, 2))


@cute.jit
def gemm(tiled_mma: cute.TiledMma, acc: cute.Tensor, tA: cute.Tensor, tB: cute.Tensor,
         zero_init: cutlass.Constexpr[bool], wait: cutlass.Constexpr[int]):
    """acc (+)= A @ B over the whole K extent as one wgmma commit group, then wait until ``wait``
    groups remain in flight (-1: do not wait, the caller overlaps other work with it)."""
    warpgroup.fence()
    atom = cute.make_mma_atom(tiled_mma.op)
    atom.set(warpgroup.Field.ACCUMULATE, not zero_init)
    for k in cutlass.range_constexpr(cute.size(tA.shape[2])):
        cute.gemm(atom, acc, tA[None, None, k], tB[None, None, k], acc)
        atom.set(warpgroup.Field.ACCUMULATE, True)
    warpgroup.commit_group()
    if const_expr(wait >= 0):
        warpgroup.wait_group(wait)


@cute.jit
def acc_as_operand_a(acc: cute.Tensor) -> cute.Tensor:
    """View a 16-bit accumulator as the register A operand of the next wgmma (k blocks of 16), so
    P (forward) or P, dS (backward) feed the next product without a trip through shared memory:
    ((2, 2, N/8), MMA_M, MMA_N) -> ((2, 2, 2), MMA_M, (N/16, MMA_N))."""
    lay = cute.logical_divide(acc.layout, ((None, None, 2), None, None))
    return cute.make_tensor(
        acc.iterator,
        cute.make_layout(
            ((lay.shape[0][0], lay.shape[0][1], lay.shape[0][2][0]), lay.shape[1],
             (lay.shape[0][2][1], lay.shape[2])),
            stride=((lay.stride[0][0], lay.stride[0][1], lay.stride[0][2][0]), lay.stride[1],
                    (lay.stride[0][2][1], lay.stride[2])),
        ),
    )
