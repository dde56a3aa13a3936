"""Run metrics: throughput and memory figures, and the sinks a step's record goes to.

A record is one dict per log interval (step, loss, lr, grad_norm, tokens_per_s, tflops_per_device,
mfu, peak_mem_gib; with a ring over packed documents also ring_steps_run, ring_steps_skipped,
ring_kv_gib_not_read and ring_gib_not_sent, totals of the run so far). ``Writer`` sends it, on
rank 0 only, to the sinks ``train.metrics`` names:

    console      the progress line (Progress)
    jsonl        <run_dir>/metrics.jsonl, one JSON object per line
    tensorboard  <run_dir>/tensorboard, torch.utils.tensorboard event files (extra: ringfa4[tensorboard])
    wandb        a Weights & Biases run in <run_dir>/wandb (extra: ringfa4[wandb]); WANDB_MODE=offline
                 keeps it on disk with no network or account, for `wandb sync` later
"""
import importlib.util
import json
import os
import resource
import sys
from pathlib import Path

import torch

SINKS = ("console", "jsonl", "tensorboard", "wandb")
# The package each optional sink imports, and the extra that installs it.
_OPTIONAL = {"tensorboard": ("tensorboard", "ringfa4[tensorboard]"), "wandb": ("wandb", "ringfa4[wandb]")}

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

    def __init__(self, total_steps, stream=None):
        self.total = total_steps
        self.stream = sys.stdout if stream is None else stream
        self.tty = self.stream.isatty()

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
        if "ring_steps_skipped" in record:
            skipped = record["ring_steps_skipped"]
            fields.append(f"ring steps skipped {skipped}/{skipped + record['ring_steps_run']}")
        line = " | ".join(fields)
        if self.tty:
            end = "\n" if step == self.total else ""
            self.stream.write("\r" + line + end)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()


def sink_problem(sinks):
    """Why the sinks named in ``sinks`` cannot be used (an unknown name, a package not installed),
    or None; checked before a run starts."""
    if isinstance(sinks, str) or not all(isinstance(name, str) for name in sinks):
        return f"must be a list of names from {list(SINKS)}, got {sinks!r}"
    for name in sinks:
        if name not in SINKS:
            return f"{name!r} is not one of {list(SINKS)}"
        if name in _OPTIONAL and importlib.util.find_spec(_OPTIONAL[name][0]) is None:
            package, extra = _OPTIONAL[name]
            return f"{name} needs the {package} package: pip install \"{extra}\""
    if len(set(sinks)) != len(sinks):
        return f"names a sink twice: {list(sinks)}"
    return None


class Writer:
    """Rank 0's records to the chosen sinks (other ranks make a Writer of no sinks).

    ``run_dir`` holds the file sinks (jsonl, tensorboard, wandb); without one they are refused.
    ``config`` (a plain dict) is stored with the wandb run. Call ``close`` at the end of the run:
    wandb finishes its run there (worker processes skip atexit handlers).
    """

    def __init__(self, sinks, total_steps, run_dir=None, config=None, project="ringfa4"):
        problem = sink_problem(sinks)
        if problem:
            raise ValueError(f"metrics sinks: {problem}")
        files = [name for name in sinks if name != "console"]
        if files and not run_dir:
            raise ValueError(f"metrics sinks {files} write into the run directory, but none was given")
        self.progress = Progress(total_steps) if "console" in sinks else None
        self.jsonl = Path(run_dir) / "metrics.jsonl" if "jsonl" in sinks else None
        self.tensorboard = self.wandb = None
        if "tensorboard" in sinks:
            from torch.utils.tensorboard import SummaryWriter
            self.tensorboard = SummaryWriter(log_dir=str(Path(run_dir) / "tensorboard"))
        if "wandb" in sinks:
            import wandb
            self.wandb = wandb.init(project=os.environ.get("WANDB_PROJECT", project), dir=str(run_dir),
                                    config=config)

    def write(self, record):
        step = record["step"]
        if self.progress:
            self.progress.update(step, record)
        if self.jsonl:
            with open(self.jsonl, "a") as f:
                f.write(json.dumps(record) + "\n")
        scalars = {f"train/{key}": value for key, value in record.items() if key != "step" and value is not None}
        if self.tensorboard:
            for tag, value in scalars.items():
                self.tensorboard.add_scalar(tag, value, step)
            self.tensorboard.flush()  # a run killed later keeps what it logged
        if self.wandb:
            self.wandb.log(scalars, step=step)

    def close(self):
        if self.tensorboard:
            self.tensorboard.close()
        if self.wandb:
            self.wandb.finish()
