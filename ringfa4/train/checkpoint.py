"""Atomic, checksummed torch.distributed.checkpoint (DCP) snapshots of a training run.

Layout: <dir>/step_<08d>/ holds one DCP checkpoint plus a COMPLETE marker. A snapshot is written
into step_<08d>.partial/; the marker, written last, lists the size and SHA-256 of every file of
the snapshot and the world size that wrote it, and only then is the folder renamed, so a run
killed mid-save leaves a .partial folder that is never read (and is cleared by the next save). A
resumed run checks the newest snapshot against its marker before loading it; one that fails is
moved aside to step_<08d>.corrupt and the next older one is tried. Each rank hashes the files it
wrote, so writing and checking each cost one read of the snapshot spread over all ranks; a resume
then reads it in one DCP load (``newest_valid`` says why checking and loading are two reads).
The directory must be on a file system every rank sees (one node's disk, or a shared one).
"""
import hashlib
import json
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
CORRUPT_SUFFIX = ".corrupt"
_STEP_DIR = re.compile(r"^step_(\d{8})$")
# DCP's file system writer names the data files of rank r __<r>_<n>.distcp.
_RANK_FILE = re.compile(r"^__(\d+)_\d+\.distcp$")


class CheckpointError(RuntimeError):
    """No checkpoint to resume from passes its integrity check."""


def step_dir(directory, step):
    return Path(directory) / f"step_{step:08d}"


def complete_steps(directory):
    """Steps with a complete checkpoint (a COMPLETE marker) in ``directory``, ascending."""
    root = Path(directory)
    if not root.is_dir():
        return []
    steps = []
    for entry in root.iterdir():
        match = _STEP_DIR.match(entry.name)
        if match and (entry / MARKER).is_file():
            steps.append(int(match.group(1)))
    return sorted(steps)


def _digest(path):
    sha = hashlib.sha256()  # read in blocks (hashlib.file_digest needs Python 3.11)
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            sha.update(block)
        return {"bytes": f.tell(), "sha256": sha.hexdigest()}


def _hashing_rank(index, name, world):
    """The rank that hashes the file ``name``, the index-th of the snapshot's files. A rank's data
    file goes to the rank that wrote it (modulo the world, for a snapshot of a larger world): the
    hash reads it from that rank's page cache right after the save, and at a resume in the same
    world leaves it cached for that rank's DCP load. Other files go to the ranks in turns."""
    match = _RANK_FILE.match(name)
    return (int(match.group(1)) if match else index) % world


