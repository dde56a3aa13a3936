"""The trainer with packed documents: document boundaries from the data, and a CP=2 step whose
loss and gradients equal one process's with document masking on."""
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


@pytest.mark.parametrize("layout,rope", [("zigzag", "continue"), ("document_zigzag", "restart")])
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
