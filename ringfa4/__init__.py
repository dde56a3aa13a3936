"""ringfa4: exact context-parallel (ring) attention with FlashAttention-4-style kernels."""
from ringfa4.api import attention, ring_attention
from ringfa4.ring.comm import nccl_options
from ringfa4.ring.layout import shard, unshard

__all__ = ["attention", "ring_attention", "shard", "unshard", "nccl_options"]
