"""A training step of the ring-attention model under FSDP2 x CP equals the same step in one process.

The loss is the mean over every token of the global batch, so a step on dp_shard x cp ranks must
give the single-process loss and gradients on the same batch; fp64 on gloo makes the comparison
tight enough to catch any mis-scaled share, mis-sharded label or wrong RoPE position.
"""
import pytest
import torch
from hydra.errors import ConfigCompositionException

from ringfa4.backends import torch_ref
from ringfa4.nn import ContextParallelAttention, ModelArgs, Transformer, build_mesh, parallelize, shard_sequence
from ringfa4.nn.parallel import CP, DP_SHARD, head_group
from ringfa4.train import launch, trainer
from ringfa4.train.trainer import loss_share
from train_configs import SMALL, composed

SEQ_LEN, BATCH, SEED = 32, 4, 1234
LOSS_CHUNK = 5  # several loss chunks per local shard, one of them partial


def make_batch(vocab_size):
    gen = torch.Generator().manual_seed(SEED)
    samples = torch.randint(vocab_size, (BATCH, SEQ_LEN + 1), generator=gen)
    return samples[:, :-1], samples[:, 1:], torch.arange(SEQ_LEN).unsqueeze(0)


def single_process_step(args):
    model = Transformer(args, loss_chunk=LOSS_CHUNK).to(torch.float64)
    model.init_weights(SEED)
    tokens, labels, positions = make_batch(args.vocab_size)
    loss = loss_share(model, tokens, labels, positions, BATCH * SEQ_LEN)
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}


