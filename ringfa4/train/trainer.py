"""One rank of a training run, in the pieces bench/train.py and the tests use as well:

    build        settings, mesh, model (FSDP2 x CP), optimizer and sampler of a JobConfig
    make_batch   this rank's share of a global batch
    train_step   forward, backward, clipping, optimizer step; the global loss
    Log          progress line and metrics.jsonl; stops the run on a non-finite loss
    resume/save  DCP checkpoints (ringfa4.train.checkpoint)

``fit`` joins them into the loop that `ringfa4-train` runs on every rank (``train``: the same,
inside the rank's process group).
"""
import contextlib
import math
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from ringfa4 import flops
from ringfa4.nn import Transformer, build_mesh, parallelize, shard_sequence
from ringfa4.nn.parallel import CP, DP_SHARD, head_group
from ringfa4.ring import documents as ring_documents
from ringfa4.train import checkpoint, config, data, launch, metrics


class NonFiniteLoss(FloatingPointError):
    """The loss became NaN or infinite; the run stops without writing a checkpoint."""


def say(message):
    """A line of the run's log (rank 0's stdout)."""
    if dist.get_rank() == 0:
        print(f"ringfa4-train: {message}", flush=True)


def lr_at(step, train_cfg):
    """Linear warmup to train.lr over the warmup steps, then cosine decay to train.min_lr at
    train.steps (step counts from 1)."""
    lr, min_lr, warmup, steps = train_cfg.lr, train_cfg.min_lr, train_cfg.warmup, train_cfg.steps
    if step <= warmup:
        return lr * step / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * progress))


def build_optimizer(model, train_cfg):
    """AdamW; matrices decay, norm gains do not. On GPUs the fused implementation (one kernel per
    parameter group instead of a foreach kernel per operation, each rereading the fp32 state)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": train_cfg.weight_decay},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    fused = all(p.is_cuda for p in params)
    return torch.optim.AdamW(groups, lr=train_cfg.lr, betas=tuple(train_cfg.betas), fused=fused)


@dataclass
class Run:
    """Everything one rank trains with."""
    job: config.JobConfig
    settings: config.Settings
    device: torch.device
    backend: str
    mesh: object
    model: Transformer
    optimizer: torch.optim.Optimizer
    sampler: object
    documents: object = None
    """data.DocumentBoundaries of the data, or None when it has none"""


def build(job, device):
    """The Run of ``job`` on this rank (the process group is up); raises ConfigError naming a
    setting this world size or device cannot honour."""
    settings = config.resolve(job, dist.get_world_size(), device.type)
    backend = config.check_backend(settings, device)
    sampler = data.build_sampler(job.data, job.train.seq_len, settings.model.vocab_size, job.train.seed)
    mesh = build_mesh(device.type, settings.dp_shard, settings.cp, settings.cp_heads)
    with torch.device("meta"):
        model = Transformer(settings.model)
    parallelize(model, mesh, layout=settings.layout, backend=backend, param_dtype=settings.param_dtype,
                activation_checkpointing=job.train.activation_checkpointing, compile=job.train.compile,
                deterministic=job.parallel.deterministic)
    model.to_empty(device=device)
    model.init_weights(job.train.seed)
    ends = job.data.boundaries()
    return Run(job, settings, device, backend, mesh, model, build_optimizer(model, job.train), sampler,
               None if ends is None else data.DocumentBoundaries(ends))


def local_samples(run, position):
    """This data-parallel rank's whole sequences (local_batch, seq_len + 1) of the global batch
    that starts at sample ``position``."""
    first = position + run.mesh.get_local_rank(DP_SHARD) * run.settings.local_batch
    return data.load_samples(run.sampler, first, run.settings.local_batch, run.settings.model.vocab_size)


def make_batch(run, position):
    """This rank's tokens, labels, RoPE positions and the batch's cu_seqlens (None without document
    masking; on the CPU, the whole local batch) for the global batch starting at sample
    ``position``: its data-parallel rows, sharded over the ring in the run's layout."""
    samples = local_samples(run, position)
    inputs, docs = samples[:, :-1], run.documents
    positions = torch.arange(inputs.shape[1]).expand_as(inputs)
    if docs is not None and run.job.data.rope_positions == "restart":
        positions = docs.positions(inputs)
    cu_seqlens = docs.cu_seqlens(inputs) if run.job.data.masking else None
    batch = shard_sequence((inputs, samples[:, 1:], positions), run.mesh[CP].get_group(),
                           run.settings.layout, head_group=head_group(run.mesh), cu_seqlens=cu_seqlens)
    return (*(t.to(run.device) for t in batch), cu_seqlens)


def loss_share(model, tokens, labels, positions, global_tokens, cu_seqlens=None):
    """This rank's share of the mean next-token loss over the global batch: its token-loss sum
    divided by the token count of the whole global batch. Shares add up to the loss over ranks,
    and so do their gradients (FSDP sums them, see parallelize). ``cu_seqlens``: packed documents."""
    return model(tokens, positions, labels, cu_seqlens=cu_seqlens) / global_tokens


