"""A transformers LlamaForCausalLM with ringfa4's attention (ringfa4.hf) under FSDP2 x CP.

A step on cp (and dp_shard x cp) gloo ranks must give the loss and gradients of the same model run
by transformers' own SDPA attention on the full sequences in one process (fp64), with labels
shifted on the full sequence and the loss the mean over the labelled tokens of the global batch.
Packed documents (position_ids restarting at 0 per document) must give the loss and gradients of
the same model run on each document separately. What the ring cannot do yet is refused with a
named error. Needs the hf extra.
"""
import inspect

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from ringfa4 import hf  # noqa: E402
from ringfa4.nn import build_mesh  # noqa: E402
from ringfa4.nn.parallel import CP, DP_SHARD  # noqa: E402
from ringfa4.train import launch  # noqa: E402
from recompute import MatmulCount  # noqa: E402

SEQ_LEN, BATCH, VOCAB, SEED = 24, 4, 64, 1234
# Document lengths of packed rows. At cp = 2 zigzag cuts a row at 6, 12 and 18 (rank 0 holds
# [0, 6) and [18, 24)): documents cross a rank boundary (6..15 in row 0 crosses 12 inside rank 1,
# 15..22 crosses 18; 0..11 in row 1 crosses 6), have length 1 (5, 17, 18) or start on a chunk edge (18).
DOCUMENTS = ([5, 1, 9, 7, 2], [11, 6, 1, 1, 5])


def make_model(attn_implementation, tie=False, **config):
    fields = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0, tie_word_embeddings=tie)
    cfg = transformers.LlamaConfig(**{**fields, **config})
    torch.manual_seed(SEED)  # the same weights in every process
    model = transformers.LlamaForCausalLM(cfg).to(torch.float64)
    model.set_attn_implementation(attn_implementation)
    return model


def make_batch():
    gen = torch.Generator().manual_seed(SEED)
    input_ids = torch.randint(VOCAB, (BATCH, SEQ_LEN), generator=gen)
    labels = input_ids.clone()
    labels[0, :5] = hf.IGNORE_INDEX  # a prompt without loss: the global count is not b * s
    labels[3, 10:] = hf.IGNORE_INDEX
    return input_ids, labels


def reference_step(tie):
    """transformers' SDPA attention (fp64 throughout, unlike its eager softmax) on the full sequences; the loss shifts logits, not labels."""
    model = make_model("sdpa", tie)
    input_ids, labels = make_batch()
    logits = model(input_ids=input_ids, use_cache=False).logits
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=hf.IGNORE_INDEX)
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}


def packed_position_ids(rows):
    """Restarting position_ids (transformers' packed format) of the DOCUMENTS rows ``rows``."""
    return torch.stack([torch.cat([torch.arange(n) for n in DOCUMENTS[r]]) for r in rows])


def reference_documents_step(position_ids):
    """transformers' SDPA attention on every document separately (fp64): the sum of the documents'
    next-token losses over their labelled tokens, and its gradients."""
    model = make_model("sdpa")
    input_ids, labels = make_batch()
    loss_sum, count = 0.0, 0
    for r in range(BATCH):
        starts = (position_ids[r % len(position_ids)] == 0).nonzero().flatten().tolist() + [SEQ_LEN]
        for start, stop in zip(starts, starts[1:]):
            if stop - start == 1:
                continue  # a one-token document has no next token to score
            logits = model(input_ids=input_ids[r:r + 1, start:stop], use_cache=False).logits[0, :-1]
            target = labels[r, start + 1:stop]
            loss_sum = loss_sum + F.cross_entropy(logits, target, ignore_index=hf.IGNORE_INDEX, reduction="sum")
            count += int((target != hf.IGNORE_INDEX).sum())
    loss = loss_sum / count
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}


