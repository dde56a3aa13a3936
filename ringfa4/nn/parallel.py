"""FSDP2 x context parallelism over a 2-D device mesh (dp_shard, cp), as torchtitan lays it out.

Parameters are sharded over all dp_shard * cp ranks (the mesh flattened): context-parallel ranks
hold different tokens of the same samples, so for parameters and gradients they are just more
data-parallel ranks. Attention is the only place the cp dimension shows: its ring runs over the
"cp" sub-mesh.
"""
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

import ringfa4
from ringfa4.api import _check_flag
from ringfa4.nn.model import ACTIVATION_CHECKPOINTING

DP_SHARD, CP, DP_SHARD_CP = "dp_shard", "cp", "dp_shard_cp"
CP_HEADS = "cp_heads"  # the head group of 2-D context parallelism (ringfa4.ring.heads)


def build_mesh(device_type, dp_shard, cp, cp_heads=1):
    """The (dp_shard, cp) mesh over all ranks; neighbours in cp are consecutive ranks, so on a
    node (or an NVL72 domain) the ring stays on its fastest links when cp divides its GPU count.

    With ``cp_heads`` > 1, the cp ranks of a sequence form a (cp / cp_heads) x cp_heads grid: the
    mesh is (dp_shard, cp, cp_heads) with "cp" the ring and "cp_heads" a head group of
    consecutive ranks (the fastest links, where its all-to-alls run)."""
    world = dist.get_world_size()
    if dp_shard * cp != world:
        raise ValueError(f"dp_shard * cp = {dp_shard} * {cp} = {dp_shard * cp} must equal the world size {world}")
    if cp_heads < 1 or cp % cp_heads:
        raise ValueError(f"cp_heads = {cp_heads} must be a positive divisor of cp = {cp} (cp = ring x head group)")
    if cp_heads == 1:
        return init_device_mesh(device_type, (dp_shard, cp), mesh_dim_names=(DP_SHARD, CP))
    return init_device_mesh(device_type, (dp_shard, cp // cp_heads, cp_heads), mesh_dim_names=(DP_SHARD, CP, CP_HEADS))


def head_group(mesh):
    """The head group of ``mesh`` (2-D context parallelism), or None."""
    return mesh[CP_HEADS].get_group() if CP_HEADS in mesh.mesh_dim_names else None


def parallelize(model, mesh, *, layout="zigzag", backend="auto", param_dtype=None, activation_checkpointing="none",
                compile=False, deterministic=False):
    """Make ``model`` (a ringfa4.nn.Transformer) train on ``mesh``; returns the model.

    ``param_dtype`` (e.g. torch.bfloat16) is the compute dtype of parameters gathered for forward
    and backward; the sharded masters keep their own dtype. Gradients are reduced in fp32 under
    mixed precision, else in the parameters' dtype (fp64 stays fp64 for exact tests).
    ``activation_checkpointing`` is what each block recomputes in backward (see
    ringfa4.nn.model.Block): "none", "pointwise" (norms, RoPE and activations), "selective" (all
    but the attention) or "full".
    ``compile`` puts each block, and the loss's per-chunk softmax, through torch.compile; the
    attention inside stays one operator. ``deterministic`` makes every attention backward give
    bit-identical gradients run to run (see ContextParallelAttention).

    Order matters and follows torchtitan: the ring group goes into every attention core,
    activation checkpointing wraps each block, compile takes the block with its checkpointing,
    then fully_shard shards each block (its own all-gather / reduce-scatter unit) and finally the
    root (embeddings, final norm, output).
    """
    if activation_checkpointing not in ACTIVATION_CHECKPOINTING:
        raise ValueError(f"activation_checkpointing must be one of {ACTIVATION_CHECKPOINTING}, "
                         f"got {activation_checkpointing!r}")
    if not isinstance(compile, bool):
        raise ValueError(f"compile must be True or False, got {compile!r}")
    _check_flag(deterministic, "deterministic")
    cp_group, heads = mesh[CP].get_group(), head_group(mesh)
    for core in model.attention_cores():
        core.group, core.head_group, core.layout, core.backend = cp_group, heads, layout, backend
        core.deterministic = deterministic
    for block in model.layers:
        block.activation_checkpointing = activation_checkpointing
        if compile:
            # The block's forward (its checkpointing included), not its __call__: the FSDP hooks
            # that fully_shard adds around forward stay outside the graph, in eager.
            block.forward = torch.compile(block.forward, fullgraph=True)
    model.compile_loss = compile
    return fully_shard_blocks(model, model.layers, mesh, param_dtype)


def fully_shard_blocks(model, blocks, mesh, param_dtype=None):
    """FSDP2 over every rank of ``mesh``: each of ``blocks`` is its own all-gather / reduce-scatter
    unit, then the root (what remains: embeddings, final norm, output). cp ranks hold other tokens
    of the same samples, so for parameters they are more data-parallel ranks. Returns ``model``.

    Each rank's loss is already its share of the global-batch mean (token sum / global token
    count), so gradients are summed over ranks, not averaged: a plain SUM reduction, since a
    custom factor becomes NCCL's PreMulSum, which gloo lacks and which has had bugs.
    """
    # DeviceMesh._flatten is how torchtitan names the combined dimension; it reuses the mesh's
    # ranks in row-major order instead of building an unrelated world-sized mesh.
    shard_mesh = mesh[mesh.mesh_dim_names]._flatten(DP_SHARD_CP)
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=None if param_dtype is None else torch.float32)
    for block in blocks:
        fully_shard(block, mesh=shard_mesh, mp_policy=policy)
    fully_shard(model, mesh=shard_mesh, mp_policy=policy)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return model


def shard_sequence(tensors, group, layout, head_group=None, cu_seqlens=None):
    """This rank's part of each (b, s, ...) tensor along s, in the ring ``layout`` over ``group``
    (and ``head_group``, see ringfa4.shard; ``cu_seqlens`` for the document layouts)."""
    if (group is None or dist.get_world_size(group) == 1) and head_group is None:
        return list(tensors)
    return [ringfa4.shard(t, dim=1, group=group, layout=layout, head_group=head_group, cu_seqlens=cu_seqlens)
            for t in tensors]