def train_step(model, optimizer, batch, global_tokens, grad_clip, context=contextlib.nullcontext):
    """One optimizer step on ``batch`` (tokens, labels, positions[, cu_seqlens]) under ``context`` (entered
    around forward and backward); returns the global loss (all-reduced, on device) and the
    gradient norm before clipping (grad_clip None: no clipping)."""
    with context():
        tokens, labels, positions, *cu_seqlens = batch
        share = loss_share(model, tokens, labels, positions, global_tokens, *cu_seqlens)
        share.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), math.inf if grad_clip is None else grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    loss = share.detach().clone()
    dist.all_reduce(loss)
    return loss, grad_norm


class Log:
    """Losses of the steps run, and a record every log interval to the sinks of train.metrics.
    Reading a loss syncs with the device, so losses are read only when checked: at each log line
    and before each checkpoint; a NaN or infinite one raises NonFiniteLoss, on every rank alike
    (the loss is all-reduced).

    Model FLOPs (TFLOP/s, MFU) are ModelArgs.flops_per_token's, whose attention is dense causal.
    With packed documents a step counts less by the causal pairs its documents hide (each row's
    s (s + 1) / 2 causal pairs less its documents' flops.causal_pairs), counted on the host from
    each batch's cu_seqlens; one document per row counts as dense. A ring over documents also
    reports, summed over ranks since the run (this process) started, the ring steps it ran and
    skipped (no shared document), the K/V bytes the skipped steps did not read and the bytes
    its transfers did not send (a ring stopped early; rows no other rank reads;
    ringfa4.ring.documents.counting)."""

    def __init__(self, run, start):
        train, model = run.job.train, run.settings.model
        self.run, self.losses, self.pending = run, {}, []
        self.global_tokens = train.global_batch * train.seq_len
        self.flops_per_step = model.flops_per_token(train.seq_len) * self.global_tokens
        # flops_per_token counts a sequence of s tokens as s * s / 2 causal pairs, each at twice the
        # slope of its attention term in seq_len.
        self.pair_flops = 2 * (model.flops_per_token(1) - model.flops_per_token(0))
        self.seq_len, self.hidden_pairs = train.seq_len, 0
        # Data-parallel ranks hold different rows (the ranks of one ring share theirs): their
        # hidden pairs are summed at each log line.
        masked_dp = run.job.data.masking and run.settings.dp_shard > 1
        self.dp_group = run.mesh[DP_SHARD].get_group() if masked_dp else None
        self.peak = metrics.peak_flops(run.device)
        settings = run.settings
        self.ring_skips = run.job.data.masking and settings.cp // settings.cp_heads > 1
        self.ring = [0, 0, 0, 0]  # steps run, steps skipped, K/V bytes not read, bytes not sent
        # Rank 0 writes; in-process runs without a run directory (tests, benches) write to the console only.
        sinks = [s for s in train.metrics if run.job.run_dir or s == "console"] if dist.get_rank() == 0 else []
        self.writer = metrics.Writer(sinks, train.steps, run.job.run_dir, config=asdict(run.job))
        self.last_time, self.last_step = time.perf_counter(), start

    def counting(self):
        """The context a step runs in: counting the ring's steps over documents where there are."""
        return ring_documents.counting() if self.ring_skips else contextlib.nullcontext()

    def step(self, step, loss, cu_seqlens=None, count=None):
        """Keep step ``step``'s global loss (a device tensor) until the next check; count the causal
        pairs hidden by the documents of this rank's rows (``cu_seqlens`` on the host, every row
        starting a document as data.DocumentBoundaries makes them) and the ring steps of ``count``
        (what counting() yielded)."""
        self.pending.append((step, loss))
        if cu_seqlens is not None:
            self.hidden_pairs += flops.hidden_pairs(cu_seqlens.tolist(), self.seq_len)
        if count is not None:
            counts = (count.computed, count.skipped, count.skipped_kv_bytes, count.transfer_bytes_saved)
            self.ring = [total + sum(c.values()) for total, c in zip(self.ring, counts)]

    def _ring_record(self):
        """The record's ring fields, summed over every rank (a collective), or none."""
        if not self.ring_skips:
            return {}
        total = torch.tensor(self.ring, dtype=torch.int64, device=self.run.device)
        dist.all_reduce(total)
        run, skipped, not_read, not_sent = total.tolist()
        return {"ring_steps_run": run, "ring_steps_skipped": skipped,
                "ring_kv_gib_not_read": not_read / 2**30, "ring_gib_not_sent": not_sent / 2**30}

    def _take_hidden_pairs(self):
        """The causal pairs the documents of the whole global batch hid since the last record.
        Collective over the data-parallel ranks when they hold different rows; it runs after
        check() has read the losses, so it makes the steps wait for nothing more."""
        hidden, self.hidden_pairs = self.hidden_pairs, 0
        if self.dp_group is not None:
            total = torch.tensor([hidden], dtype=torch.int64, device=self.run.device)
            dist.all_reduce(total, group=self.dp_group)
            hidden = int(total.item())
        return hidden

    def exclude(self, seconds):
        """Leave ``seconds`` (a checkpoint save) out of the throughput."""
        self.last_time += seconds

    def check(self):
        """Read the pending losses; raise NonFiniteLoss at the first that is not finite."""
        for step, loss in self.pending:
            value = loss.item()
            if not math.isfinite(value):
                raise NonFiniteLoss(f"loss is {value} at step {step}: the run stops here and writes no checkpoint; "
                                    f"resume from the last checkpoint (train.resume=true), e.g. with a lower train.lr")
            self.losses[step] = value
        self.pending.clear()

    def write(self, step, lr, grad_norm):
        """Check the pending losses, then the progress line and metrics record of ``step``."""
        self.check()
        now = time.perf_counter()
        elapsed = (now - self.last_time) / (step - self.last_step)
        world = dist.get_world_size()
        flops_per_step, hidden = self.flops_per_step, self._take_hidden_pairs()
        if hidden:
            flops_per_step -= self.pair_flops * hidden / (step - self.last_step)
        record = {"step": step, "loss": self.losses[step], "lr": lr,
                  "grad_norm": float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm),
                  "tokens_per_s": self.global_tokens / elapsed,
                  "tflops_per_device": flops_per_step / world / elapsed / 1e12,
                  "mfu": flops_per_step / world / elapsed / self.peak if self.peak else None,
                  "peak_mem_gib": metrics.peak_memory_gib(self.run.device), **self._ring_record()}
        self.last_time, self.last_step = now, step
        self.writer.write(record)

    def close(self):
        self.writer.close()


