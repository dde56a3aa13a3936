"""The trainer with packed documents: document boundaries from the data, a CP=2 step whose
loss and gradients equal one process's with document masking on, and logged model FLOPs that
count only the attention pairs the documents leave visible."""
import json

import pytest
import torch

from ringfa4.train import config, data, launch, trainer

MODEL = ("model.dim=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=48")


def _job(*overrides):
    return config.compose(*MODEL, "train.seq_len=64", "train.global_batch=2", "train.device=cpu",
                          "train.mixed_precision=fp32", "parallel.backend=torch", *overrides)


def _step(job, rank, world, local_rank):
    """(loss, cu_seqlens, {name: full gradient}) of one step's forward and backward on this world."""
    with launch.process_group("cpu", rank, world, local_rank) as device:
        run = trainer.build(job, device)
        batch = trainer.make_batch(run, 0)
        share = trainer.loss_share(run.model, *batch[:3], job.train.global_batch * job.train.seq_len, batch[3])
        share.backward()
        loss = share.detach().clone()
        torch.distributed.all_reduce(loss)
        return loss.item(), batch[3], {n: p.grad.full_tensor() for n, p in run.model.named_parameters()}


@pytest.mark.parametrize("layout,rope", [("zigzag", "continue"), ("document_zigzag", "restart"),
                                         ("document_balanced", "continue")])
def test_cp2_step_with_document_masking_equals_one_process(layout, rope):
    overrides = (f"parallel.layout={layout}", f"data.rope_positions={rope}")
    ref_loss, cu, ref_grads = launch.spawn(_step, 1, _job("parallel.cp=1", *overrides))
    assert cu is not None and len(cu) > 3, "the shipped corpus has several documents per 64-byte window"
    loss, _, grads = launch.spawn(_step, 2, _job("parallel.cp=2", *overrides))
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), (loss, ref_loss)
    for name, ref in ref_grads.items():
        err = (grads[name] - ref).abs().max().item()
        assert err <= 1e-4 * ref.abs().max().item(), f"{name}: max error {err:.3e}"
    unmasked, no_cu, _ = launch.spawn(_step, 1, _job("parallel.cp=1", "data.document_masking=false"))
    assert no_cu is None and unmasked != ref_loss, "document masking must change the loss"


def test_document_boundaries_follow_the_end_token_and_restart_positions():
    ends = data.DocumentBoundaries((7,))
    inputs = torch.tensor([[1, 7, 2, 3, 7, 7, 4, 5]])
    assert ends.cu_seqlens(inputs).tolist() == [0, 2, 5, 6, 8]
    assert ends.positions(inputs).tolist() == [[0, 1, 0, 1, 2, 0, 0, 1]]
    text = data.DocumentBoundaries(tuple(b"\n\n"))
    assert text.cu_seqlens(torch.tensor([list(b"ab\n\ncd\n\n"), list(b"\n\nxyzw\n\n")])).tolist() == [0, 4, 8, 10, 16]


def _logged_flops_per_step(job, tmp_path):
    """{step: model FLOPs per step since the previous record} as the run logs them in
    metrics.jsonl (two ranks)."""
    job.train.metrics, job.run_dir = ["jsonl"], str(tmp_path)
    launch.spawn(trainer.train, 2, job)
    tokens = job.train.global_batch * job.train.seq_len
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    # tflops_per_device = F / world / t / 1e12 and tokens_per_s = tokens / t: t cancels.
    return {r["step"]: r["tflops_per_device"] * 1e12 * 2 * tokens / r["tokens_per_s"] for r in records}


