"""A compact Llama-style decoder whose attention spans a context-parallel group.

Every rank holds a shard of each sequence (in the ring layout), so RoPE angles come from the
GLOBAL positions of the local tokens, passed in next to the tokens; nothing in the model
assumes its tokens are contiguous.
"""
import math
import zlib
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts, noop_context_fn

from ringfa4.nn import ops
from ringfa4.nn.attention import ContextParallelAttention
from ringfa4.nn.loss import linear_cross_entropy


@dataclass(frozen=True)
class ModelArgs:
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    tie_embeddings: bool = False

    @property
    def head_dim(self):
        return self.dim // self.n_heads

    def check(self):
        """Raise ValueError naming the first inconsistent field."""
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"model.{name} must be positive, got {getattr(self, name)}")
        if self.dim % self.n_heads:
            raise ValueError(f"model.dim={self.dim} must be a multiple of model.n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"model.n_heads={self.n_heads} must be a multiple of "
                             f"model.n_kv_heads={self.n_kv_heads} (grouped-query attention)")
        if self.head_dim % 2:
            raise ValueError(f"head dim model.dim/model.n_heads={self.head_dim} must be even for RoPE")

    def matmul_params(self):
        """Parameters that take part in a matrix product for every token (the embedding lookup does not)."""
        kv_dim = self.n_kv_heads * self.head_dim
        per_layer = 2 * self.dim * self.dim + 2 * self.dim * kv_dim + 3 * self.dim * self.ffn_dim
        return self.n_layers * per_layer + self.dim * self.vocab_size

    def flops_per_token(self, seq_len):
        """Model FLOPs of one token's forward and backward in a causal sequence of ``seq_len``.

        6 per matmul parameter, plus attention: q k^T and p v are 2 * 2 * seq_len * dim FLOPs per
        layer forward, half of it under the causal mask, and backward is twice forward. Recomputation
        under activation checkpointing is not counted (MFU, not hardware utilisation).
        """
        return 6 * self.matmul_params() + 6 * self.n_layers * self.dim * seq_len


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def rope_angles(positions, head_dim, theta):
    """cos and sin (..., s, 1, head_dim/2), fp32, for integer token positions (..., s)."""
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float64) / head_dim)
    angles = positions.to(torch.float64)[..., None] * inv_freq
    return angles.cos().float().unsqueeze(-2), angles.sin().float().unsqueeze(-2)