def parallel_step(args, dp_shard, cp, layout, recompute, cp_heads, rank, world, local_rank):
    import torch.distributed as dist
    with launch.process_group("cpu", rank, world, local_rank):
        mesh = build_mesh("cpu", dp_shard, cp, cp_heads)
        with torch.device("meta"):
            model = Transformer(args, loss_chunk=LOSS_CHUNK).to(torch.float64)
        parallelize(model, mesh, layout=layout, backend="torch", activation_checkpointing=recompute)
        model.to_empty(device="cpu")
        model.init_weights(SEED)
        tokens, labels, positions = make_batch(args.vocab_size)
        rows = slice(mesh.get_local_rank(DP_SHARD) * BATCH // dp_shard, (mesh.get_local_rank(DP_SHARD) + 1) * BATCH // dp_shard)
        tokens, labels, positions = shard_sequence((tokens[rows], labels[rows], positions), mesh[CP].get_group(), layout,
                                                   head_group=head_group(mesh))
        # The gradients before any optimizer step are what is compared, so not trainer.train_step.
        share = loss_share(model, tokens, labels, positions, BATCH * SEQ_LEN)
        share.backward()
        loss = share.detach().clone()
        dist.all_reduce(loss)
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        return loss.item(), grads


def assert_same_step(args, dp_shard, cp, layout, recompute, cp_heads=1):
    ref_loss, ref_grads = single_process_step(args)
    loss, grads = launch.spawn(parallel_step, dp_shard * cp, args, dp_shard, cp, layout, recompute, cp_heads)
    assert abs(loss - ref_loss) <= 1e-6 * abs(ref_loss), (loss, ref_loss)
    assert grads.keys() == ref_grads.keys()
    for name, ref in ref_grads.items():
        err = (grads[name] - ref).abs().max().item()
        assert err <= 1e-5 * ref.abs().max().item(), f"{name}: max error {err:.3e}"


def test_cp2_step_matches_one_process_zigzag_tied_gqa_with_selective_recompute():
    args = ModelArgs(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, rope_theta=10000.0,
                     tie_embeddings=True)
    assert_same_step(args, dp_shard=1, cp=2, layout="zigzag", recompute="selective")


def test_dp2_x_cp2_step_matches_one_process_contiguous_untied_mqa_uneven_shards():
    # vocab 66 and ffn 50 rows do not split evenly over the 4 FSDP ranks.
    args = ModelArgs(vocab_size=66, dim=32, n_layers=2, n_heads=4, n_kv_heads=1, ffn_dim=50, rope_theta=10000.0,
                     tie_embeddings=False)
    assert_same_step(args, dp_shard=2, cp=2, layout="contiguous", recompute="none")


@pytest.mark.parametrize("cp", [4, 2], ids=["2x2", "2x1"])
def test_heads_x_ring_step_matches_one_process_zigzag_mqa(cp):
    # cp ranks: a ring of cp / 2 over head groups of 2 (2 x 1: no ring, one call per rank); one kv
    # head (MQA) for 4 query heads, so both members of a head group get a copy of it and its
    # gradients are summed back.
    args = ModelArgs(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=1, ffn_dim=48, rope_theta=10000.0,
                     tie_embeddings=True)
    assert_same_step(args, dp_shard=1, cp=cp, layout="zigzag", recompute="selective", cp_heads=2)


@pytest.mark.parametrize("field,value,message", [
    ("n_kv_heads", 3, "model.n_heads=4 must be a multiple of model.n_kv_heads=3"),
    ("dim", 30, "model.dim=30 must be a multiple of model.n_heads=4"),
])
def test_model_args_name_the_bad_field(field, value, message):
    fields = dict(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48)
    fields[field] = value
    with pytest.raises(ValueError, match=message):
        Transformer(ModelArgs(**fields))


def spy_on_torch_backward(patch=setattr):
    """The ``deterministic`` value of every later call of the torch backend's backward, in order
    (``patch``: how the spy replaces it, monkeypatch.setattr in the test's own process)."""
    received, backward = [], torch_ref.backward

    def spy(*args, deterministic=False, **kwargs):
        received.append(deterministic)
        return backward(*args, deterministic=deterministic, **kwargs)

    patch(torch_ref, "backward", spy)
    return received


def trainer_gradients_twice(overrides, rank, world, local_rank):
    """The trainer's model and first batch for ``overrides``: the gradients of two backward passes
    and the ``deterministic`` flags the attention backend's backward received."""
    with launch.process_group("cpu", rank, world, local_rank):
        received = spy_on_torch_backward()
        run = trainer.build(composed(*SMALL, "data=synthetic", "parallel.backend=torch", *overrides),
                            torch.device("cpu"))
        tokens, labels, positions, cu_seqlens = trainer.make_batch(run, 0)
        passes = []
        for _ in range(2):
            run.model.zero_grad(set_to_none=True)
            loss_share(run.model, tokens, labels, positions, tokens.numel() * world, cu_seqlens).backward()
            passes.append({n: p.grad.full_tensor() for n, p in run.model.named_parameters()})
        return passes, received


@pytest.mark.parametrize("overrides", [[], ["parallel.cp_heads=2"]], ids=["ring", "heads_x_ring"])
def test_trainer_deterministic_reaches_every_attention_backward_and_repeats_gradients_bit_for_bit(overrides):
    # CP=2: the ring operator, or with cp_heads=2 the heads x ring operator (a one-rank ring).
    (first, second), received = launch.spawn(trainer_gradients_twice, 2, ["parallel.deterministic=true", *overrides])
    assert received and all(flag is True for flag in received), received
    for name, grad in first.items():
        assert torch.equal(grad, second[name]), name


@pytest.mark.parametrize("deterministic", [False, True])
def test_one_device_attention_core_hands_deterministic_to_the_backend_backward(deterministic, monkeypatch):
    received = spy_on_torch_backward(monkeypatch.setattr)
    gen = torch.Generator().manual_seed(SEED)
    q, k, v = (torch.randn(1, 8, heads, 4, generator=gen, requires_grad=True) for heads in (2, 1, 1))
    ContextParallelAttention(backend="torch", deterministic=deterministic)(q, k, v).sum().backward()
    assert received == [deterministic]


def test_deterministic_is_off_by_default_and_must_be_a_bool():
    assert composed().parallel.deterministic is False
    assert ContextParallelAttention().deterministic is False
    with pytest.raises(TypeError, match="deterministic must be True or False, got 'yes'"):
        ContextParallelAttention(deterministic="yes")
    model = Transformer(ModelArgs(vocab_size=64, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=48))
    with pytest.raises(TypeError, match="deterministic must be True or False, got 1"):
        parallelize(model, mesh=None, deterministic=1)
    with pytest.raises(ConfigCompositionException, match="parallel.deterministic=maybe"):
        composed("parallel.deterministic=maybe")
