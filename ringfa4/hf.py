"""Hugging Face transformers models with ring attention (``pip install "ringfa4[hf]"``).

    ring = ringfa4.hf.register(group=mesh["cp"].get_group())            # once per process
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=ring.name)
    ringfa4.hf.fully_shard_model(model, mesh)                            # FSDP2 over (dp_shard, cp)
    batch = ring.shard_batch(input_ids, position_ids=position_ids)       # full (b, s) -> this rank's part
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

Packed documents: full-sequence position_ids that restart at 0 at every document start
(transformers' packed format, as DataCollatorWithFlattening builds it) are documents.
``shard_batch`` turns the restarts into ``cu_seqlens`` (global boundaries, ringfa4.documents) and
returns them in the batch; the model forwards them to the attention function as a keyword
(``causal_lm_loss`` passes them), which hands them to ring_attention, so a token attends to its
own document only, and RoPE restarts per document as in transformers' packed training. Restarting
position_ids without cu_seqlens are refused (PositionIdsError), never attended across.

Not supported yet, refused with a named error rather than attended across or ignored: padding
masks (PaddingNotSupported), sliding windows shorter than the sequence (SlidingWindowNotSupported),
attention dropout, logit soft-capping, attention sinks, mask patterns a model overlays on causal
attention, and KV caches (generation).
"""
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

import ringfa4
from ringfa4 import documents
from ringfa4.nn import ModelArgs, ops
from ringfa4.nn.model import ACTIVATION_CHECKPOINTING, CHECKPOINT_CONTEXT
from ringfa4.nn.parallel import fully_shard_blocks
from ringfa4.ring import documents as ring_documents
from ringfa4.ring import layout as ring_layout

IGNORE_INDEX = -100  # transformers' label for "no loss here"


class UnsupportedByRing(ValueError):
    """An input the ring attention cannot honour yet; the message names it."""


class PaddingNotSupported(UnsupportedByRing):
    pass


class SlidingWindowNotSupported(UnsupportedByRing):
    pass


class PositionIdsError(ValueError):
    """position_ids that are neither one sequence nor packed documents (a step other than +1 or a
    restart at 0), or local ones that are not this rank's share of the global positions."""