def apply_rope(x, cos, sin):
    """Rotate (first half, second half) pairs of each head of x (b, s, h, d) by the angles."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).type_as(x)


class Attention(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        self.core = ContextParallelAttention(causal=True)

    def forward(self, x, cos, sin, cu_seqlens=None):
        b, s, _ = x.shape
        q = apply_rope(self.wq(x).view(b, s, self.n_heads, self.head_dim), cos, sin)
        k = apply_rope(self.wk(x).view(b, s, self.n_kv_heads, self.head_dim), cos, sin)
        v = self.wv(x).view(b, s, self.n_kv_heads, self.head_dim)
        # Without documents the core is called as any attention module (q, k, v).
        out = self.core(q, k, v) if cu_seqlens is None else self.core(q, k, v, cu_seqlens)
        return self.wo(out.reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


# What backward recomputes, least first (see Block).
ACTIVATION_CHECKPOINTING = ("none", "pointwise", "selective", "full")


# What selective checkpointing keeps: our attention operators, and PyTorch's SDPA kernels, which an
# attention core may call instead (bench/train.py's comparator does), so that the same mode keeps
# the same activations whichever attention runs.
SAVED_BY_SELECTIVE_CHECKPOINTING = ops.SAVED_BY_SELECTIVE_CHECKPOINTING + (
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
)
# What "pointwise" keeps besides: the matmuls' outputs (a linear layer is one of these ops below
# autograd), so that backward recomputes only norms, RoPE and activations, which cost memory
# bandwidth, not tensor-core time, at about half the memory of keeping everything.
MATMULS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)


def _policy(saved):
    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE
    return policy


# torch.utils.checkpoint's context_fn per checkpointed mode: what each keeps. Built once, here, so
# that a compiled block finds a constant.
CHECKPOINT_CONTEXT = {
    "pointwise": partial(create_selective_checkpoint_contexts,
                         _policy(frozenset(SAVED_BY_SELECTIVE_CHECKPOINTING + MATMULS))),
    "selective": partial(create_selective_checkpoint_contexts, _policy(frozenset(SAVED_BY_SELECTIVE_CHECKPOINTING))),
    "full": noop_context_fn,
}


class Block(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args.dim, args.ffn_dim)
        # Set by parallelize (one of ACTIVATION_CHECKPOINTING): what backward recomputes.
        #   none       nothing, every activation is kept;
        #   pointwise  norms, RoPE and activations: the attention's and the matmuls' outputs are kept;
        #   selective  everything but the attention, whose outputs (out, lse and the ring's last
        #              KV block) are kept: the ring, its transfers included, runs once per step;
        #   full       everything from the block input, the attention's ring included.
        self.activation_checkpointing = "none"

    def forward(self, x, cos, sin, cu_seqlens=None):
        if self.activation_checkpointing == "none" or not torch.is_grad_enabled():
            return self._forward(x, cos, sin, cu_seqlens)
        return checkpoint(self._forward, x, cos, sin, cu_seqlens, use_reentrant=False,
                          context_fn=CHECKPOINT_CONTEXT[self.activation_checkpointing])

    def _forward(self, x, cos, sin, cu_seqlens):
        h = x + self.attention(self.attention_norm(x), cos, sin, cu_seqlens)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """tokens (b, s) and their global positions (b, s) or (s,) -> logits (b, s, vocab), or with
    labels (b, s) the sum of their next-token losses (in fp32, or fp64 for an fp64 model).
    ``cu_seqlens``: packed documents of the full sequences (ringfa4.documents): attention stays
    inside each document; RoPE takes whatever ``positions`` say.

    The loss is computed ``loss_chunk`` tokens at a time (ringfa4.nn.loss): at long context the
    full logits (tokens x vocab, in fp32 for the softmax) would outweigh every other activation.
    """

    def __init__(self, args, loss_chunk=4096):
        super().__init__()
        args.check()
        self.args = args
        self.loss_chunk = loss_chunk
        self.compile_loss = False  # set by parallelize(compile=True)
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(Block(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = None if args.tie_embeddings else nn.Linear(args.dim, args.vocab_size, bias=False)

    def forward(self, tokens, positions, labels=None, cu_seqlens=None):
        cos, sin = rope_angles(positions, self.args.head_dim, self.args.rope_theta)
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, cos, sin, cu_seqlens)
        h = self.norm(h)
        weight = self.tok_embeddings.weight if self.output is None else self.output.weight
        if labels is None:
            return F.linear(h, weight)
        return linear_cross_entropy(h, weight, labels, self.loss_chunk, compiled=self.compile_loss)

    def attention_cores(self):
        return [layer.attention.core for layer in self.layers]

    @torch.no_grad()
    def init_weights(self, seed):
        """Fill every parameter from a generator seeded by (seed, parameter name).

        Each full parameter is drawn whole and then sharded like the parameter, so a model holds
        the same weights however it is parallelized (CP=2 vs CP=1 tests and resumes at another
        world size rely on it), and it may have been built on the meta device and materialized.
        """
        args = self.args
        for name, p in self.named_parameters():
            leaf = name.rsplit(".", 2)[-2]
            if leaf in ("attention_norm", "ffn_norm", "norm"):
                full = torch.ones(p.shape, device=p.device, dtype=p.dtype)
            else:
                if leaf == "tok_embeddings":
                    # Tied: at init the residual stream is the normalised embedding itself, so a
                    # token's logit for itself is about dim * std; 1/dim keeps it near 1.
                    std = 1.0 / args.dim if args.tie_embeddings else 1.0
                elif leaf == "output":
                    std = args.dim ** -0.5
                elif leaf in ("wo", "w2"):
                    std = 0.02 / math.sqrt(2 * args.n_layers)
                else:
                    std = 0.02
                gen = torch.Generator(device=p.device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
                full = torch.empty(p.shape, device=p.device, dtype=torch.float32)
                full = full.normal_(0.0, std, generator=gen).to(p.dtype)
            if isinstance(p, DTensor):
                full = distribute_tensor(full, p.device_mesh, p.placements)
            p.copy_(full)
