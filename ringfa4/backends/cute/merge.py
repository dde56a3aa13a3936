"""Launch of the ring's merge kernel (ringfa4.kernels.merge) for ringfa4.ring.merge."""
import torch

from ringfa4.backends.cute.configs import MergeConfig
from ringfa4.backends.cute.launch import capability, compiled, device_index, dsl_installed
from ringfa4.backends.cute.tensors import DTYPE_NAMES, rows_ready, tma_compatible, tma_ready


def merge_runs(out, lse, out_part):
    """Whether the kernel can merge into (out, lse): a Hopper GPU, kernel dtypes, fp32 lse with
    contiguous rows, and 16-byte aligned rows of out (the kernel's accesses)."""
    return (out.is_cuda and capability(device_index(out)) == (9, 0) and dsl_installed()
            and out.dtype in DTYPE_NAMES and out_part.dtype in DTYPE_NAMES
            and lse.dtype == torch.float32 and out.shape[-1] % 8 == 0
            and tma_compatible(out) and lse.stride(-1) == 1)


def merge_(out, lse, out_part, lse_part):
    """out, lse <- the merge of (out, lse) and (out_part, lse_part), in place (merge_runs holds)."""
    config = MergeConfig(DTYPE_NAMES[out.dtype], DTYPE_NAMES[out_part.dtype], out.shape[-1])
    compiled(config)(out, lse, tma_ready(out_part), rows_ready(lse_part))
