"""`python -m ringfa4.train` / `ringfa4-train`: Hydra entry point for long-context pretraining.

Under torchrun every process is one rank. Run directly, it starts its own ranks: one per GPU
with NCCL, or two gloo processes on a CPU-only machine. The config is checked (and every bad
setting named) before any worker starts or touches a GPU.
"""
import os

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf
from omegaconf.errors import MissingMandatoryValue

from ringfa4.train import config, data, launch, trainer


def run(cfg):
    """Train with the composed config ``cfg`` (a plain dict) as torchrun's rank, or on local workers."""
    dev_type = config.device_type(cfg["train"])
    if launch.under_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        return trainer.train(cfg, int(os.environ["RANK"]), world, int(os.environ["LOCAL_RANK"]))
    world = launch.local_world_size(dev_type)
    settings = config.resolve(cfg, world, dev_type)
    data.build_sampler(cfg["data"], cfg["train"]["seq_len"], settings.model.vocab_size, cfg["train"]["seed"])
    return launch.spawn(trainer.train, world, cfg)


# The config tree lives inside the package (ringfa4/configs, with an __init__.py because Hydra
# looks packaged configs up as a module), not in a top-level configs/ folder, so that an installed
# `ringfa4-train` finds it without a source checkout.
@hydra.main(version_base="1.3", config_path="pkg://ringfa4.configs", config_name="config")
def _app(cfg):
    try:
        plain = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
        plain["run_dir"] = HydraConfig.get().runtime.output_dir
        run(plain)
    except (config.ConfigError, FileNotFoundError, MissingMandatoryValue) as e:
        raise SystemExit(f"ringfa4-train: bad configuration: {e}") from None


def main():
    _app()


if __name__ == "__main__":
    main()
