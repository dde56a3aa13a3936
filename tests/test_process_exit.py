"""Finished runs exit 0, every time.

Worker processes used to abort at interpreter shutdown now and then ("terminate called without
an active exception", SIGABRT) after a run had finished: the gloo process groups outlive
destroy_process_group (see launch.end_process). A race at exit shows up only in some runs, so
these tests repeat short runs; any worker that ends by a signal or a non-zero status fails them
(mp.spawn raises ProcessExitedException).
"""
import torch

import distributed
import ringfa4
from ringfa4.train import launch, trainer
from train_configs import SMALL, composed

RUNS = 5


def test_short_training_runs_on_two_workers_all_exit_zero(tmp_path):
    for run in range(RUNS):
        run_dir = tmp_path / f"run{run}"
        run_dir.mkdir()
        job = composed(*SMALL, "train.steps=2", f"run_dir={run_dir}")
        losses = launch.spawn(trainer.train, 2, job)
        assert sorted(losses) == [1, 2]


def _ring_step(rank, world):
    torch.manual_seed(0)
    x = torch.randn(1, 4 * world, 2, 8, dtype=torch.float64)
    q = ringfa4.shard(x, dim=1).requires_grad_()
    ringfa4.ring_attention(q, q, q, causal=True, backend="torch").sum().backward()


def test_gloo_rings_of_three_and_four_ranks_all_exit_zero():
    for world in (3, 4) * 3:
        distributed.run(_ring_step, world)