@dataclass(frozen=True)
class Ring:
    """What ``register`` set up: the attn_implementation name and the ring it runs over."""
    name: str
    group: object
    layout: str

    def shard_batch(self, input_ids, labels=None, position_ids=None, attention_mask=None):
        """This rank's part of a causal-LM batch of full sequences, in the ring's layout.

        input_ids (b, s); labels (b, s) as transformers takes them (unshifted, default input_ids,
        IGNORE_INDEX where no loss is wanted); position_ids (b or 1, s), default 0..s-1 (one
        document per row), or restarting at 0 at every document start (packed documents; any other
        step raises PositionIdsError); an attention_mask is accepted only if it masks nothing.
        Labels are shifted on the full sequence, before sharding, so the token at a shard boundary
        is scored against its true successor on the next shard; the last token of each document is
        not scored (IGNORE_INDEX), as it has no successor in its document.
        Returns a dict of local tensors: input_ids, position_ids (global per-document positions,
        for RoPE), shift_labels (the next token of each local token) and cu_seqlens (the documents'
        global boundaries, int32 on the host: ringfa4.documents' shared form for (1, s)
        position_ids, the rows concatenated for (b, s)); pass position_ids and cu_seqlens to the
        model (causal_lm_loss does).
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
        cu_seqlens = document_boundaries(position_ids, b, s)
        document_ends = F.pad(position_ids[:, 1:] == 0, (0, 1), value=True).to(labels.device)
        shift_labels = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX).masked_fill(document_ends, IGNORE_INDEX)
        ring_layout.check_divisible(s, self._world(), self.layout, name="input_ids.shape[1]")
        local = {"input_ids": input_ids, "position_ids": position_ids, "shift_labels": shift_labels}
        local = {key: ringfa4.shard(t, dim=1, group=self.group, layout=self.layout, cu_seqlens=cu_seqlens)
                 for key, t in local.items()}
        return {**local, "cu_seqlens": cu_seqlens}

    def _world(self):
        return ring_layout.group_rank_world(self.group)[1]


def document_boundaries(position_ids, batch, seq_len):
    """cu_seqlens (int32, host) of full sequences whose position_ids (batch or 1, seq_len) count up
    by 1 within a document and restart at 0 at the next: one set shared by the batch for one row
    of position_ids, the rows concatenated (FlashAttention's packed batch) for one per row."""
    if position_ids.dim() != 2 or position_ids.shape[0] not in (1, batch) or position_ids.shape[1] != seq_len:
        raise ValueError(f"position_ids must be (1 or {batch}, {seq_len}) like input_ids, "
                         f"got shape {tuple(position_ids.shape)}")
    positions = position_ids.cpu()
    if bool((positions[:, 0] != 0).any()):
        raise PositionIdsError(f"position_ids must start at 0 in every row, got {positions[:, 0].tolist()}")
    bad = ((positions.diff(dim=1) != 1) & (positions[:, 1:] != 0)).nonzero()
    if len(bad):
        row, i = bad[0].tolist()
        raise PositionIdsError(f"position_ids step from {positions[row, i].item()} to {positions[row, i + 1].item()} "
                               f"at row {row}, index {i + 1}: within a document they count up by 1, and a new "
                               "document (packed sequences) restarts at 0")
    return documents.from_starts(positions == 0)


def _document_positions(rows):
    """(b, s) int64: every position's offset in its document, per row of boundaries."""
    return torch.stack([torch.cat([torch.arange(stop - start) for start, stop in zip(row, row[1:])]) for row in rows])


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
    """transformers' attention-function signature around ringfa4's attention operators (ringfa4.nn.ops)."""

    def __init__(self, ring, backend):
        self.ring, self.backend = ring, backend
        self._checked = None  # weak references to the last position_ids and cu_seqlens found right, host cu_seqlens

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
        cu_seqlens = self._documents(kwargs.get("position_ids"), kwargs.get("cu_seqlens"), query.shape[0],
                                     query.shape[2], world)
        causal = kwargs.get("is_causal")
        causal = getattr(module, "is_causal", True) if causal is None else causal
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))
        scale = q.shape[-1] ** -0.5 if scaling is None else float(scaling)
        # ringfa4's custom operators, as ringfa4.nn's attention calls them: one call that selective
        # checkpointing keeps (enable_checkpointing), so that backward never runs the ring again.
        if world == 1:
            return ops.attention(q, k, v, causal, scale, self.backend, False, cu_seqlens)[0], None
        group = self.ring.group if self.ring.group is not None else dist.group.WORLD
        return ops.ring_attention(q, k, v, causal, scale, group.group_name, self.ring.layout, self.backend, False,
                                  cu_seqlens)[0], None

    def _documents(self, position_ids, cu_seqlens, batch, local_len, world):
        """cu_seqlens on the host for ring_attention (None: one document per row), once the local
        tokens are found to carry the global per-document positions shard_batch gives them (RoPE
        reads them). Checked once per forward: the layers get the same two tensors."""
        if position_ids is None:
            raise ValueError("the model passes no position_ids to its attention function, so ring attention "
                             "cannot check that its tokens carry global positions; this model is not supported")
        if self._checked is not None and _is(self._checked[0], position_ids) and _is(self._checked[1], cu_seqlens):
            return self._checked[2]
        layout, seq_len = self.ring.layout, local_len * world
        if cu_seqlens is None and layout in documents.LAYOUTS:
            raise ValueError(f"layout {layout!r} follows the documents, but the model got no cu_seqlens: pass "
                             "Ring.shard_batch's cu_seqlens to the model (causal_lm_loss does)")
        host = None if cu_seqlens is None else cu_seqlens.cpu()
        rows = ([[0, seq_len]] * batch if host is None
                else documents.row_boundaries(host, batch, seq_len, torch.device("cpu")))
        if position_ids.dim() != 2 or position_ids.shape[0] not in (1, batch) or position_ids.shape[1] != local_len:
            raise ValueError(f"position_ids must be (1 or {batch}, {local_len}) like the local tokens, "
                             f"got shape {tuple(position_ids.shape)}")
        held = ring_documents.positions(rows, ring_layout.group_rank_world(self.ring.group)[0], world, layout, seq_len)
        expected = _document_positions(rows).gather(1, held).to(position_ids.device)
        if not bool((position_ids == expected).all()):
            raise PositionIdsError(
                f"position_ids must be the global positions of this rank's tokens in layout {layout!r}, per "
                f"document ({'one per row: the model got no cu_seqlens' if host is None else 'of cu_seqlens'}); "
                f"pass Ring.shard_batch's position_ids and cu_seqlens to the model (causal_lm_loss does); got "
                f"{position_ids[0, :8].tolist()}..., expected {expected[0, :8].tolist()}...")
        self._checked = (weakref.ref(position_ids), None if cu_seqlens is None else weakref.ref(cu_seqlens), host)
        return host


