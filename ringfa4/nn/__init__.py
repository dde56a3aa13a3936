"""Drop-in modules: attention over a context-parallel group, a Llama-style model, FSDP2 x CP."""
from ringfa4.nn.attention import ContextParallelAttention
from ringfa4.nn.model import ModelArgs, Transformer
from ringfa4.nn.parallel import build_mesh, parallelize, shard_sequence

__all__ = ["ContextParallelAttention", "ModelArgs", "Transformer", "build_mesh", "parallelize", "shard_sequence"]
