"""The training job's settings: typed dataclasses registered with Hydra's ConfigStore.

Hydra composes the YAML tree of ringfa4/configs (and any recipe on its search path) over the
schema ``JobConfig`` stored here, so a value of the wrong type is refused while composing.
``OmegaConf.to_object`` then builds the dataclasses, whose ``__post_init__`` checks every value
that does not depend on the world size; ``resolve`` checks the rest once the world size is known.
Every error names the setting and says what it needs, before any worker starts or touches a GPU.
"""
import dataclasses
from dataclasses import dataclass, field
from typing import Any, List, Optional

import hydra
import torch
from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

from ringfa4 import backends, documents
from ringfa4.nn import ModelArgs
from ringfa4.nn.model import ACTIVATION_CHECKPOINTING
from ringfa4.ring.heads import check_split
from ringfa4.ring.layout import LAYOUTS, required_multiple
from ringfa4.train import checkpoint, metrics

MIXED_PRECISION = {"bf16": torch.bfloat16, "fp32": None}
DATA_KINDS = ("synthetic", "text", "tokens")
DEVICES = ("auto", "cuda", "cpu")
ROPE_POSITIONS = ("continue", "restart")
# Without train.warmup_steps, warmup takes train.steps // this (15 of the default 150).
DEFAULT_WARMUP_DIVISOR = 10


class ConfigError(ValueError):
    """A setting that cannot work; the message names it and says what it needs."""


def _positive_int(value, name, allow_auto=False):
    if isinstance(value, bool) or not isinstance(value, int) or not (value >= 1 or (allow_auto and value == -1)):
        need = "a positive integer or -1 (the rest of the world)" if allow_auto else "a positive integer"
        raise ConfigError(f"{name} must be {need}, got {value!r}")
    return value


def _one_of(value, choices, name):
    if value not in choices:
        raise ConfigError(f"{name} must be one of {', '.join(map(str, choices))}; got {value!r}")
    return value


def _model_args(self):
    """The ringfa4.nn.ModelArgs these settings describe."""
    return ModelArgs(**{f.name: getattr(self, f.name) for f in dataclasses.fields(ModelArgs)})


def _check_model(self):
    try:
        self.args().check()
    except (TypeError, ValueError) as e:
        raise ConfigError(f"model config: {e}") from None


# The model's fields are ModelArgs' own (documented there), plus the preset's name: generated
# from ModelArgs so that a field added to the model is a setting without being listed again.
ModelConfig = dataclasses.make_dataclass(
    "ModelConfig",
    [("name", str, field(default="custom"))]
    + [(f.name, f.type, field(default=MISSING if f.default is dataclasses.MISSING else f.default))
       for f in dataclasses.fields(ModelArgs)],
    namespace={"args": _model_args, "__post_init__": _check_model,
               "__doc__": "Model shape: the fields of ringfa4.nn.ModelArgs, and `name` (the preset's name)."})
ModelConfig.__module__ = __name__  # so that the dataclass pickles into spawned workers


