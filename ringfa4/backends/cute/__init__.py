"""Our own CuTe DSL kernels (ringfa4.kernels) on Hopper (sm_90): the host side.

- interface:   the backend contract (unsupported_reason, forward, backward, query_state)
- query_rows:  the backward's per-query preprocess, dQ accumulator and postprocess
- merge:       launch of the ring's merge kernel
- tensors:     dtypes and the addressing (TMA) the kernels need of torch tensors
- configs:     compile-time configurations and the shipped variants
- compile:     compile cache (imports nvidia-cutlass-dsl); launch.compiled is its one door, so
               choosing a backend never loads the DSL
"""
from ringfa4.backends.cute.interface import backward, forward, query_state, unsupported_reason

__all__ = ["backward", "forward", "query_state", "unsupported_reason"]
