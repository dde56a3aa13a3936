"""Hugging Face transformers models with ring attention (``pip install "ringfa4[hf]"``).

    ring = ringfa4.hf.register(group=mesh["cp"].get_group())            # once per process
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=ring.name)
    ringfa4.hf.fully_shard_model(model, mesh)                            # FSDP2 over (dp_shard, cp)
    batch = ring.shard_batch(input_ids)                                  # full (b, s) -> this rank's part
    loss = ringfa4.hf.causal_lm_loss(model, batch, ringfa4.hf.global_token_count(batch))
    loss.backward()                                                      # its share of the global mean

``register`` puts a function into transformers' attention registry (AttentionInterface) and a mask
function into its mask registry under one name; a model built with ``attn_implementation=<name>``
calls them for every attention layer, with nothing patched. Keys and values reach the function with
their own (kv) head count and go around the ring that way: grouped-query heads are never repeated.

Positions and RoPE: each rank holds its tokens of every sequence in the ring layout (zigzag: two
chunks, far apart), and the model computes RoPE angles from ``position_ids`` directly, so the local
tokens must carry their GLOBAL positions. ``shard_batch`` shards position_ids like the tokens, and
the attention function refuses any other positions (transformers' default, arange over the local
tokens, is one), checked once per forward on layer inputs that share one position_ids tensor.

Not supported yet, refused with a named error rather than attended across or ignored: padding
masks (PaddingNotSupported), packed documents whose position_ids restart per document
(PackedSequencesNotSupported; they will map onto ring_attention's ``cu_seqlens``: shard_batch
turns the restarts of the full position_ids into document boundaries and the attention function
passes them on), sliding windows shorter than the sequence (SlidingWindowNotSupported), attention
dropout, logit soft-capping, attention sinks, mask patterns a model overlays on causal attention,
and KV caches (generation).
"""
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

import ringfa4
from ringfa4.nn import ModelArgs
from ringfa4.nn.parallel import fully_shard_blocks
from ringfa4.ring import layout as ring_layout

IGNORE_INDEX = -100  # transformers' label for "no loss here"


class UnsupportedByRing(ValueError):
    """An input the ring attention cannot honour yet; the message names it."""


class PaddingNotSupported(UnsupportedByRing):
    pass


class PackedSequencesNotSupported(UnsupportedByRing):
    pass


class SlidingWindowNotSupported(UnsupportedByRing):
    pass


@dataclass(frozen=True)
class Ring:
    """What ``register`` set up: the attn_implementation name and the ring it runs over."""
    name: str
    group: object
    layout: str

    def shard_batch(self, input_ids, labels=None, position_ids=None, attention_mask=None):
        """This rank's part of a causal-LM batch of full sequences, in the ring's layout.

        input_ids (b, s); labels (b, s) as transformers takes them (unshifted, default input_ids,
        IGNORE_INDEX where no loss is wanted); position_ids (b or 1, s), default 0..s-1; an
        attention_mask is accepted only if it masks nothing. Labels are shifted on the full
        sequence, before sharding, so the token at a shard boundary is scored against its true
        successor on the next shard. Returns a dict of local tensors: input_ids, position_ids
        (global positions, for RoPE) and shift_labels (the next token of each local token).
        """
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be (batch, seq), got shape {tuple(input_ids.shape)}")
        b, s = input_ids.shape
        if labels is None:
            labels = input_ids
        if labels.shape != input_ids.shape:
            raise ValueError(f"labels must have input_ids' shape {(b, s)}, got {tuple(labels.shape)}")
        if attention_mask is not None and not bool(attention_mask.all()):
            raise PaddingNotSupported("attention_mask masks tokens (padding), which ring attention does not "
                                      "support yet: pack full sequences instead, or drop the mask")
        if position_ids is None:
            position_ids = torch.arange(s, device=input_ids.device).unsqueeze(0)
        _check_one_sequence(position_ids, s)
        shift_labels = torch.cat([labels[:, 1:], labels.new_full((b, 1), IGNORE_INDEX)], dim=1)
        ring_layout.check_divisible(s, self._world(), self.layout, name="input_ids.shape[1]")
        local = {"input_ids": input_ids, "position_ids": position_ids, "shift_labels": shift_labels}
        return {key: ringfa4.shard(t, dim=1, group=self.group, layout=self.layout) for key, t in local.items()}

    def _world(self):
        return ring_layout.group_rank_world(self.group)[1]


