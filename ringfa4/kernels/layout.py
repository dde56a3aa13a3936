"""Views of CuTe tensors that the Hopper kernels share: mode permutations of global tensors,
transposes and carving of shared-memory tiles, and the wgmma accumulator seen as rows x columns.
Every function returns a view over the same storage; no data moves."""
import cutlass.cute as cute
from cutlass import const_expr


def select_modes(t: cute.Tensor, modes) -> cute.Tensor:
    """t with its modes reordered (a view)."""
    return cute.make_tensor(t.iterator, cute.select(t.layout, mode=modes))


def seq_major(t: cute.Tensor) -> cute.Tensor:
    """(b, s, h, d) -> (s, d, h, b): the two tiled modes first, as TMA and local_tile want."""
    return select_modes(t, [1, 3, 2, 0])


def rows_major(t: cute.Tensor) -> cute.Tensor:
    """(b, h, s) -> (s, h, b): per-row statistics (lse, delta) with the tiled mode first."""
    return select_modes(t, [2, 1, 0])


def pack_heads(t: cute.Tensor, group: int, head_mode: int) -> cute.Tensor:
    """(seq, ..., heads, ...) -> ((group, seq), ..., heads / group, ...): the ``group`` query
    heads of each kv head become the fast part of the row mode (pack-GQA), so that a tile of
    rows holds positions x heads of one kv head. Rows of one position are contiguous heads in
    (b, s, h, d) storage: TMA moves such a tile as one box."""
    shape, stride = list(t.shape), list(t.stride)
    shape[0], stride[0] = (group, shape[0]), (stride[head_mode], stride[0])
    shape[head_mode], stride[head_mode] = shape[head_mode] // group, stride[head_mode] * group
    return cute.make_tensor(t.iterator, cute.make_layout(tuple(shape), stride=tuple(stride)))


def transpose(t: cute.Tensor) -> cute.Tensor:
    """Swap the first two modes of a shared-memory tile (the MN-major view of a K-major tile)."""
    shape = (t.shape[1], t.shape[0], *t.shape[2:])
    order = (1, 0, *range(2, cute.rank(t)))
    return cute.composition(t, cute.make_ordered_layout(shape, order=order))


def carve(ptr, layout: cute.ComposedLayout, dtype) -> cute.Tensor:
    """The swizzled shared-memory tile ``layout`` of ``dtype`` elements at ``ptr``."""
    return cute.make_tensor(cute.recast_ptr(ptr, layout.inner, dtype=dtype), layout.outer)


def acc_rows_view(acc: cute.Tensor, transpose: bool = False) -> cute.Tensor:
    """A wgmma accumulator ((2, 2, N/8), MMA_M, MMA_N) as (rows, cols) of this thread's part of
    the product; with ``transpose``, as (rows, cols) of the product's transpose."""
    lay = cute.make_layout(acc.layout.shape)
    shape = ((lay.shape[0][1], lay.shape[1]), (lay.shape[0][0], lay.shape[0][2], lay.shape[2]))
    stride = ((lay.stride[0][1], lay.stride[1]), (lay.stride[0][0], lay.stride[0][2], lay.stride[2]))
    if const_expr(transpose):
        shape, stride = (shape[1], shape[0]), (stride[1], stride[0])
    return cute.make_tensor(
        acc.iterator, cute.composition(acc.layout, cute.make_layout(shape, stride=stride))
    )