@dataclass
class DataConfig:
    """Where training tokens come from."""
    kind: str = "text"
    """synthetic (random tokens over model.vocab_size, for throughput), text (byte-level tokens of
    text files) or tokens (a memory-mapped file of token ids)"""
    paths: Any = field(default_factory=list)
    """kind=text: a file or glob, or a list of them, read one after another; empty means the small
    corpus shipped in the package"""
    path: Optional[str] = None
    """kind=tokens: the token file (nanoGPT's train.bin, Megatron's .bin without its .idx)"""
    dtype: str = "uint16"
    """kind=tokens: uint16, or uint32 for vocabularies over 65536 ids"""
    eod_token: Optional[int] = None
    """kind=tokens: the id that ends every document (it belongs to the document it ends); null:
    the stream has no document boundaries"""
    document_separator: str = "\n\n"
    """kind=text: the text that ends every document (the shipped corpus separates its stories and
    drills by a blank line); empty: no document boundaries"""
    document_masking: Optional[bool] = None
    """attention stays inside each document (packed documents, ringfa4.documents); null: on where
    the data has document boundaries"""
    rope_positions: str = "continue"
    """RoPE positions: continue (positions in the packed sequence) or restart (from 0 in every document)"""

    def __post_init__(self):
        _one_of(self.kind, DATA_KINDS, "data.kind")
        _one_of(self.rope_positions, ROPE_POSITIONS, "data.rope_positions")
        if self.eod_token is not None and (self.kind != "tokens" or self.eod_token < 0):
            raise ConfigError(f"data.eod_token must be a token id >= 0 of data=tokens, got {self.eod_token} "
                              f"with data.kind={self.kind}")
        if self.boundaries() is None and (self.document_masking or self.rope_positions == "restart"):
            raise ConfigError(f"data.document_masking=true and data.rope_positions=restart need document "
                              f"boundaries: data.eod_token for data=tokens, data.document_separator for data=text "
                              f"(data.kind={self.kind} has none here)")
        if isinstance(self.paths, str):
            self.paths = [self.paths]
        if not isinstance(self.paths, list) or not all(isinstance(p, str) and p for p in self.paths):
            raise ConfigError(f"data.paths must be a file or glob, or a list of them; got {self.paths!r}")
        if self.kind == "tokens":
            if not self.path:
                raise ConfigError("data=tokens needs data.path (the token file)")

    def boundaries(self):
        """The token ids that end a document (a tuple), or None when the data has no boundaries."""
        if self.kind == "tokens" and self.eod_token is not None:
            return (self.eod_token,)
        if self.kind == "text" and self.document_separator:
            return tuple(self.document_separator.encode())
        return None

    @property
    def masking(self):
        """Whether attention is masked to documents (data.document_masking, or its default)."""
        return self.boundaries() is not None if self.document_masking is None else self.document_masking


@dataclass
class ParallelConfig:
    """How the ranks split the work: dp_shard * cp must equal the world size."""
    cp: int = -1
    """context-parallel ranks per sequence (the attention ring); -1: the rest of the world"""
    dp_shard: int = 1
    """data-parallel ranks; parameters are sharded over dp_shard * cp; -1: the rest of the world"""
    layout: str = "zigzag"
    """zigzag (causal load balance, train.seq_len % (2 * cp) == 0), contiguous, document_zigzag
    (zigzag inside every document) or document_balanced (documents whole where they can be, the
    work balanced over the ranks, the ring stopped after the farthest hop needed); the document
    layouts need document masking"""
    backend: str = "auto"
    """attention kernels: auto, cute, fa4 or torch"""
    deterministic: bool = False
    """attention backward gives bit-identical gradients run to run (reproducible runs, bitwise
    resume checks), at some cost in backward speed"""
    cp_heads: int = 1
    """head group of 2-D context parallelism: the cp ranks of a sequence are a ring of cp / cp_heads
    head groups of cp_heads consecutive ranks, whose all-to-all trades sequence for heads
    (ringfa4.ring.heads); it must divide parallel.cp and the model's heads, and divide or be a
    multiple of its kv heads; size it with python -m ringfa4.plan"""

    def __post_init__(self):
        _positive_int(self.cp_heads, "parallel.cp_heads")
        _positive_int(self.cp, "parallel.cp", allow_auto=True)
        _positive_int(self.dp_shard, "parallel.dp_shard", allow_auto=True)
        if self.cp == -1 and self.dp_shard == -1:
            raise ConfigError("at most one of parallel.cp and parallel.dp_shard may be -1")
        _one_of(self.layout, LAYOUTS, "parallel.layout")
        _one_of(self.backend, ("auto",) + backends.NAMES, "parallel.backend")


