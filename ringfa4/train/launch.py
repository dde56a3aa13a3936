"""Where the ranks come from: torchrun's environment, or local worker processes started here."""
import os
import socket
import tempfile

import torch
import torch.multiprocessing as mp

CPU_WORKERS = 2


def under_torchrun():
    return all(name in os.environ for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"))


def local_world_size(dev_type):
    """All GPUs with NCCL; on a CPU-only machine two gloo processes, enough to run a real ring."""
    return torch.cuda.device_count() if dev_type == "cuda" else CPU_WORKERS


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(fn, world_size, *args):
    """Run fn(*args, rank, world_size, local_rank) in ``world_size`` fresh processes on this
    machine, rendezvous on 127.0.0.1 with a free port; returns rank 0's result."""
    with tempfile.TemporaryDirectory() as tmp:
        # A file, not a queue: a large result would fill a pipe nobody drains until the join.
        result = os.path.join(tmp, "rank0.pt")
        mp.spawn(_run_rank, args=(fn, world_size, free_port(), args, result), nprocs=world_size, join=True)
        return torch.load(result, weights_only=False)


def _run_rank(rank, fn, world_size, port, args, result_path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    result = fn(*args, rank, world_size, rank)
    if rank == 0:
        torch.save(result, result_path)
