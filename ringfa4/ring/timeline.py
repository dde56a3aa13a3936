"""Where a ring call spends its time, from CUDA events: each step's compute on the compute stream
and each transfer on the comm stream (nsys-free). Off unless a `recording()` block is active; the
events cost nothing measurable, but reading them synchronises, so only benchmarks turn this on."""
import contextlib

import torch

_active = None


class Timeline:
    def __init__(self):
        self._spans = []  # (phase, step, kind, start event, end event)

    def add(self, phase, step, kind, start, end):
        self._spans.append((phase, step, kind, start, end))

    def milliseconds(self):
        """[(phase, step, kind, ms)] in recording order; synchronises the device."""
        torch.cuda.synchronize()
        return [(p, i, kind, s.elapsed_time(e)) for p, i, kind, s, e in self._spans]


@contextlib.contextmanager
def recording():
    """Record the spans of every ring call inside the block (CUDA tensors only) into the yielded Timeline."""
    global _active
    if _active is not None:
        raise RuntimeError("timeline.recording() blocks do not nest")
    _active = Timeline()
    try:
        yield _active
    finally:
        _active = None


def begin(device):
    """A start event on the current stream, or None when nothing records (or not on CUDA)."""
    if _active is None or device.type != "cuda":
        return None
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def end(start, phase, step, kind):
    """Close the span opened by ``begin`` with an event on the current stream."""
    if start is None:
        return
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    _active.add(phase, step, kind, start, event)
