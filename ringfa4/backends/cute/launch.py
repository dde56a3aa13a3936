"""The one door from the host code to the kernels package. ringfa4.kernels pins the DSL's target
arch (sm_90a) and the compiler imports nvidia-cutlass-dsl; both happen on the first use by the
cute backend, which has checked for a Hopper GPU, never when a backend is merely chosen, so
another backend on another GPU (upstream FA4 on Blackwell) keeps the DSL's own arch."""
import functools
import importlib.util

import torch


def compiled(config):
    """The compiled kernel of ``config`` (ringfa4.backends.cute.configs), cached."""
    from ringfa4.backends.cute.compile import compile_variant

    return compile_variant(config)


def key_tile():
    """Rows of the backward kernel's K/V block (one 64-row part per MMA warp group)."""
    from ringfa4.kernels.dq_layout import NUM_MMA_WG

    return 64 * NUM_MMA_WG


def dq_turn_counters(dq_warp_per_part):
    """The deterministic backward's turn counters per dQ tile (ringfa4.kernels.dq_layout)."""
    from ringfa4.kernels.dq_layout import turn_counters

    return turn_counters(dq_warp_per_part)


@functools.cache
def num_sms(device_index):
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def device_index(t):
    """Index of the GPU holding ``t``."""
    return t.device.index if t.device.index is not None else torch.cuda.current_device()


# Asked on every call (a ring asks once per step): cached, as neither changes while a process runs.
@functools.cache
def capability(device_index):
    return torch.cuda.get_device_capability(device_index)


@functools.cache
def dsl_installed():
    return importlib.util.find_spec("cutlass") is not None
