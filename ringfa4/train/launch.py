"""Where the ranks come from: torchrun's environment, or local worker processes started here;
and the process group each rank joins."""
import contextlib
import logging
import os
import socket
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ringfa4.ring import comm

CPU_WORKERS = 2


def under_torchrun():
    return all(name in os.environ for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"))


def local_world_size(dev_type):
    """All GPUs with NCCL; on a CPU-only machine two gloo processes, enough to run a real ring."""
    return torch.cuda.device_count() if dev_type == "cuda" else CPU_WORKERS


@contextlib.contextmanager
def process_group(dev_type, rank, world_size, local_rank):
    """Join the default process group for the duration of the block and yield this rank's device:
    NCCL (high-priority streams, see ring.comm) on GPU ``local_rank``, or gloo on the CPU."""
    if dev_type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", rank=rank, world_size=world_size, device_id=device,
                                pg_options=comm.nccl_options())
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        yield device
    finally:
        dist.destroy_process_group()


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(fn, world_size, *args):
    """Run fn(*args, rank, world_size, local_rank) in ``world_size`` fresh processes on this
    machine, rendezvous on 127.0.0.1 with a free port; returns rank 0's result. An exception in a
    worker is raised here as itself (the worker's traceback chained to it)."""
    with tempfile.TemporaryDirectory() as tmp:
        try:
            mp.spawn(_run_rank, args=(fn, world_size, free_port(), args, tmp), nprocs=world_size, join=True)
        except mp.ProcessRaisedException as failure:
            raised = os.path.join(tmp, f"error{failure.error_index}.pt")
            if os.path.exists(raised):
                raise torch.load(raised, weights_only=False) from failure
            raise
        # A file, not a queue: a large result would fill a pipe nobody drains until the join.
        return torch.load(os.path.join(tmp, "rank0.pt"), weights_only=False)


def _run_rank(rank, fn, world_size, port, args, tmp):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    try:
        result = fn(*args, rank, world_size, rank)
    except Exception as e:
        try:
            torch.save(e, os.path.join(tmp, f"error{rank}.pt"))
        except Exception:  # an exception that does not pickle still reaches the launcher as text
            pass
        raise
    if rank == 0:
        torch.save(result, os.path.join(tmp, "rank0.pt"))
    end_process()


def end_process(status=0):
    """End a worker whose process group is destroyed, without interpreter finalization.

    After destroy_process_group, PyTorch's DTensor caches still hold the DeviceMesh of an FSDP2
    model, and with it the gloo process groups and their threads (in a cp=2 trainer worker: six
    gloo worker and two transport threads still running after destroy_process_group and
    gc.collect). They are torn down while the interpreter finalizes, where a native thread that
    needs the GIL is ended by pthread_exit; unwinding through a noexcept destructor then aborts
    the process ("terminate called without an active exception": SIGABRT after a finished run).
    A finished worker has nothing left for finalization to do once its output is flushed."""
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(status)