def _expected_flops(job, masked):
    """{step: model FLOPs} of the run's steps: 6 per matmul weight per token, and 12 * dim per
    causal (query, key) pair and layer (4 * dim forward, backward twice that); a dense row of s
    tokens counts s * s / 2 pairs, documents hide each row's s (s + 1) / 2 causal pairs less their
    own n (n + 1) / 2."""
    m, t = job.model, job.train
    with torch.device("meta"):
        model = trainer.Transformer(m.args())
    # The LM head multiplies every token by a dim x vocab matrix, tied to the embedding or not.
    matmul = sum(p.numel() for name, p in model.named_parameters() if name.startswith("layers.")
                 and p.ndim == 2) + m.dim * m.vocab_size
    s, pair = t.seq_len, 12 * m.n_layers * m.dim
    dense = 6 * matmul * t.global_batch * s + pair * t.global_batch * s * s / 2
    sampler = data.build_sampler(job.data, s, m.vocab_size, t.seed)
    separator, expected = job.data.document_separator.encode(), {}
    for step in range(1, t.steps + 1):
        hidden = 0
        for row in data.load_samples(sampler, (step - 1) * t.global_batch, t.global_batch, m.vocab_size):
            text = bytes(row[:-1].tolist())
            starts = [0] + [i + len(separator) for i in range(s - len(separator))
                            if text[i:i + len(separator)] == separator]
            lengths = [b - a for a, b in zip(starts, starts[1:] + [s])]
            hidden += s * (s + 1) // 2 - sum(n * (n + 1) // 2 for n in lengths)
        expected[step] = dense - pair * hidden if masked else dense
    return expected


@pytest.mark.parametrize("overrides,records", [
    (("parallel.cp=1", "parallel.dp_shard=2", "train.global_batch=4", "train.log_interval=2"), [(0, 2), (2, 3)]),
    (("parallel.cp=2", "train.log_interval=1"), [(0, 1), (1, 2), (2, 3)]),
], ids=["dp_shard2", "cp2"])
def test_logged_flops_count_only_the_pairs_documents_leave_visible(overrides, records, tmp_path):
    # Three steps of the shipped corpus: batches of several documents, and one whose rows are one
    # document each, which counts as dense.
    job = _job("train.steps=3", *overrides)
    assert job.data.masking
    logged, expected = _logged_flops_per_step(job, tmp_path), _expected_flops(job, masked=True)
    hidden = [dense - expected[step] for step, dense in _expected_flops(job, masked=False).items()]
    assert min(hidden) == 0 < max(hidden), hidden
    assert sorted(logged) == [last for _, last in records]
    for first, last in records:  # a record gives the mean over the steps since the previous one
        mean = sum(expected[step] for step in range(first + 1, last + 1)) / (last - first)
        assert logged[last] == pytest.approx(mean, rel=1e-12), (last, logged[last], mean)


def test_logged_flops_without_document_masking_count_dense_causal_attention(tmp_path):
    job = _job("train.steps=2", "train.log_interval=1", "parallel.cp=1", "parallel.dp_shard=2",
               "data.document_masking=false")
    logged, expected = _logged_flops_per_step(job, tmp_path), _expected_flops(job, masked=False)
    assert sorted(logged) == [1, 2]
    for step, flops in logged.items():
        assert flops == pytest.approx(expected[step], rel=1e-12), (step, flops, expected[step])


def _token_file(path, ends):
    """A token file (uint16, eod token 0) whose every 64-token window ends documents at ``ends``."""
    tokens = torch.randint(1, 200, (64 * 8 + 1,), generator=torch.Generator().manual_seed(0))
    tokens[torch.isin(torch.arange(len(tokens)) % 64, torch.tensor(ends))] = 0
    path.write_bytes(tokens.to(torch.uint16).numpy().tobytes())
    return ("data=tokens", f"data.path={path}", "data.dtype=uint16", "data.eod_token=0", "train.global_batch=1")


@pytest.mark.parametrize("parallel", [("parallel.cp=2",), ("parallel.cp=4", "parallel.cp_heads=2")],
                         ids=["ring2", "heads2_x_ring2"])
