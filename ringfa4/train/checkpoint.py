"""Atomic torch.distributed.checkpoint (DCP) snapshots of a training run.

Layout: <dir>/step_<08d>/ holds one DCP checkpoint plus a COMPLETE marker. A snapshot is written
into step_<08d>.partial/, the marker is written last, and only then is the folder renamed, so a
run killed mid-save leaves a .partial folder that is never read (and is cleared by the next save).
The directory must be on a file system every rank sees (one node's disk, or a shared one).
"""
import os
import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)

MARKER = "COMPLETE"
_STEP_DIR = re.compile(r"^step_(\d{8})$")


def complete_steps(directory):
    """Steps with a complete checkpoint in ``directory``, ascending."""
    root = Path(directory)
    if not root.is_dir():
        return []
    steps = []
    for entry in root.iterdir():
        match = _STEP_DIR.match(entry.name)
        if match and (entry / MARKER).is_file():
            steps.append(int(match.group(1)))
    return sorted(steps)


def _rng_state(device):
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(directory, step, model, optimizer, data_position, device, keep):
    """Collective: every rank calls it with the same step. Keeps the newest ``keep`` snapshots."""
    root = Path(directory)
    rank = dist.get_rank()
    final, partial = root / f"step_{step:08d}", root / f"step_{step:08d}.partial"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)
    dist.barrier()
    state = {
        "model": get_model_state_dict(model),
        "optimizer": get_optimizer_state_dict(model, optimizer),
        "train": {"step": step, "data_position": data_position, "world_size": dist.get_world_size()},
        # Per-rank keys: DCP stores one copy of equal keys, but every rank's generators differ.
        "rng": {f"rank{rank}": _rng_state(device)},
    }
    dcp.save(state, checkpoint_id=str(partial))
    # dcp.save returns after the coordinator wrote the metadata, i.e. after every rank's data.
    if rank == 0:
        with open(partial / MARKER, "w") as f:
            f.write(f"{step}\n")
            f.flush()
            os.fsync(f.fileno())
        shutil.rmtree(final, ignore_errors=True)
        os.rename(partial, final)
        _fsync_dir(root)
        for old in complete_steps(root)[:-keep] if keep > 0 else []:
            shutil.rmtree(root / f"step_{old:08d}", ignore_errors=True)
    dist.barrier()


def load(directory, step, model, optimizer, device):
    """Restore model, optimizer and (at the same world size) every rank's RNG; returns
    (step, data_position)."""
    path = str(Path(directory) / f"step_{step:08d}")
    rank = dist.get_rank()
    state = {
        "model": get_model_state_dict(model),
        "optimizer": get_optimizer_state_dict(model, optimizer),
        "train": {"step": -1, "data_position": -1, "world_size": -1},
    }
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optimizer"])
    train = state["train"]
    if train["world_size"] == dist.get_world_size():
        rng = {"rng": {f"rank{rank}": _rng_state(device)}}
        dcp.load(rng, checkpoint_id=path)
        torch.set_rng_state(rng["rng"][f"rank{rank}"]["cpu"])
        if device.type == "cuda":
            torch.cuda.set_rng_state(rng["rng"][f"rank{rank}"]["cuda"], device)
    return train["step"], train["data_position"]
