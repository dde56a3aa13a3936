"""Activation checkpointing modes give the same step, and selective never runs the ring twice.

CP = 2 over gloo in fp64: the four modes must give the same loss and gradients, and counting the
ring's forward and backward runs and the matmuls backward runs shows what each mode recomputes.
"""
import pytest
import torch

from ringfa4.nn import ModelArgs, Transformer, build_mesh, parallelize, shard_sequence
from ringfa4.nn import ops
from ringfa4.nn.parallel import CP
from ringfa4.train import launch
from ringfa4.train.trainer import loss_share
from recompute import MatmulCount

ARGS = ModelArgs(vocab_size=64, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=48, rope_theta=10000.0)
SEQ_LEN, BATCH, SEED = 32, 2, 7
MODES = ("none", "pointwise", "selective", "full")


class Counted:
    """Wraps a function and counts its calls."""

    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.fn(*args, **kwargs)


def batch():
    gen = torch.Generator().manual_seed(SEED)
    samples = torch.randint(ARGS.vocab_size, (BATCH, SEQ_LEN + 1), generator=gen)
    return samples[:, :-1], samples[:, 1:], torch.arange(SEQ_LEN).unsqueeze(0)


def step_per_mode(rank, world, local_rank):
    import torch.distributed as dist
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh = build_mesh("cpu", 1, world)
        ops.ring_forward, ops.ring_backward = Counted(ops.ring_forward), Counted(ops.ring_backward)
        results = {}
        for mode in MODES:
            model = Transformer(ARGS, loss_chunk=24).to(torch.float64)
            parallelize(model, mesh, backend="torch", activation_checkpointing=mode)
            model.init_weights(SEED)
            mlp_runs = Counted(None)
            for layer in model.layers:
                # w1, not the whole FeedForward: recomputation stops at the last tensor backward needs,
                # before the MLP's output, so a hook on the MLP itself would not see it.
                layer.feed_forward.w1.register_forward_hook(lambda *_: setattr(mlp_runs, "calls", mlp_runs.calls + 1))
            tokens, labels, positions = shard_sequence(batch(), mesh[CP].get_group(), "zigzag")
            before = ops.ring_forward.calls, ops.ring_backward.calls
            share = loss_share(model, tokens, labels, positions, BATCH * SEQ_LEN)
            with MatmulCount() as backward_matmuls:
                share.backward()
            runs = (ops.ring_forward.calls - before[0], ops.ring_backward.calls - before[1], mlp_runs.calls,
                    backward_matmuls.calls)
            loss = share.detach().clone()
            dist.all_reduce(loss)
            results[mode] = (loss.item(), {n: p.grad.full_tensor() for n, p in model.named_parameters()}, runs)
        return results
    finally:
        dist.destroy_process_group()


def test_checkpointing_modes_give_the_same_step_and_recompute_what_they_say():
    results = launch.spawn(step_per_mode, 2)
    layers = ARGS.n_layers
    # (forward rings, backward rings, MLP forwards, matmuls in backward) per step
    backward = results["none"][2][3]
    assert results["none"][2][:3] == (layers, layers, layers)
    # pointwise reruns the blocks' Python, but each matmul's output is kept, so no matmul reruns
    assert results["pointwise"][2] == (layers, layers, 2 * layers, backward)
    # selective keeps the attention's outputs and recomputes the rest: q, k, v, the output projection
    # and the MLP's two input projections (not its output projection, whose result backward never needs)
    assert results["selective"][2] == (layers, layers, 2 * layers, backward + 6 * layers)
    assert results["full"][2][:3] == (2 * layers, layers, 2 * layers)  # full reruns every forward ring
    ref_loss, ref_grads, _ = results["none"]
    for mode in ("pointwise", "selective", "full"):
        loss, grads, _ = results[mode]
        assert abs(loss - ref_loss) <= 1e-12 * abs(ref_loss), (mode, loss, ref_loss)
        for name, ref in ref_grads.items():
            torch.testing.assert_close(grads[name], ref, rtol=1e-10, atol=1e-13, msg=f"{mode}: {name}")


def test_unknown_checkpointing_mode_is_named():
    with pytest.raises(ValueError, match="activation_checkpointing must be one of .*'selective'.*got True"):
        parallelize(Transformer(ARGS), mesh=None, activation_checkpointing=True)