@dataclass
class TrainConfig:
    """The optimisation loop, its precision and its checkpoints."""
    seq_len: int = 256
    """tokens per sequence (global positions; each cp rank holds seq_len / cp)"""
    global_batch: int = 8
    """sequences per step over all data-parallel ranks"""
    steps: int = 150
    """optimizer steps of the whole run (a resumed run continues to this step)"""
    lr: float = 3.0e-3
    """peak learning rate, reached at the end of warmup"""
    min_lr: float = 3.0e-4
    """learning rate at the last step, after cosine decay"""
    warmup_steps: Optional[int] = None
    """steps of linear warmup; null: a tenth of train.steps"""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay of matrices (norm gains never decay)"""
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    """AdamW's two moment decay rates, each in [0, 1)"""
    grad_clip: Optional[float] = 1.0
    """largest global gradient norm (larger gradients are scaled down); null: no clipping"""
    mixed_precision: str = "auto"
    """auto (bf16 params and compute on GPU, fp32 on CPU), bf16 or fp32"""
    activation_checkpointing: str = "none"
    """what each block recomputes in backward: none, pointwise (norms, RoPE and activations; the
    matmuls' and the attention's outputs are kept), selective (all but the attention) or full
    (see ringfa4.nn.model.Block)"""
    compile: bool = False
    """put each block through torch.compile (the attention stays one custom operator inside)"""
    device: str = "auto"
    """auto, cuda or cpu"""
    seed: int = 0
    """seeds the initial weights, the data order and every rank's generator"""
    log_interval: int = 10
    """steps between progress lines (and metrics.jsonl records)"""
    metrics: List[str] = field(default_factory=lambda: ["console", "jsonl"])
    """where each log interval's record goes (rank 0 only): console, jsonl (run_dir/metrics.jsonl),
    tensorboard (run_dir/tensorboard; pip install "ringfa4[tensorboard]"), wandb (run_dir/wandb;
    pip install "ringfa4[wandb]"; WANDB_MODE=offline needs no network or account)"""
    checkpoint_dir: Optional[str] = None
    """set to write DCP checkpoints (on storage every rank sees)"""
    checkpoint_interval: int = 100
    """steps between checkpoints (and one at the last step)"""
    checkpoint_keep: int = 2
    """newest checkpoints kept; 0 keeps all"""
    resume: bool = False
    """continue from the newest checkpoint in checkpoint_dir that passes its integrity check"""

    def __post_init__(self):
        for name in ("seq_len", "global_batch", "steps", "log_interval", "checkpoint_interval"):
            _positive_int(getattr(self, name), f"train.{name}")
        if self.warmup_steps is not None and not 0 <= self.warmup_steps <= self.steps:
            raise ConfigError(f"train.warmup_steps must be in [0, train.steps={self.steps}] (or null: a tenth "
                              f"of train.steps), got {self.warmup_steps}")
        if not self.lr > 0 or not 0 <= self.min_lr <= self.lr:
            raise ConfigError(f"need train.lr > 0 and 0 <= train.min_lr <= train.lr, got {self.lr}, {self.min_lr}")
        if not self.weight_decay >= 0:
            raise ConfigError(f"train.weight_decay must be >= 0, got {self.weight_decay}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ConfigError(f"train.betas must be two values in [0, 1), got {list(self.betas)}")
        if self.grad_clip is not None and not self.grad_clip > 0:
            raise ConfigError(f"train.grad_clip must be > 0 (or null: no clipping), got {self.grad_clip}")
        _one_of(self.mixed_precision, ("auto",) + tuple(MIXED_PRECISION), "train.mixed_precision")
        _one_of(self.activation_checkpointing, ACTIVATION_CHECKPOINTING, "train.activation_checkpointing")
        _one_of(self.device, DEVICES, "train.device")
        if self.checkpoint_keep < 0:
            raise ConfigError(f"train.checkpoint_keep must be >= 0 (0 keeps all), got {self.checkpoint_keep}")
        if self.resume and not self.checkpoint_dir:
            raise ConfigError("train.resume=true needs train.checkpoint_dir")
        if metrics.sink_problem(self.metrics):
            raise ConfigError(f"train.metrics {metrics.sink_problem(self.metrics)}")

    @property
    def warmup(self):
        """train.warmup_steps, or a tenth of train.steps when it is not set."""
        return self.steps // DEFAULT_WARMUP_DIVISOR if self.warmup_steps is None else self.warmup_steps


@dataclass
class JobConfig:
    """A training run: the schema the config tree is composed over."""
    model: ModelConfig = MISSING
    """model shape (config group `model`: tiny, llama3-1b, llama3-8b, ...)"""
    data: DataConfig = field(default_factory=DataConfig)
    """token source (config group `data`: text, tokens, synthetic)"""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """how the ranks split the work (mesh, layout, attention backend)"""
    train: TrainConfig = field(default_factory=TrainConfig)
    """the optimisation loop, its precision and its checkpoints"""
    run_dir: Optional[str] = None
    """where metrics.jsonl is written; the entry point sets Hydra's output folder"""


ConfigStore.instance().store(name="job_schema", node=JobConfig)


def to_job(cfg):
    """The JobConfig of a composed DictConfig; raises ConfigError naming a bad value."""
    return OmegaConf.to_object(cfg)


def compose(*overrides):
    """The JobConfig that `ringfa4-train <overrides>` runs, composed in-process (benches, tests);
    raises ConfigError naming a bad value."""
    with hydra.initialize_config_module(config_module="ringfa4.configs", version_base="1.3"):
        return to_job(hydra.compose("config", overrides=list(overrides)))


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
    cp_heads: int = 1


def device_type(train_cfg):
    wanted = train_cfg.device
    if wanted == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if wanted == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device=cuda but torch sees no CUDA device")
    return wanted


def _mesh_sizes(par, world_size):
    cp, dp_shard = par.cp, par.dp_shard
    if cp == -1 or dp_shard == -1:
        given = dp_shard if cp == -1 else cp
        if world_size % given:
            raise ConfigError(f"world size {world_size} is not a multiple of "
                              f"{'parallel.dp_shard' if cp == -1 else 'parallel.cp'}={given}")
        cp, dp_shard = (world_size // given, given) if cp == -1 else (given, world_size // given)
    if cp * dp_shard != world_size:
        raise ConfigError(f"parallel.cp * parallel.dp_shard = {cp} * {dp_shard} = {cp * dp_shard} "
                          f"must equal the world size {world_size}")
    return cp, dp_shard


def _check_head_group(cp_heads, cp, model):
    if cp % cp_heads:
        raise ConfigError(f"parallel.cp_heads={cp_heads} must divide parallel.cp={cp} (cp = ring x head group)")
    try:
        check_split(model.n_heads, model.n_kv_heads, cp_heads)
    except ValueError as e:
        raise ConfigError(f"parallel.cp_heads={cp_heads}: {e}") from None


def resolve(job, world_size, dev_type):
    """Settings for ``job`` on ``world_size`` ranks of ``dev_type``; raises ConfigError."""
    par, train = job.parallel, job.train
    cp, dp_shard = _mesh_sizes(par, world_size)
    if par.layout in documents.LAYOUTS and not job.data.masking:
        raise ConfigError(f"parallel.layout={par.layout} follows the documents: it needs data.document_masking")
    _check_head_group(par.cp_heads, cp, job.model.args())
    multiple = required_multiple(cp // par.cp_heads, par.layout, par.cp_heads)
    if train.seq_len % multiple:
        over = "" if par.cp_heads == 1 else f" over parallel.cp_heads={par.cp_heads} x ring {cp // par.cp_heads}"
        raise ConfigError(f"train.seq_len={train.seq_len} must be a multiple of {multiple} "
                          f"({'2 * ' if par.layout == 'zigzag' else ''}parallel.cp) for layout {par.layout}{over}")
    if train.global_batch % dp_shard:
        raise ConfigError(f"train.global_batch={train.global_batch} must be a multiple of "
                          f"parallel.dp_shard={dp_shard}")
    precision = train.mixed_precision
    if precision == "auto":
        precision = "bf16" if dev_type == "cuda" else "fp32"
    if train.checkpoint_dir and not train.resume and checkpoint.complete_steps(train.checkpoint_dir):
        raise ConfigError(f"train.checkpoint_dir={train.checkpoint_dir} already holds checkpoints of steps "
                          f"{checkpoint.complete_steps(train.checkpoint_dir)}: pass train.resume=true to "
                          f"continue that run, or choose another train.checkpoint_dir")
    return Settings(job.model.args(), cp, dp_shard, par.layout, par.backend, MIXED_PRECISION[precision],
                    train.global_batch // dp_shard, par.cp_heads)


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
