"""One rank of a training run: mesh, model, optimizer, data, loop, checkpoints."""
import json
import math
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ringfa4.nn import Transformer, build_mesh, parallelize, shard_sequence
from ringfa4.nn.parallel import CP, DP_SHARD
from ringfa4.ring import comm
from ringfa4.train import checkpoint, config, data, metrics


def lr_at(step, train_cfg):
    """Linear warmup to train.lr over warmup_steps, then cosine decay to train.min_lr at train.steps
    (step counts from 1)."""
    lr, min_lr, warmup, steps = train_cfg["lr"], train_cfg["min_lr"], train_cfg["warmup_steps"], train_cfg["steps"]
    if step <= warmup:
        return lr * step / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * progress))


def build_optimizer(model, train_cfg):
    """AdamW; matrices decay, norm gains do not."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": train_cfg["weight_decay"]},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=train_cfg["lr"], betas=tuple(train_cfg["betas"]))


def loss_share(model, tokens, labels, positions, global_tokens):
    """This rank's share of the mean next-token loss over the global batch: its token-loss sum
    divided by the token count of the whole global batch. Shares add up to the loss over ranks,
    and so do their gradients (FSDP sums them, see parallelize)."""
    return model(tokens, positions, labels) / global_tokens


def make_batch(sampler, position, settings, mesh, seq_len, device):
    """This rank's tokens, labels and global positions for the global batch starting at sample ``position``."""
    first = position + mesh.get_local_rank(DP_SHARD) * settings.local_batch
    samples = data.load_samples(sampler, first, settings.local_batch, settings.model.vocab_size)
    positions = torch.arange(seq_len).unsqueeze(0)
    tokens, labels, positions = shard_sequence((samples[:, :-1], samples[:, 1:], positions),
                                               mesh[CP].get_group(), settings.layout)
    return tokens.to(device), labels.to(device), positions.to(device)


def train(cfg, rank, world_size, local_rank):
    """Run the training described by the composed config ``cfg`` (a plain dict) on this rank;
    the process group must not be initialised yet. Returns {step: global loss} of the steps run."""
    train_cfg = cfg["train"]
    dev_type = config.device_type(train_cfg)
    settings = config.resolve(cfg, world_size, dev_type)
    sampler = data.build_sampler(cfg["data"], train_cfg["seq_len"], settings.model.vocab_size, train_cfg["seed"])
    if dev_type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", rank=rank, world_size=world_size, device_id=device,
                                pg_options=comm.nccl_options())
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        backend = config.check_backend(settings, device)
        return _train(cfg, settings, backend, sampler, device)
    finally:
        dist.destroy_process_group()


def _train(cfg, settings, backend, sampler, device):
    train_cfg = cfg["train"]
    rank, world = dist.get_rank(), dist.get_world_size()
    seq_len, steps = train_cfg["seq_len"], train_cfg["steps"]
    mesh = build_mesh(device.type, settings.dp_shard, settings.cp)
    with torch.device("meta"):
        model = Transformer(settings.model)
    parallelize(model, mesh, layout=settings.layout, backend=backend, param_dtype=settings.param_dtype,
                activation_checkpointing=train_cfg["activation_checkpointing"])
    model.to_empty(device=device)
    model.init_weights(train_cfg["seed"])
    optimizer = build_optimizer(model, train_cfg)
    torch.manual_seed(train_cfg["seed"] + rank)

    start, position = 0, 0
    ckpt_dir = train_cfg["checkpoint_dir"]
    if train_cfg["resume"]:
        done = checkpoint.complete_steps(ckpt_dir)
        if done:
            start, position = checkpoint.load(ckpt_dir, done[-1], model, optimizer, device)
    if rank == 0:
        print(f"ringfa4-train: {world} rank(s) on {device.type}, dp_shard={settings.dp_shard} x cp={settings.cp} "
              f"({settings.layout}, backend {backend}), model {cfg['model'].get('name', '?')} with "
              f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, "
              f"seq_len={seq_len}, global batch {train_cfg['global_batch']} x {seq_len} tokens"
              + (f", resumed at step {start}" if start else ""), flush=True)

    global_tokens = train_cfg["global_batch"] * seq_len
    flops_per_step = settings.model.flops_per_token(seq_len) * global_tokens
    peak = metrics.peak_flops(device)
    progress = metrics.Progress(steps) if rank == 0 else None
    metrics_path = Path(cfg["run_dir"]) / "metrics.jsonl" if cfg.get("run_dir") and rank == 0 else None
    losses, pending = {}, []
    last_time, last_step = time.perf_counter(), start
    for step in range(start + 1, steps + 1):
        lr = lr_at(step, train_cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr
        tokens, labels, positions = make_batch(sampler, position, settings, mesh, seq_len, device)
        share = loss_share(model, tokens, labels, positions, global_tokens)
        share.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), train_cfg["grad_clip"])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        position += train_cfg["global_batch"]
        loss = share.detach().clone()
        dist.all_reduce(loss)
        pending.append((step, loss))

        if step % train_cfg["log_interval"] == 0 or step == steps:
            for s, value in pending:
                losses[s] = value.item()
            pending.clear()
            now = time.perf_counter()
            elapsed = (now - last_time) / (step - last_step)
            record = {"step": step, "loss": losses[step], "lr": lr,
                      "grad_norm": float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm),
                      "tokens_per_s": global_tokens / elapsed,
                      "tflops_per_device": flops_per_step / world / elapsed / 1e12,
                      "mfu": flops_per_step / world / elapsed / peak if peak else None,
                      "peak_mem_gib": metrics.peak_memory_gib(device)}
            last_time, last_step = now, step
            if rank == 0:
                progress.update(step, record)
                if metrics_path:
                    with open(metrics_path, "a") as f:
                        f.write(json.dumps(record) + "\n")
        if ckpt_dir and (step % train_cfg["checkpoint_interval"] == 0 or step == steps):
            saving = time.perf_counter()
            checkpoint.save(ckpt_dir, step, model, optimizer, position, device, train_cfg["checkpoint_keep"])
            last_time += time.perf_counter() - saving  # throughput counts training, not saving
    return losses