def resume(run):
    """(step, data position) of the newest checkpoint that passes its check, loaded into the run;
    (0, 0) without one."""
    train = run.job.train
    if not train.resume:
        return 0, 0
    step = checkpoint.newest_valid(train.checkpoint_dir, say)
    if step is None:
        return 0, 0
    return checkpoint.load(train.checkpoint_dir, step, run.model, run.optimizer, run.device)


def save(run, step, position):
    train = run.job.train
    checkpoint.save(train.checkpoint_dir, step, run.model, run.optimizer, position, run.device,
                    train.checkpoint_keep)


def describe(run, start):
    settings, train = run.settings, run.job.train
    heads = f" (ring {settings.cp // settings.cp_heads} x cp_heads {settings.cp_heads})" if settings.cp_heads > 1 else ""
    say(f"{dist.get_world_size()} rank(s) on {run.device.type}, dp_shard={settings.dp_shard} x cp={settings.cp}{heads} "
        f"({settings.layout}, backend {run.backend}), model {run.job.model.name} with "
        f"{sum(p.numel() for p in run.model.parameters()) / 1e6:.1f}M parameters, "
        f"seq_len={train.seq_len}, global batch {train.global_batch} x {train.seq_len} tokens"
        + (f", documents masked (RoPE positions {run.job.data.rope_positions})" if run.job.data.masking else "")
        + (f", resumed at step {start}" if start else ""))
    if train.warmup_steps is None and train.warmup != config.TrainConfig().warmup:
        say(f"warmup scaled to {train.warmup} step(s), a tenth of train.steps={train.steps} "
            f"(set train.warmup_steps to choose)")


def fit(run):
    """Train from the newest good checkpoint (or step 1) to train.steps; returns {step: loss}."""
    train = run.job.train
    torch.manual_seed(train.seed + dist.get_rank())  # a resumed run restores the saved generators
    start, position = resume(run)
    describe(run, start)
    log = Log(run, start)
    try:
        for step in range(start + 1, train.steps + 1):
            lr = lr_at(step, train)
            for group in run.optimizer.param_groups:
                group["lr"] = lr
            batch = make_batch(run, position)
            with log.counting() as count:
                loss, grad_norm = train_step(run.model, run.optimizer, batch, log.global_tokens, train.grad_clip)
            position += train.global_batch
            log.step(step, loss, batch[-1], count)
            if step % train.log_interval == 0 or step == train.steps:
                log.write(step, lr, grad_norm)
            if train.checkpoint_dir and (step % train.checkpoint_interval == 0 or step == train.steps):
                log.check()  # a non-finite loss stops the run before it writes a checkpoint
                began = time.perf_counter()
                save(run, step, position)
                log.exclude(time.perf_counter() - began)
    finally:
        log.close()  # the records written so far reach their sinks, also when the run stops early
    return log.losses


def train(job, rank, world_size, local_rank):
    """Run the training described by ``job`` (a config.JobConfig) as ``rank``; the process group
    must not be initialised yet. Returns {step: global loss} of the steps run."""
    with launch.process_group(config.device_type(job.train), rank, world_size, local_rank) as device:
        return fit(build(job, device))