def parallel_step(dp_shard, cp, layout, tie, recompute, position_ids, rank, world, local_rank):
    import torch.distributed as dist
    torch.set_num_threads(1)  # the ranks share two CI cores
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh = build_mesh("cpu", dp_shard, cp)
        ring = hf.register(mesh[CP].get_group(), layout=layout, backend="torch")
        model = make_model(ring.name, tie)
        hf.fully_shard_model(model, mesh, activation_checkpointing=recompute)
        input_ids, labels = make_batch()
        rows = slice(mesh.get_local_rank(DP_SHARD) * BATCH // dp_shard,
                     (mesh.get_local_rank(DP_SHARD) + 1) * BATCH // dp_shard)
        if position_ids is not None and len(position_ids) > 1:
            position_ids = position_ids[rows]
        batch = ring.shard_batch(input_ids[rows], labels[rows], position_ids=position_ids)
        share = hf.causal_lm_loss(model, batch, hf.global_token_count(batch))
        share.backward()
        loss = share.detach().clone()
        dist.all_reduce(loss)
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        refused = None
        try:  # every rank's positions are wrong in these calls, so all of them refuse
            if position_ids is not None:  # packed documents without their boundaries
                model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False)
            elif layout == "zigzag":
                model(input_ids=batch["input_ids"], use_cache=False)  # transformers' default positions
        except ValueError as e:
            refused = str(e)
        return loss.item(), grads, refused
    finally:
        dist.destroy_process_group()


def assert_same_step(dp_shard, cp, layout, tie, recompute, position_ids=None):
    ref_loss, ref_grads = reference_step(tie) if position_ids is None else reference_documents_step(position_ids)
    loss, grads, refused = launch.spawn(parallel_step, dp_shard * cp, dp_shard, cp, layout, tie, recompute,
                                        position_ids)
    assert abs(loss - ref_loss) <= 1e-9 * abs(ref_loss), (loss, ref_loss)
    assert grads.keys() == ref_grads.keys()
    for name, ref in ref_grads.items():
        err = (grads[name] - ref).abs().max().item()
        assert err <= 1e-8 * ref.abs().max().item(), f"{name}: max error {err:.3e}"
    return refused


def test_cp2_zigzag_step_matches_transformers_sdpa_and_refuses_local_positions():
    refused = assert_same_step(dp_shard=1, cp=2, layout="zigzag", tie=True, recompute="full")
    assert refused is not None and "global positions of this rank's tokens" in refused


def test_dp2_x_cp2_contiguous_step_matches_transformers_sdpa():
    assert_same_step(dp_shard=2, cp=2, layout="contiguous", tie=False, recompute="selective")


def test_cp2_zigzag_packed_rows_match_each_document_run_alone_and_need_cu_seqlens():
    position_ids = packed_position_ids([r % len(DOCUMENTS) for r in range(BATCH)])  # (b, s): documents per row
    refused = assert_same_step(dp_shard=1, cp=2, layout="zigzag", tie=False, recompute="full",
                               position_ids=position_ids)
    assert refused is not None and "got no cu_seqlens" in refused


def test_cp2_document_zigzag_packed_batch_matches_each_document_run_alone_and_needs_cu_seqlens():
    position_ids = packed_position_ids([0])  # (1, s): the documents shared by the batch
    refused = assert_same_step(dp_shard=1, cp=2, layout="document_zigzag", tie=False, recompute="none",
                               position_ids=position_ids)
    assert refused is not None and "got no cu_seqlens" in refused


# ---------------------------------------------------------------- one process: refusals


@pytest.fixture(scope="module")
def ring():
    return hf.register(name="ringfa4-test", backend="torch")


def test_one_rank_matches_transformers_sdpa(ring):
    input_ids, labels = make_batch()
    batch = ring.shard_batch(input_ids, labels)
    loss = hf.causal_lm_loss(make_model(ring.name), batch, hf.global_token_count(batch))
    ref_loss, _ = reference_step(tie=False)
    assert abs(loss.item() - ref_loss) <= 1e-12 * ref_loss


