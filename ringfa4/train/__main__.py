"""`python -m ringfa4.train` / `ringfa4-train`: Hydra entry point for long-context pretraining.

Under torchrun every process is one rank. Run directly, it starts its own ranks: one per GPU
with NCCL, or two gloo processes on a CPU-only machine. The config is checked (and every bad
setting named) before any worker starts or touches a GPU. Run recipes (top-level configs/) are
found with Hydra's search path: `ringfa4-train hydra.searchpath=[file://configs] +recipe=NAME`.
"""
import os

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf.errors import MissingMandatoryValue

from ringfa4.train import checkpoint, config, data, launch, trainer

# Causes the user acts on, shown as one line without a traceback: settings (also when a worker
# finds them), and a run that stops on its own.
BAD_SETTINGS = (config.ConfigError, FileNotFoundError, MissingMandatoryValue)
STOPPED = (trainer.NonFiniteLoss, checkpoint.CheckpointError)


def run(job):
    """Train ``job`` (a config.JobConfig) as torchrun's rank, or on local workers."""
    dev_type = config.device_type(job.train)
    if launch.under_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        return trainer.train(job, int(os.environ["RANK"]), world, int(os.environ["LOCAL_RANK"]))
    world = launch.local_world_size(dev_type)
    settings = config.resolve(job, world, dev_type)
    if dev_type == "cpu":
        # On GPU machines each worker checks its own device, so that this process holds no CUDA context.
        config.check_backend(settings, torch.device("cpu"))
    data.build_sampler(job.data, job.train.seq_len, settings.model.vocab_size, job.train.seed)
    return launch.spawn(trainer.train, world, job)


# The config tree lives inside the package (ringfa4/configs, with an __init__.py because Hydra
# looks packaged configs up as a module), not in the top-level configs/ folder of recipes, so
# that an installed `ringfa4-train` finds it without a source checkout.
@hydra.main(version_base="1.3", config_path="pkg://ringfa4.configs", config_name="config")
def _app(cfg):
    try:
        job = config.to_job(cfg)
        job.run_dir = HydraConfig.get().runtime.output_dir
        run(job)
    except BAD_SETTINGS as e:
        raise SystemExit(f"ringfa4-train: bad configuration: {e}") from None
    except STOPPED as e:
        raise SystemExit(f"ringfa4-train: {e}") from None


def main():
    _app()
    if launch.under_torchrun():  # this process is a rank: end it as spawned workers end (launch.end_process)
        launch.end_process()


if __name__ == "__main__":
    main()
