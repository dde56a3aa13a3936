"""torch.compile of the blocks with the ring inside (and of the loss's softmax): one graph for all
blocks, no breaks, the eager step's numbers.

The attention is a custom operator (ringfa4.nn.ops), so dynamo neither traces into the ring nor
breaks the graph at it, and selective checkpointing (both modes that use it) still keeps its
outputs under compile; the compiled model runs deterministic, so the flag is seen to pass through
the graph.
"""
import pytest
import torch

from ringfa4.backends import torch_ref
from ringfa4.nn import ModelArgs, Transformer, build_mesh, parallelize, shard_sequence
from ringfa4.nn import ops
from ringfa4.nn.parallel import CP
from ringfa4.train import launch
from ringfa4.train.trainer import loss_share

ARGS = ModelArgs(vocab_size=64, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=48, rope_theta=10000.0)
SEQ_LEN, BATCH, SEED = 32, 2, 7


def eager_and_compiled_step(mode, rank, world, local_rank):
    import torch.distributed as dist
    from torch._dynamo.utils import counters
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh = build_mesh("cpu", 1, world)
        ring_runs = []
        ring_forward = ops.ring_forward
        ops.ring_forward = lambda *args: ring_runs.append(1) or ring_forward(*args)
        flags, backward = [], torch_ref.backward

        def backward_spy(*args, deterministic=False, **kwargs):
            flags.append(deterministic)
            return backward(*args, deterministic=deterministic, **kwargs)

        torch_ref.backward = backward_spy
        gen = torch.Generator().manual_seed(SEED)
        samples = torch.randint(ARGS.vocab_size, (BATCH, SEQ_LEN + 1), generator=gen)
        batch = shard_sequence((samples[:, :-1], samples[:, 1:], torch.arange(SEQ_LEN).unsqueeze(0)),
                               mesh[CP].get_group(), "zigzag")
        results = {}
        for compile in (False, True):
            model = Transformer(ARGS, loss_chunk=16)  # two equal chunks of the 32 local tokens
            parallelize(model, mesh, backend="torch", activation_checkpointing=mode, compile=compile,
                        deterministic=compile)
            model.init_weights(SEED)
            ring_runs.clear()
            flags.clear()
            share = loss_share(model, *batch, BATCH * SEQ_LEN)
            share.backward()
            results[compile] = (share.item(), {n: p.grad.full_tensor() for n, p in model.named_parameters()},
                                len(ring_runs), set(flags))
        return results, dict(counters["graph_break"]), counters["stats"]["unique_graphs"]
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("mode", ["selective", "pointwise"])
def test_compiled_blocks_with_ring_attention_match_eager_in_one_graph_without_breaks(mode):
    results, graph_breaks, unique_graphs = launch.spawn(eager_and_compiled_step, 2, mode)
    assert graph_breaks == {}
    assert unique_graphs == 2  # one graph serves every block, one every loss chunk
    (eager_loss, eager_grads, eager_rings, eager_flags), (loss, grads, rings, flags) = results[False], results[True]
    assert rings == eager_rings == ARGS.n_layers  # compiled with checkpointing, the ring still runs once
    assert (eager_flags, flags) == ({False}, {True})  # what each model's ring backward steps were given
    torch.testing.assert_close(loss, eager_loss, rtol=1e-6, atol=0)
    for name, ref in eager_grads.items():
        torch.testing.assert_close(grads[name], ref, msg=name)