def test_checkpointing_modes_recompute_what_they_say_with_the_same_gradients(ring, monkeypatch):
    """enable_checkpointing: "selective" keeps each attention's outputs, so backward recomputes the
    layers without calling the attention again ("full" calls it twice per layer), and "pointwise"
    keeps the matmuls' outputs too, so backward runs no matmul more than "none" does; the four modes
    give the same loss and gradients (fp64)."""
    from ringfa4.backends import torch_ref

    calls, forward = [], torch_ref.forward
    monkeypatch.setattr(torch_ref, "forward", lambda *args, **kwargs: calls.append(1) or forward(*args, **kwargs))
    input_ids, labels = make_batch()
    batch = ring.shard_batch(input_ids, labels)
    results = {}
    for mode in ("none", "pointwise", "selective", "full"):
        model = make_model(ring.name)
        hf.enable_checkpointing(model, mode)
        model.train()
        calls.clear()
        loss = hf.causal_lm_loss(model, batch, hf.global_token_count(batch))
        with MatmulCount() as backward_matmuls:
            loss.backward()
        results[mode] = (len(calls), backward_matmuls.calls, loss.item(),
                         {n: p.grad for n, p in model.named_parameters()})
    layers = make_model(ring.name).config.num_hidden_layers
    assert {mode: r[0] for mode, r in results.items()} == {"none": layers, "pointwise": layers, "selective": layers,
                                                           "full": 2 * layers}
    assert results["pointwise"][1] == results["none"][1] < results["selective"][1]
    for mode in ("pointwise", "selective", "full"):
        assert results[mode][2] == results["none"][2], mode
        for name, ref in results["none"][3].items():
            assert torch.allclose(results[mode][3][name], ref, rtol=1e-12, atol=1e-14), (mode, name)
    with pytest.raises(ValueError, match="activation_checkpointing must be one of none, pointwise, selective, full"):
        hf.enable_checkpointing(make_model(ring.name), True)


def test_padding_masks_are_refused_and_an_all_ones_mask_is_not(ring):
    model = make_model(ring.name)
    input_ids, _ = make_batch()
    positions = torch.arange(SEQ_LEN).unsqueeze(0)
    padded = torch.ones_like(input_ids)
    padded[1, -3:] = 0
    with pytest.raises(hf.PaddingNotSupported, match="attention_mask masks tokens"):
        ring.shard_batch(input_ids, attention_mask=padded)
    with pytest.raises(hf.PaddingNotSupported, match="attention_mask"):
        model(input_ids=input_ids, position_ids=positions, attention_mask=padded, use_cache=False)
    plain = model(input_ids=input_ids, position_ids=positions, use_cache=False).logits
    ones = model(input_ids=input_ids, position_ids=positions, attention_mask=torch.ones_like(input_ids),
                 use_cache=False).logits
    torch.testing.assert_close(ones, plain, rtol=0, atol=0)


def test_shard_batch_turns_restarts_into_cu_seqlens_and_scores_no_token_across_documents(ring):
    input_ids, labels = make_batch()
    shared = ring.shard_batch(input_ids, labels, position_ids=packed_position_ids([0]))
    assert shared["cu_seqlens"].tolist() == [0, 5, 6, 15, 22, 24] and shared["cu_seqlens"].dtype == torch.int32
    per_row = ring.shard_batch(input_ids, labels, position_ids=packed_position_ids([0, 1, 0, 1]))
    assert per_row["cu_seqlens"].tolist() == [0, 5, 6, 15, 22, 24, 35, 41, 42, 43, 48, 53, 54, 63, 70, 72,
                                              83, 89, 90, 91, 96]
    ends = [4, 5, 14, 21, 23]  # the last token of each document of row 0
    assert (shared["shift_labels"][:, ends] == hf.IGNORE_INDEX).all()
    inside = [i for i in range(SEQ_LEN) if i not in ends]
    torch.testing.assert_close(shared["shift_labels"][1:, inside], labels[1:, 1:][:, inside], rtol=0, atol=0)
    one = ring.shard_batch(input_ids, labels)
    assert one["cu_seqlens"].tolist() == [0, SEQ_LEN]


def test_one_rank_packed_loss_matches_each_document_run_alone(ring):
    position_ids = packed_position_ids([0, 1, 0, 1])
    input_ids, labels = make_batch()
    batch = ring.shard_batch(input_ids, labels, position_ids=position_ids)
    loss = hf.causal_lm_loss(make_model(ring.name), batch, hf.global_token_count(batch))
    ref_loss, _ = reference_documents_step(position_ids)
    assert abs(loss.item() - ref_loss) <= 1e-12 * ref_loss


