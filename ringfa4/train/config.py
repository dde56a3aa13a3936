"""Checks of a composed training config, run before any GPU work; every error names the setting."""
from dataclasses import dataclass

import torch

from ringfa4 import backends
from ringfa4.nn import ModelArgs
from ringfa4.train import checkpoint

LAYOUT_MULTIPLE = {"zigzag": 2, "contiguous": 1}
MIXED_PRECISION = {"bf16": torch.bfloat16, "fp32": None}


class ConfigError(ValueError):
    """A setting that cannot work; the message names it and says what it needs."""


@dataclass(frozen=True)
class Settings:
    """What the config resolves to for a given world size and device type."""
    model: ModelArgs
    cp: int
    dp_shard: int
    layout: str
    backend: str
    param_dtype: object
    local_batch: int


def _positive_int(value, name, allow_auto=False):
    if isinstance(value, bool) or not isinstance(value, int) or not (value >= 1 or (allow_auto and value == -1)):
        need = "a positive integer or -1 (the rest of the world)" if allow_auto else "a positive integer"
        raise ConfigError(f"{name} must be {need}, got {value!r}")
    return value


def device_type(train_cfg):
    wanted = train_cfg["device"]
    if wanted == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if wanted == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device=cuda but torch sees no CUDA device")
    if wanted not in ("cuda", "cpu"):
        raise ConfigError(f"train.device must be auto, cuda or cpu, got {wanted!r}")
    return wanted


def resolve(cfg, world_size, dev_type):
    """Settings for ``cfg`` on ``world_size`` ranks of ``dev_type``; raises ConfigError."""
    par, train = cfg["parallel"], cfg["train"]
    cp = _positive_int(par["cp"], "parallel.cp", allow_auto=True)
    dp_shard = _positive_int(par["dp_shard"], "parallel.dp_shard", allow_auto=True)
    if cp == -1 and dp_shard == -1:
        raise ConfigError("at most one of parallel.cp and parallel.dp_shard may be -1")
    if cp == -1 or dp_shard == -1:
        given = dp_shard if cp == -1 else cp
        if world_size % given:
            raise ConfigError(f"world size {world_size} is not a multiple of "
                              f"{'parallel.dp_shard' if cp == -1 else 'parallel.cp'}={given}")
        cp, dp_shard = (world_size // given, given) if cp == -1 else (given, world_size // given)
    if cp * dp_shard != world_size:
        raise ConfigError(f"parallel.cp * parallel.dp_shard = {cp} * {dp_shard} = {cp * dp_shard} "
                          f"must equal the world size {world_size}")

    layout = par["layout"]
    if layout not in LAYOUT_MULTIPLE:
        raise ConfigError(f"parallel.layout must be one of {sorted(LAYOUT_MULTIPLE)}, got {layout!r}")
    seq_len = _positive_int(train["seq_len"], "train.seq_len")
    multiple = LAYOUT_MULTIPLE[layout] * cp
    if seq_len % multiple:
        raise ConfigError(f"train.seq_len={seq_len} must be a multiple of {multiple} "
                          f"({'2 * ' if layout == 'zigzag' else ''}parallel.cp) for layout {layout}")
    backend = par["backend"]
    if backend != "auto" and backend not in backends.NAMES:
        raise ConfigError(f"parallel.backend must be one of {('auto',) + backends.NAMES}, got {backend!r}")

    fields = ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "norm_eps",
              "rope_theta", "tie_embeddings")
    try:
        model = ModelArgs(**{f: cfg["model"][f] for f in fields})
        model.check()
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"model config: {e}") from None

    global_batch = _positive_int(train["global_batch"], "train.global_batch")
    if global_batch % dp_shard:
        raise ConfigError(f"train.global_batch={global_batch} must be a multiple of parallel.dp_shard={dp_shard}")
    steps = _positive_int(train["steps"], "train.steps")
    if not 0 <= train["warmup_steps"] <= steps:
        raise ConfigError(f"train.warmup_steps must be in [0, train.steps={steps}], got {train['warmup_steps']}")
    if not train["lr"] > 0 or not 0 <= train["min_lr"] <= train["lr"]:
        raise ConfigError(f"need train.lr > 0 and 0 <= train.min_lr <= train.lr, got {train['lr']}, {train['min_lr']}")
    _positive_int(train["log_interval"], "train.log_interval")

    precision = train["mixed_precision"]
    if precision == "auto":
        precision = "bf16" if dev_type == "cuda" else "fp32"
    if precision not in MIXED_PRECISION:
        raise ConfigError(f"train.mixed_precision must be auto, bf16 or fp32, got {train['mixed_precision']!r}")

    ckpt_dir = train["checkpoint_dir"]
    if train["resume"] and not ckpt_dir:
        raise ConfigError("train.resume=true needs train.checkpoint_dir")
    if ckpt_dir:
        _positive_int(train["checkpoint_interval"], "train.checkpoint_interval")
        if not train["resume"] and checkpoint.complete_steps(ckpt_dir):
            raise ConfigError(f"train.checkpoint_dir={ckpt_dir} already holds checkpoints of steps "
                              f"{checkpoint.complete_steps(ckpt_dir)}: pass train.resume=true to continue "
                              f"that run, or choose another train.checkpoint_dir")
    return Settings(model, cp, dp_shard, layout, backend, MIXED_PRECISION[precision],
                    global_batch // dp_shard)


def check_backend(settings, device):
    """The backend that will run the model's attention (forward and backward) on ``device``:
    parallel.backend itself, which must be able to, or what "auto" resolves to."""
    args = settings.model
    dtype = settings.param_dtype or torch.float32
    # Tiny probes: unsupported_reason looks at device, dtype, head_dim and layout, not at values.
    q = torch.empty(1, 128, args.n_heads, args.head_dim, device=device, dtype=dtype, requires_grad=True)
    kv = torch.empty(1, 128, args.n_kv_heads, args.head_dim, device=device, dtype=dtype, requires_grad=True)
    names = backends.AUTO_ORDER if settings.backend == "auto" else (settings.backend,)
    reasons = {name: backends.get(name).unsupported_reason(q, kv, kv, True, True) for name in names}
    usable = [name for name in names if reasons[name] is None]
    if not usable:
        raise ConfigError(f"parallel.backend={settings.backend} cannot run this model on {device}: "
                          + "; ".join(f"{name}: {reason}" for name, reason in reasons.items()))
    return usable[0]
