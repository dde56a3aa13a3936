"""The NCCL process group the 2-GPU tests share (one process per GPU under torchrun)."""
import datetime
import os

import pytest
import torch
import torch.distributed as dist

from ringfa4.ring import comm


@pytest.fixture(scope="module")
def world():
    """The world size, once this process has joined the NCCL group; skips outside torchrun on 2 GPUs."""
    if "LOCAL_RANK" not in os.environ:
        pytest.skip("needs torchrun --nproc_per_node=2 (a process per GPU)")
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    if not dist.is_initialized():
        # short: a rank left waiting in a collective fails the run in 2 minutes, not 10
        dist.init_process_group("nccl", device_id=device, timeout=datetime.timedelta(minutes=2),
                                pg_options=comm.nccl_options())
    return dist.get_world_size()