def _check_one_sequence(position_ids, seq_len):
    """position_ids of full sequences must be 0..seq_len-1 in every row."""
    if position_ids.dim() != 2 or position_ids.shape[1] != seq_len:
        raise ValueError(f"position_ids must be (batch or 1, {seq_len}), got shape {tuple(position_ids.shape)}")
    if bool((position_ids.diff(dim=1) != 1).any()):
        raise PackedSequencesNotSupported(
            "position_ids restart or jump inside a sequence (packed documents): ring attention has no document "
            "masking yet and would attend across documents; give one document per sequence")
    if bool((position_ids[:, 0] != 0).any()):
        raise ValueError(f"position_ids must start at 0 in every row, got {position_ids[:, 0].tolist()}")


def register(group=None, *, layout="zigzag", backend="auto", name="ringfa4"):
    """Register ring attention over ``group`` (None: the default process group, as in
    ringfa4.ring_attention) with transformers under ``name``; returns the Ring to build models with
    (``attn_implementation=ring.name``) and to shard batches. Registering a name again replaces it."""
    ring_layout.check_layout(layout)
    ring = Ring(name, group, layout)
    AttentionInterface.register(name, _RingAttention(ring, backend))
    AttentionMaskInterface.register(name, _padding_mask_only)
    return ring


def _padding_mask_only(*, kv_length, attention_mask=None, use_vmap=False, **kwargs):
    """transformers' mask hook for our name. Causality is the attention function's own flag, so no
    mask is built; a padding mask is passed on for the attention function to refuse (a name without
    a mask hook would get None and silently attend to padding). transformers passes every argument
    by keyword; which ones differs between 5.x releases, and only these three are read."""
    if use_vmap:  # set exactly when a model overlays or/and mask functions on the causal pattern
        raise UnsupportedByRing("the model overlays its own mask pattern on causal attention "
                                "(or_mask_function / and_mask_function), which ring attention cannot apply")
    if attention_mask is not None and attention_mask.shape[-1] == kv_length and bool(attention_mask.all()):
        return None
    return attention_mask


class _RingAttention:
    """transformers' attention-function signature around ringfa4.ring_attention."""

    def __init__(self, ring, backend):
        self.ring, self.backend = ring, backend
        self._checked_positions = None  # weak reference to the last position_ids found right

    def __call__(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        # query (b, h, s, d), key/value (b, hk, s, d) -> ringfa4's (b, s, heads, d) views.
        if attention_mask is not None:
            raise PaddingNotSupported(f"attention_mask of shape {tuple(attention_mask.shape)} masks tokens "
                                      "(padding or a custom 4-D mask), which ring attention does not support yet")
        if dropout:
            raise UnsupportedByRing(f"attention dropout {dropout} is not supported: set config.attention_dropout=0")
        for arg in ("softcap", "s_aux"):
            if kwargs.get(arg) is not None:
                raise UnsupportedByRing(f"{arg} (logit soft-capping / attention sinks) is not supported by ring attention")
        if key.shape[2] != query.shape[2]:
            raise UnsupportedByRing(f"keys ({key.shape[2]}) and queries ({query.shape[2]}) differ in length: "
                                    "KV caches (generation) are not supported; pass use_cache=False")
        world = self.ring._world()
        global_len = query.shape[2] * world
        window = kwargs.get("sliding_window", getattr(module, "sliding_window", None))
        if window is not None and window < global_len:
            raise SlidingWindowNotSupported(f"sliding_window={window} is shorter than the sequence ({global_len} "
                                            "tokens): ring attention has no sliding windows yet")
        self._check_positions(kwargs.get("position_ids"), query.shape[2], world)
        causal = kwargs.get("is_causal")
        causal = getattr(module, "is_causal", True) if causal is None else causal
        out = ringfa4.ring_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                                     causal=causal, softmax_scale=scaling, group=self.ring.group,
                                     layout=self.ring.layout, backend=self.backend)
        return out, None

    def _check_positions(self, position_ids, local_len, world):
        """The local tokens must carry the global positions shard_batch gives them (RoPE reads them)."""
        if position_ids is None:
            raise ValueError("the model passes no position_ids to its attention function, so ring attention "
                             "cannot check that its tokens carry global positions; this model is not supported")
        if self._checked_positions is not None and self._checked_positions() is position_ids:
            return
        if position_ids.dim() != 2 or position_ids.shape[1] != local_len:
            raise ValueError(f"position_ids must be (batch or 1, {local_len}) like the local tokens, "
                             f"got shape {tuple(position_ids.shape)}")
        expected = torch.arange(local_len * world, device=position_ids.device)
        expected = ringfa4.shard(expected, dim=0, group=self.ring.group, layout=self.ring.layout)
        if not bool((position_ids == expected).all()):
            chunks = position_ids.unflatten(1, (len(ring_layout.chunk_ids(0, world, self.ring.layout)), -1))
            if bool((chunks.diff(dim=2) != 1).any()):
                raise PackedSequencesNotSupported(
                    "position_ids restart inside a sequence (packed documents): ring attention has no document "
                    "masking yet and would attend across documents")
            raise ValueError(f"position_ids must be the global positions of this rank's tokens in layout "
                             f"{self.ring.layout!r} (pass Ring.shard_batch's position_ids to the model); got "
                             f"{position_ids[0, :8].tolist()}..., expected {expected[:8].tolist()}...")
        self._checked_positions = weakref.ref(position_ids)


