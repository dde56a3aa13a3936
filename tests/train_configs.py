"""Compose the packaged Hydra config the way `ringfa4-train` does, for in-process tests."""
from pathlib import Path

from ringfa4.train import config

RECIPES_DIR = Path(__file__).resolve().parent.parent / "configs"

# A model and run small enough for a few steps in seconds on a 2-core CI machine.
SMALL = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=96",
         "train.seq_len=64", "train.global_batch=2", "train.log_interval=1", "train.warmup_steps=2"]


def composed(*overrides):
    """The config.JobConfig that `ringfa4-train <overrides>` runs; raises ConfigError on a bad value."""
    return config.compose(*overrides)
