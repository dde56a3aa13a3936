"""Throughput and memory figures for the progress line and metrics.jsonl."""
import resource
import sys

import torch

# Dense bf16 tensor-core peaks (FLOP/s) from the vendors' data sheets, matched on the device name.
# MFU is reported only for devices listed here.
PEAK_BF16_FLOPS = (
    ("GB200", 2.5e15),
    ("B200", 2.25e15),
    ("H200", 989.4e12),
    ("H100 PCIe", 756.0e12),
    ("H100", 989.4e12),
    ("A100", 312.0e12),
)


def peak_flops(device):
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BF16_FLOPS if key in name), None)


def peak_memory_gib(device):
    """Peak allocated GPU memory, or the process's peak resident set on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


class Progress:
    """One line per log interval; on a terminal the line redraws in place as a bar."""

    def __init__(self, total_steps, stream=sys.stdout):
        self.total = total_steps
        self.stream = stream
        self.tty = stream.isatty()

    def update(self, step, record):
        width = 24
        done = width * step // self.total
        bar = "#" * done + "-" * (width - done)
        fields = [f"step {step:>{len(str(self.total))}}/{self.total} [{bar}]",
                  f"loss {record['loss']:.4f}", f"lr {record['lr']:.2e}",
                  f"{record['tokens_per_s']:,.0f} tok/s",
                  f"{record['tflops_per_device']:.2f} TFLOP/s/dev"]
        if record["mfu"] is not None:
            fields.append(f"MFU {100 * record['mfu']:.1f}%")
        fields.append(f"peak mem {record['peak_mem_gib']:.2f} GiB")
        line = " | ".join(fields)
        if self.tty:
            end = "\n" if step == self.total else ""
            self.stream.write("\r" + line + end)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()
