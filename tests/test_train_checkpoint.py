"""Faults a long run meets: a damaged checkpoint is never loaded (the run falls back to the newest
one that passes its check, and says so), a non-finite loss stops the run before it writes or
prunes anything, pruning never removes the newest good checkpoint, and a resume reads the
snapshot in one DCP load."""
import json
import re
import shutil
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from ringfa4.train import checkpoint, launch, trainer
from train_configs import SMALL, composed

STEPS = SMALL + ["train.steps=6", "train.checkpoint_interval=2", "train.checkpoint_keep=0"]


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    """Six uninterrupted steps with checkpoints at 2, 4 and 6: ({step: loss}, checkpoint dir)."""
    ckpt = tmp_path_factory.mktemp("full") / "ckpt"
    losses = launch.spawn(trainer.train, 2, composed(*STEPS, f"train.checkpoint_dir={ckpt}"))
    assert checkpoint.complete_steps(ckpt) == [2, 4, 6]
    return losses, ckpt


def largest_shard(folder):
    return max(folder.glob("*.distcp"), key=lambda p: p.stat().st_size)


def flip_bytes(path):
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 64] = bytes(b ^ 0xFF for b in data[middle:middle + 64])
    path.write_bytes(bytes(data))


def truncate(path):
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)


@pytest.mark.parametrize("damage,problem", [(flip_bytes, r"has SHA-256 \w+\.\.\., the marker says \w+\.\.\."),
                                            (truncate, r"has \d+ bytes, the marker says \d+")])
def test_damaged_shard_is_named_and_the_run_resumes_from_the_newest_good_checkpoint(
        full_run, tmp_path, capfd, damage, problem):
    full, source = full_run
    ckpt = tmp_path / "ckpt"
    shutil.copytree(source, ckpt)
    shard = largest_shard(ckpt / "step_00000006")
    damage(shard)

    resumed = launch.spawn(trainer.train, 2, composed(*STEPS, f"train.checkpoint_dir={ckpt}", "train.resume=true"))
    out = capfd.readouterr().out
    aside = ckpt / "step_00000006.corrupt"
    assert re.search(
        f"checkpoint {ckpt / 'step_00000006'} fails its integrity check \\({shard} {problem}\\); "
        f"moved it to {aside}", out), out
    assert f"resuming from {ckpt / 'step_00000004'}, the newest checkpoint that passes its integrity check" in out
    assert "resumed at step 4" in out
    # Steps 5 and 6 are run again from step 4 and give the uninterrupted run's losses.
    assert sorted(resumed) == [5, 6]
    for step in (5, 6):
        assert abs(resumed[step] - full[step]) <= 1e-6 * abs(full[step]), (step, resumed[step], full[step])
    assert checkpoint.complete_steps(ckpt) == [2, 4, 6] and aside.is_dir()


def test_checkpoint_marker_lists_every_file_with_its_size_and_checksum(full_run):
    _, ckpt = full_run
    folder = ckpt / "step_00000004"
    marker = json.loads((folder / checkpoint.MARKER).read_text())
    assert marker["step"] == 4
    files = sorted(p.name for p in folder.iterdir() if p.name != checkpoint.MARKER)
    assert sorted(marker["files"]) == files and ".metadata" in files and len(files) >= 3
    for name, entry in marker["files"].items():
        assert entry["bytes"] == (folder / name).stat().st_size and len(entry["sha256"]) == 64


def test_non_finite_loss_stops_the_run_without_writing_or_pruning_a_checkpoint(tmp_path):
    # A learning rate of 1e30 makes the updates overflow the weights within a few steps; every
    # step before that writes a checkpoint and prunes the one before it.
    ckpt = tmp_path / "ckpt"
    job = composed(*SMALL, "train.steps=6", "train.lr=1e30", "train.min_lr=0", "train.warmup_steps=0",
                   f"train.checkpoint_dir={ckpt}", "train.checkpoint_interval=1", "train.checkpoint_keep=1")
    with pytest.raises(trainer.NonFiniteLoss, match=r"loss is (nan|inf|-inf) at step \d: the run stops here "
                                                    r"and writes no checkpoint") as stopped:
        launch.spawn(trainer.train, 2, job)
    bad_step = int(re.search(r"at step (\d)", str(stopped.value)).group(1))
    assert bad_step >= 2
    assert [p.name for p in ckpt.iterdir()] == [f"step_{bad_step - 1:08d}"]
    assert checkpoint.complete_steps(ckpt) == [bad_step - 1]


def test_each_rank_hashes_the_data_files_it_wrote():
    names = sorted([".metadata"] + [f"__{rank}_{n}.distcp" for rank in range(12) for n in range(2)])
    owners = {name: checkpoint._hashing_rank(i, name, 12) for i, name in enumerate(names)}
    assert all(owners[f"__{rank}_{n}.distcp"] == rank for rank in range(12) for n in range(2))
    # A snapshot of 12 ranks checked by 4: each rank hashes 6 of the 24 data files.
    owners = [checkpoint._hashing_rank(i, name, 4) for i, name in enumerate(names) if name.endswith(".distcp")]
    assert sorted(owners) == sorted(list(range(4)) * 6)


def test_pruning_keeps_the_step_just_written_and_never_touches_newer_ones(tmp_path):
    for step in (2, 4, 6, 8):
        (tmp_path / f"step_{step:08d}").mkdir()
        (tmp_path / f"step_{step:08d}" / checkpoint.MARKER).write_text("{}")
    checkpoint.prune(tmp_path, 6, keep=1)
    assert checkpoint.complete_steps(tmp_path) == [6, 8]
    checkpoint.prune(tmp_path, 8, keep=2)
    assert checkpoint.complete_steps(tmp_path) == [6, 8]
    checkpoint.prune(tmp_path, 8, keep=0)  # 0 keeps all
    assert checkpoint.complete_steps(tmp_path) == [6, 8]


def _load_generators(job, ckpt, save, rank, world, local_rank):
    """Load step 3 of ``ckpt`` into a fresh run of ``world`` ranks (this world writes it first when
    ``save``, with generators that the load must bring back): (load's (step, data position), the
    DCP loads it ran, [whether each rank's generator is the one saved])."""
    with launch.process_group("cpu", rank, world, local_rank) as device:
        run = trainer.build(job, device)
        torch.manual_seed(100 + rank)
        saved = torch.get_rng_state()
        if save:
            checkpoint.save(ckpt, 3, run.model, run.optimizer, 11, device, keep=0)
        torch.manual_seed(200 + rank)
        with mock.patch.object(checkpoint.dcp, "load", wraps=checkpoint.dcp.load) as dcp_load:
            position = checkpoint.load(ckpt, 3, run.model, run.optimizer, device)
        restored = [None] * world
        dist.all_gather_object(restored, torch.equal(torch.get_rng_state(), saved))
        return position, dcp_load.call_count, restored


def test_resume_loads_once_and_restores_every_ranks_generator_only_at_the_same_world_size(tmp_path):
    ckpt = tmp_path / "ckpt"
    assert launch.spawn(_load_generators, 2, composed(*SMALL), ckpt, True) == ((3, 11), 1, [True, True])
    assert json.loads((ckpt / "step_00000003" / checkpoint.MARKER).read_text())["world_size"] == 2
    # One rank resumes the two ranks' checkpoint: parameters and optimizer reshard, generators start fresh.
    assert launch.spawn(_load_generators, 1, composed(*SMALL), ckpt, False) == ((3, 11), 1, [False])
