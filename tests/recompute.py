"""Counting what backward runs, to see what activation checkpointing recomputes."""
from torch.utils._python_dispatch import TorchDispatchMode

from ringfa4.nn.model import MATMULS


class MatmulCount(TorchDispatchMode):
    """Counts the matmuls that run below autograd while it is on; a selective checkpoint's kept
    outputs are replayed by an inner mode and never reach it."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func in MATMULS
        return func(*args, **(kwargs or {}))