def _is(ref, tensor):
    """Whether the weak reference ``ref`` (None: no tensor) still points at ``tensor``."""
    return tensor is None if ref is None else ref() is tensor


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
    """This rank's share of the mean next-token loss over the global batch (Ring.shard_batch's; the
    last token of each document is not scored): the sum of its tokens' losses divided by
    ``num_tokens``, the global count. Shares add up to the loss over ranks, and so do their
    gradients (fully_shard_model sums them rather than averaging)."""
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                   cu_seqlens=batch["cu_seqlens"], use_cache=False).logits
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    loss_sum = F.cross_entropy(logits.flatten(0, 1), batch["shift_labels"].flatten(), ignore_index=IGNORE_INDEX,
                               reduction="sum")
    return loss_sum / num_tokens


def enable_checkpointing(model, mode):
    """transformers' activation checkpointing of a model's decoder layers, ``mode`` one of
    ringfa4.nn.model.ACTIVATION_CHECKPOINTING: "full" recomputes each layer in backward, its
    attention (and a ring's transfers) included; "selective" recomputes all but the attention,
    whose outputs are kept (ours, or PyTorch SDPA's where the model runs transformers' "sdpa");
    "pointwise" keeps the matmuls' outputs too, recomputing only norms, RoPE and activations;
    "none" keeps every activation."""
    if mode not in ACTIVATION_CHECKPOINTING:
        raise ValueError(f"activation_checkpointing must be one of {', '.join(ACTIVATION_CHECKPOINTING)}; got {mode!r}")
    if mode == "none":
        return
    kwargs = {"use_reentrant": False, "context_fn": CHECKPOINT_CONTEXT[mode]}
    if hasattr(model, "activation_checkpointing_enable"):  # the name since transformers 5.x; the old one warns
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def fully_shard_model(model, mesh, *, param_dtype=None, activation_checkpointing="none"):
    """FSDP2 for a transformers model over every rank of a (dp_shard, cp) mesh (ringfa4.nn.build_mesh),
    with ``activation_checkpointing`` as enable_checkpointing takes it.

    Each block that transformers keeps whole (``model._no_split_modules``: decoder layers) is its own
    unit (ringfa4.nn.parallel.fully_shard_blocks); gradients are summed over ranks, since each
    rank's loss is already its share (causal_lm_loss).
    """
    blocks = [m for m in model.modules() if type(m).__name__ in set(model._no_split_modules or ())]
    if not blocks:
        raise ValueError(f"{type(model).__name__} names no block class in _no_split_modules to shard by")
    enable_checkpointing(model, activation_checkpointing)
    return fully_shard_blocks(model, blocks, mesh, param_dtype)


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