def global_token_count(batch, group=None):
    """Labelled tokens (not IGNORE_INDEX) of the global batch: the sum over ``group`` (None: every
    rank, i.e. all of dp_shard x cp) of each rank's local count. One all-reduce."""
    count = (batch["shift_labels"] != IGNORE_INDEX).sum()
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(count, group=group)
    if int(count) == 0:
        raise ValueError("the global batch has no labelled token (every label is IGNORE_INDEX)")
    return count


def causal_lm_loss(model, batch, num_tokens):
    """This rank's share of the mean next-token loss over the global batch: the sum of its tokens'
    losses divided by ``num_tokens``, the global count. Shares add up to the loss over ranks, and so
    do their gradients (fully_shard_model sums them rather than averaging)."""
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    loss_sum = F.cross_entropy(logits.flatten(0, 1), batch["shift_labels"].flatten(), ignore_index=IGNORE_INDEX,
                               reduction="sum")
    return loss_sum / num_tokens


def fully_shard_model(model, mesh, *, param_dtype=None, activation_checkpointing=False):
    """FSDP2 for a transformers model over every rank of a (dp_shard, cp) mesh (ringfa4.nn.build_mesh).

    Each block that transformers keeps whole (``model._no_split_modules``: decoder layers) is its own
    unit (ringfa4.nn.parallel.fully_shard_blocks); gradients are summed over ranks, since each
    rank's loss is already its share (causal_lm_loss).
    """
    blocks = [m for m in model.modules() if type(m).__name__ in set(model._no_split_modules or ())]
    if not blocks:
        raise ValueError(f"{type(model).__name__} names no block class in _no_split_modules to shard by")
    if activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return fully_shard_blocks(model, blocks, mesh, param_dtype)
    return model


def flops_per_token(config, seq_len):
    """Model FLOPs of one token's forward and backward in a causal sequence of ``seq_len`` for a
    Llama-architecture transformers config, counted as ringfa4.nn.ModelArgs counts them (6 per
    matmul parameter, plus attention; recomputation not counted)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if head_dim * config.num_attention_heads != config.hidden_size:
        raise ValueError(f"head_dim {head_dim} x {config.num_attention_heads} heads != hidden_size "
                         f"{config.hidden_size}: not a Llama-shaped config, whose FLOPs this counts")
    return ModelArgs(vocab_size=config.vocab_size, dim=config.hidden_size, n_layers=config.num_hidden_layers,
                     n_heads=config.num_attention_heads, n_kv_heads=config.num_key_value_heads,
                     ffn_dim=config.intermediate_size,
                     tie_embeddings=bool(config.tie_word_embeddings)).flops_per_token(seq_len)