def _over_ranks(names, fn):
    """{name: fn(name)} over all ranks, each doing the files _hashing_rank gives it. Collective."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = {name: fn(name) for index, name in enumerate(names) if _hashing_rank(index, name, world) == rank}
    parts = [None] * world
    dist.all_gather_object(parts, mine)
    return {name: value for part in parts for name, value in part.items()}


def _file_problem(folder, name, expected):
    path = folder / name
    if not path.is_file():
        return f"{path} is missing"
    found = _digest(path)
    if found["bytes"] != expected["bytes"]:
        return f"{path} has {found['bytes']} bytes, the marker says {expected['bytes']}"
    if found["sha256"] != expected["sha256"]:
        return f"{path} has SHA-256 {found['sha256'][:16]}..., the marker says {expected['sha256'][:16]}..."
    return None


def _read_marker(folder):
    return json.loads((Path(folder) / MARKER).read_text())


def verify(folder):
    """None if every file of the checkpoint ``folder`` matches its marker, else what does not.
    Collective: every rank gets the same answer."""
    folder = Path(folder)
    try:
        files = _read_marker(folder)["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{folder / MARKER} holds no file list ({type(e).__name__}: {e})"
    problems = _over_ranks(sorted(files), lambda name: _file_problem(folder, name, files[name]))
    found = [problem for _, problem in sorted(problems.items()) if problem]
    return "; ".join(found) or None


def newest_valid(directory, log):
    """The newest step in ``directory`` whose checkpoint passes ``verify`` (None if there is none
    at all). Each one that fails is reported through ``log`` and moved aside. Collective.

    The check reads every file whole before ``load`` reads what each rank needs, so a resumed run
    reads its snapshot twice. Checking while loading would not do: a snapshot that fails must be
    passed over before any of its bytes reach the run (DCP loads into the parameters in place), and
    DCP reads each rank's byte ranges from whichever files hold them (resharded when the world
    size changed), so no pass reads a file from start to end for its SHA-256 to follow."""
    failed = []
    for step in reversed(complete_steps(directory)):
        folder = step_dir(directory, step)
        problem = verify(folder)
        if problem is None:
            if failed:
                log(f"resuming from {folder}, the newest checkpoint that passes its integrity check")
            return step
        failed.append(folder)
        if dist.get_rank() == 0:
            aside = folder.with_name(folder.name + CORRUPT_SUFFIX)
            shutil.rmtree(aside, ignore_errors=True)
            os.rename(folder, aside)
            log(f"checkpoint {folder} fails its integrity check ({problem}); moved it to {aside}")
        dist.barrier()
    if failed:
        raise CheckpointError(f"no checkpoint in {directory} passes its integrity check (failed, moved aside: "
                              f"{', '.join(map(str, failed))}); run again to start from step 0, or restore "
                              f"a good copy")
    return None


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


def _write_marker(folder, step, files):
    with open(folder / MARKER, "w") as f:
        json.dump({"step": step, "world_size": dist.get_world_size(), "files": files}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def prune(directory, step, keep):
    """Remove checkpoints older than ``step`` beyond the newest ``keep`` (0 keeps all); ``step``
    itself, just written and checked, always stays."""
    if keep <= 0:
        return
    older = [s for s in complete_steps(directory) if s < step]
    for old in older[:max(0, len(older) - (keep - 1))]:
        shutil.rmtree(step_dir(directory, old), ignore_errors=True)


def save(directory, step, model, optimizer, data_position, device, keep):
    """Collective: every rank calls it with the same step. Keeps the newest ``keep`` snapshots."""
    root = Path(directory)
    rank = dist.get_rank()
    final = step_dir(root, step)
    partial = final.with_name(final.name + ".partial")
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)
    dist.barrier()
    state = {
        "model": get_model_state_dict(model),
        "optimizer": get_optimizer_state_dict(model, optimizer),
        "train": {"step": step, "data_position": data_position},
        # Per-rank keys: DCP stores one copy of equal keys, but every rank's generators differ.
        "rng": {f"rank{rank}": _rng_state(device)},
    }
    # dcp.save returns on every rank after the coordinator wrote the metadata, i.e. after every
    # rank's data, so every rank sees the same finished list of files.
    dcp.save(state, checkpoint_id=str(partial))
    files = _over_ranks(sorted(p.name for p in partial.iterdir()), lambda name: _digest(partial / name))
    if rank == 0:
        _write_marker(partial, step, files)
        shutil.rmtree(final, ignore_errors=True)
        os.rename(partial, final)
        _fsync_dir(root)
        prune(root, step, keep)
    dist.barrier()


def load(directory, step, model, optimizer, device):
    """Restore model, optimizer and, when the checkpoint's marker says it was written by as many
    ranks as now, every rank's RNG, in one DCP load; returns (step, data_position)."""
    folder = step_dir(directory, step)
    key = f"rank{dist.get_rank()}"
    state = {
        "model": get_model_state_dict(model),
        "optimizer": get_optimizer_state_dict(model, optimizer),
        "train": {"step": -1, "data_position": -1},
    }
    same_world = _read_marker(folder).get("world_size") == dist.get_world_size()
    if same_world:
        state["rng"] = {key: _rng_state(device)}
    dcp.load(state, checkpoint_id=str(folder))
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optimizer"])
    if same_world:
        torch.set_rng_state(state["rng"][key]["cpu"])
        if device.type == "cuda":
            torch.cuda.set_rng_state(state["rng"][key]["cuda"], device)
    return state["train"]["step"], state["train"]["data_position"]