def test_a_ring_that_stops_after_its_local_step_trains_like_one_process(parallel, tmp_path):
    """One document per zigzag chunk of 16: no rank sees another's keys, so the ring (of 2, also
    inside 2 head groups) computes its local step only and ends with the KV block it started
    from, which its operators must not hand back as their own output."""
    data = _token_file(tmp_path / "tokens.bin", (15, 31, 47))
    ref_loss, cu, ref_grads = launch.spawn(_step, 1, _job("parallel.cp=1", *data))
    assert cu.tolist() == [0, 16, 32, 48, 64]
    loss, _, grads = launch.spawn(_step, 2 * len(parallel), _job(*parallel, *data))
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), (loss, ref_loss)
    for name, ref in ref_grads.items():
        err = (grads[name] - ref).abs().max().item()
        assert err <= 1e-4 * ref.abs().max().item(), f"{name}: max error {err:.3e}"


KV_BLOCK_BYTES = 2 * 32 * 2 * 8 * 4  # a rank's K and V: 32 rows x 2 kv heads x head_dim 8, fp32


@pytest.mark.parametrize("ends,per_step", [
    # Documents [0, 32), [32, 48), [48, 64) over zigzag's 2 ranks (chunks of 16: rank 0 holds 0
    # and 3, rank 1 holds 1 and 2): only rank 1 sees the other's keys (the first document spans
    # chunks 0 and 1), so in each layer's forward and backward rank 0 skips its second step, whose
    # K and V it does not read. Of rank 0's block rank 1 reads the first half: the forward sends
    # that half, the backward its dK/dV sums, and neither sends rank 1's block or its sums.
    ((31, 47), dict(run=12, skipped=4, not_read=4 * KV_BLOCK_BYTES, not_sent=6 * KV_BLOCK_BYTES)),
    # One document per chunk: no rank sees another's keys, the ring stops after the local step and
    # sends no block (forward: the K/V transfer; backward: the K/V transfer and the dK/dV sum).
    ((15, 31, 47), dict(run=8, skipped=0, not_read=0, not_sent=8 * KV_BLOCK_BYTES)),
], ids=["a_step_skipped", "ring_stopped"])
def test_a_ring_over_documents_reports_its_skipped_steps_and_the_bytes_it_did_not_move(ends, per_step, tmp_path):
    """metrics.jsonl of a CP = 2 run of 2 layers whose every 64-token window holds the same
    documents: the ring steps run and skipped and the bytes not read and not sent, summed over
    ranks and over the run so far."""
    job = _job(*_token_file(tmp_path / "tokens.bin", ends), "train.steps=3", "train.log_interval=1",
               "parallel.cp=2", "parallel.layout=zigzag")
    job.train.metrics, job.run_dir = ["jsonl"], str(tmp_path)
    launch.spawn(trainer.train, 2, job)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        got = dict(run=r["ring_steps_run"], skipped=r["ring_steps_skipped"],
                   not_read=r["ring_kv_gib_not_read"] * 2**30, not_sent=r["ring_gib_not_sent"] * 2**30)
        assert got == {key: r["step"] * value for key, value in per_step.items()}, (r["step"], got)


@pytest.mark.parametrize("overrides,message", [
    (("data=synthetic", "data.document_masking=true"), "need document boundaries"),
    (("data.document_separator=", "data.rope_positions=restart"), "need document boundaries"),
    (("data.eod_token=3",), "data.eod_token must be a token id >= 0 of data=tokens"),
    (("data.rope_positions=sometimes",), "data.rope_positions must be one of"),
])
def test_document_settings_are_checked(overrides, message):
    with pytest.raises(config.ConfigError, match=message):
        _job(*overrides)


def test_document_zigzag_needs_document_masking():
    job = _job("parallel.layout=document_zigzag", "data.document_masking=false")
    with pytest.raises(config.ConfigError, match="document_zigzag.*document_masking"):
        config.resolve(job, 2, "cpu")
