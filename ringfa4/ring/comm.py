"""Rotation of tensors around the ring: send to the next rank, receive from the previous one.

On CUDA the point-to-point ops are issued from a dedicated stream that first waits for the compute
stream: a receive buffer was read by the previous step's kernels, and a send buffer is written by
the kernels queued before it, so the transfer may start only once those finished; it then runs
while the compute stream goes on with the current step. `wait` makes the compute stream, never the
host, wait for the transfer. On CPU (gloo) the same calls are plain async sends.
"""
import functools
import os
import warnings

import torch
import torch.distributed as dist

from ringfa4.ring import timeline


def nccl_options():
    """Options for the NCCL process group a ring runs on: NCCL's streams at high priority.

    At normal priority, a transfer posted while the compute stream has a kernel queued that fills
    every SM gets no SM until that kernel's last CTAs are placed: measured on 2 x H200, the dK/dV
    hop of a backward then took the whole next step (40-156 ms instead of 2.5-5) and up to 9 ms of
    it was exposed. At high priority the transfer's CTAs go first as soon as any CTA ends.
    (TORCH_NCCL_HIGH_PRIORITY=1 sets the same for every process group.)"""
    if not dist.is_nccl_available():
        raise RuntimeError("nccl_options: this torch build has no NCCL (a CPU build?); use gloo without options")
    return dist.ProcessGroupNCCL.Options(is_high_priority_stream=True)


_checked_groups = set()  # ids: process groups need not be hashable


def _warn_unless_high_priority(group):
    """Once per group: say so when its NCCL streams run at normal priority (see nccl_options)."""
    if id(group) in _checked_groups:
        return
    _checked_groups.add(id(group))
    try:
        backend = (group if group is not None else dist.group.WORLD)._get_backend(torch.device("cuda"))
        high = backend.options.is_high_priority_stream
    except (AttributeError, RuntimeError, ValueError):  # not NCCL, or a torch without these accessors
        return
    # The environment variable raises the priority when NCCL creates its streams, not in options.
    if not high and os.environ.get("TORCH_NCCL_HIGH_PRIORITY", "").lower() not in ("1", "true", "yes", "y"):
        warnings.warn(
            "ring_attention: the NCCL process group's streams run at normal priority, so a transfer "
            "can wait for a whole kernel and stall the ring; create it with "
            "init_process_group('nccl', pg_options=ringfa4.nccl_options()) or set TORCH_NCCL_HIGH_PRIORITY=1",
            stacklevel=4)


@functools.cache
def _comm_stream(device):
    return torch.cuda.Stream(device=device)


class Ring:
    """Sends go to the next rank and receives come from the previous one; ``reverse`` turns the ring around."""

    def __init__(self, group, device, reverse=False):
        self.group = group
        self.rank, self.world = rank, world = dist.get_rank(group), dist.get_world_size(group)
        self.reverse = reverse
        step = -1 if reverse else 1
        self.next = dist.get_global_rank(group, (rank + step) % world) if group is not None else (rank + step) % world
        self.prev = dist.get_global_rank(group, (rank - step) % world) if group is not None else (rank - step) % world
        self.device = device
        self.stream = None
        if device.type == "cuda":
            self.stream = _comm_stream(device)
            _warn_unless_high_priority(group)

    def turned(self):
        """The same ring, turning the other way."""
        return Ring(self.group, self.device, reverse=not self.reverse)

    def start(self, send, recv, send_rows=slice(None), recv_rows=slice(None), tag=0, span=None):
        """Post the sends of ``send`` to the next rank and the receives into ``recv`` from the previous one:
        of each tensor (b, s, ...) the rows send_rows / recv_rows (a contiguous range when b = 1), none
        where that range is empty (the peer agrees on it).

        ``span`` = (phase, step, kind) names the transfer in an active timeline recording.
        """
        send, recv = ([part for part in (t[:, rows] for t in tensors) if part.shape[1]]
                      for tensors, rows in ((send, send_rows), (recv, recv_rows)))
        if not send and not recv:
            return []
        ops = [dist.P2POp(dist.isend, t, self.next, self.group, tag) for t in send]
        ops += [dist.P2POp(dist.irecv, t, self.prev, self.group, tag) for t in recv]
        if self.stream is None:
            return dist.batch_isend_irecv(ops)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            start = timeline.begin(self.device) if span else None
            works = dist.batch_isend_irecv(ops)
            if start is not None:  # only when recording: make the comm stream see the end of NCCL's work
                for work in works:
                    work.wait()
                timeline.end(start, *span)
            return works

    @staticmethod
    def wait(works):
        for work in works:
            work.wait()
