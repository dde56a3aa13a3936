"""Run a function on W local processes joined by a gloo process group (CPU)."""
import datetime
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ringfa4.train import launch


def _worker(rank, world, init_file, fn, args):
    torch.set_num_threads(1)  # W processes share the two CI cores
    # A rank left waiting in a collective fails the test in minutes instead of hanging CI.
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(minutes=3))
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()
    launch.end_process()


def run(fn, world, *args):
    """fn(rank, world, *args) on ``world`` processes; an exception in any of them fails the caller."""
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        mp.start_processes(_worker, args=(world, init_file, fn, args), nprocs=world, start_method="spawn")