def test_one_document_per_row_with_cu_seqlens_is_the_plain_path_bit_for_bit(ring):
    model = make_model(ring.name)
    input_ids, _ = make_batch()
    positions = torch.arange(SEQ_LEN).unsqueeze(0)
    plain = model(input_ids=input_ids, position_ids=positions, use_cache=False).logits
    dense = model(input_ids=input_ids, position_ids=positions, cu_seqlens=torch.tensor([0, SEQ_LEN], dtype=torch.int32),
                  use_cache=False).logits
    torch.testing.assert_close(dense, plain, rtol=0, atol=0)


def test_position_ids_that_jump_or_mismatch_cu_seqlens_are_refused(ring):
    model = make_model(ring.name)
    input_ids, _ = make_batch()
    jump = torch.cat([torch.arange(10), torch.arange(3, SEQ_LEN - 7)]).unsqueeze(0)  # 9 -> 3: not a restart at 0
    with pytest.raises(hf.PositionIdsError, match="step from 9 to 3 at row 0, index 10"):
        ring.shard_batch(input_ids, position_ids=jump)
    with pytest.raises(hf.PositionIdsError, match="start at 0"):
        ring.shard_batch(input_ids, position_ids=torch.arange(1, SEQ_LEN + 1).unsqueeze(0))
    with pytest.raises(ValueError, match=r"position_ids must be \(1 or 4, 24\)"):
        ring.shard_batch(input_ids, position_ids=packed_position_ids([0, 1]))
    packed = packed_position_ids([0])
    with pytest.raises(hf.PositionIdsError, match="got no cu_seqlens"):
        model(input_ids=input_ids, position_ids=packed, use_cache=False)
    other = ring.shard_batch(input_ids, position_ids=packed_position_ids([1]))["cu_seqlens"]
    with pytest.raises(hf.PositionIdsError, match="of cu_seqlens"):
        model(input_ids=input_ids, position_ids=packed, cu_seqlens=other, use_cache=False)


def test_sliding_window_shorter_than_the_sequence_is_refused(ring):
    fields = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                  num_attention_heads=4, num_key_value_heads=2)
    input_ids, _ = make_batch()
    positions = torch.arange(SEQ_LEN).unsqueeze(0)
    model = transformers.MistralForCausalLM(transformers.MistralConfig(sliding_window=SEQ_LEN - 1, **fields))
    model.set_attn_implementation(ring.name)
    with pytest.raises(hf.SlidingWindowNotSupported, match=f"sliding_window={SEQ_LEN - 1}"):
        model(input_ids=input_ids, position_ids=positions, use_cache=False)
    # A window that covers the whole sequence is plain causal attention: it runs, and agrees with sdpa.
    torch.manual_seed(SEED)
    model = transformers.MistralForCausalLM(transformers.MistralConfig(sliding_window=SEQ_LEN, **fields))
    model.set_attn_implementation("sdpa")
    sdpa = model(input_ids=input_ids, position_ids=positions, use_cache=False).logits
    model.set_attn_implementation(ring.name)
    ours = model(input_ids=input_ids, position_ids=positions, use_cache=False).logits
    torch.testing.assert_close(ours, sdpa, rtol=1e-5, atol=1e-5)


def test_attention_dropout_and_kv_caches_are_refused(ring):
    input_ids, _ = make_batch()
    positions = torch.arange(SEQ_LEN).unsqueeze(0)
    with pytest.raises(hf.UnsupportedByRing, match="attention dropout 0.1"):
        make_model(ring.name, attention_dropout=0.1).train()(input_ids=input_ids, position_ids=positions,
                                                             use_cache=False)
    model = make_model(ring.name).eval()
    # transformers 5.24 renamed past_key_values (argument and output) to cache
    name = "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"
    cache = getattr(model(input_ids=input_ids, position_ids=positions, use_cache=True), name)
    with pytest.raises(hf.UnsupportedByRing, match="KV caches"):
        model(input_ids=input_ids[:, :1], position_ids=positions[:, :1] + SEQ_LEN, **{name: cache})
