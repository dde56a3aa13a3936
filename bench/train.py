"""Long-context training throughput: ringfa4's ring vs PyTorch context_parallel, one run, same GPUs.

    torchrun --nproc_per_node=2 bench/train.py --commit $(git rev-parse --short HEAD)
    python bench/train.py --tiny          # CPU smoke run: 2 gloo workers, tiny model, torch backend

The llama3-1b shape (ringfa4/configs/model/llama3-1b.yaml) at 65536 tokens per sequence, one
sequence per step, cp = all ranks, FSDP2 over the same ranks, bf16 params and compute, fp32
gradient reduction, activation checkpointing, AdamW, synthetic tokens. The model, batches and
initial weights are identical for both; only attention differs:
  ringfa4   ringfa4.ring_attention (backend auto: own CuTe kernels, else FA4, else torch), zigzag,
            K/V of the kv heads only travel the ring;
  torch_cp  torch.distributed.tensor.experimental.context_parallel over F.scaled_dot_product_attention
            with cuDNN, its default load balancer; K/V heads repeated to the query heads first (its
            ring has no GQA), as torchtitan does.
Per-GPU TFLOP/s count model FLOPs (ModelArgs.flops_per_token: 6 per matmul parameter per token
plus causal attention), not the recomputation; MFU divides by the dense bf16 peak. Rows go to
bench/results/train.json (or --out) and a table is printed last.
"""
import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from ringfa4.nn import ModelArgs, Transformer, build_mesh, parallelize, shard_sequence  # noqa: E402
from ringfa4.nn.parallel import CP  # noqa: E402
from ringfa4.ring import comm  # noqa: E402
from ringfa4.train import data, launch, metrics  # noqa: E402
from ringfa4.train.config import Settings, check_backend  # noqa: E402
from ringfa4.train.trainer import loss_share  # noqa: E402

CONFIGS = Path(__file__).resolve().parent.parent / "ringfa4" / "configs" / "model"
SEED = 0


class SDPAttention(nn.Module):
    """The attention PyTorch's context_parallel knows how to shard: SDPA on (b, h, s, d)."""

    def forward(self, q, k, v):
        repeat = q.shape[2] // k.shape[2]
        q, k, v = (t.transpose(1, 2) for t in (q, k.repeat_interleave(repeat, 2), v.repeat_interleave(repeat, 2)))
        if q.is_cuda:
            from torch.nn.attention import SDPBackend, sdpa_kernel
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return out.transpose(1, 2)


def model_args(name):
    cfg = OmegaConf.to_container(OmegaConf.load(CONFIGS / f"{name}.yaml"))
    cfg.pop("name")
    return ModelArgs(**cfg)


def build(impl, args, mesh, device, param_dtype, backend, recompute):
    with torch.device("meta"):
        model = Transformer(args)
    parallelize(model, mesh, layout="zigzag", backend=backend, param_dtype=param_dtype,
                activation_checkpointing=recompute)
    if impl == "torch_cp":
        for layer in model.layers:
            layer.attention.core = SDPAttention()
    model.to_empty(device=device)
    model.init_weights(SEED)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)


def step(impl, model, optimizer, sample, mesh, seq_len):
    tokens, labels = sample[:, :-1].contiguous(), sample[:, 1:].contiguous()
    positions = torch.arange(seq_len, device=sample.device).unsqueeze(0)
    if impl == "ringfa4":
        tokens, labels, positions = shard_sequence((tokens, labels, positions), mesh[CP].get_group(), "zigzag")
        share = loss_share(model, tokens, labels, positions, seq_len)
        share.backward()
    else:
        from torch.distributed.tensor.experimental import context_parallel
        buffers = [tokens, labels, positions]
        with context_parallel(mesh[CP], buffers=buffers, buffer_seq_dims=[1, 1, 1], no_restore_buffers=set(buffers)):
            share = loss_share(model, tokens, labels, positions, seq_len)
            share.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    loss = share.detach().clone()
    dist.all_reduce(loss)
    return loss


def measure(impl, opts, args, mesh, device, param_dtype, backend):
    model, optimizer = build(impl, args, mesh, device, param_dtype, backend, not opts.no_recompute)
    sampler = data.SyntheticSampler(args.vocab_size, opts.seq_len, SEED)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    losses = []
    for i in range(opts.steps):
        if i == opts.warmup:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            dist.barrier()
            start = time.perf_counter()
        losses.append(step(impl, model, optimizer, sampler[i].unsqueeze(0).to(device), mesh, opts.seq_len))
        if dist.get_rank() == 0 and (i < opts.warmup or i == opts.steps - 1):
            print(f"{impl}: step {i + 1}/{opts.steps} loss {losses[-1].item():.4f}", flush=True)
    losses = [x.item() for x in losses]
    elapsed = (time.perf_counter() - start) / (opts.steps - opts.warmup)
    flops = args.flops_per_token(opts.seq_len) * opts.seq_len / dist.get_world_size() / elapsed
    peak = metrics.peak_flops(device)
    row = {"impl": impl, "step_s": elapsed, "tokens_per_s": opts.seq_len / elapsed,
           "tflops_per_gpu": flops / 1e12, "mfu": flops / peak if peak else None,
           "peak_mem_gib": metrics.peak_memory_gib(device), "losses": losses}
    del model, optimizer
    return row


def worker(opts, rank, world, local_rank):
    if opts.tiny:
        device = torch.device("cpu")
        dist.init_process_group("gloo", rank=rank, world_size=world)
    else:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device,
                                pg_options=comm.nccl_options())
    try:
        args = model_args(opts.model)
        param_dtype = None if opts.tiny else torch.bfloat16
        if opts.seq_len % (2 * world):
            raise ValueError(f"--seq-len={opts.seq_len} must be a multiple of 2 * cp = {2 * world} (zigzag)")
        settings = Settings(args, world, 1, "zigzag", opts.backend, param_dtype, 1)
        backend = check_backend(settings, device)
        mesh = build_mesh(device.type, 1, world)
        rows = [measure("ringfa4", opts, args, mesh, device, param_dtype, backend)]
        rows[0]["backend"] = backend
        failed = None
        try:
            rows.append(measure("torch_cp", opts, args, mesh, device, param_dtype, backend))
        except Exception as e:  # kept in the results and printed; on GPU the run then exits non-zero
            failed = f"torch_cp could not run on {device.type}: {type(e).__name__}: {str(e).splitlines()[0]}"
        return {"rows": rows, "torch_cp_failed": failed, "world": world,
                "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    finally:
        dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="CPU smoke run: 2 gloo workers, tiny model, torch backend")
    p.add_argument("--model", default=None, help="model config name (default llama3-1b, tiny with --tiny)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default 65536, 256 with --tiny)")
    p.add_argument("--steps", type=int, default=None, help="steps per implementation (default 24, 4 with --tiny)")
    p.add_argument("--warmup", type=int, default=None, help="untimed first steps (default 4, 1 with --tiny)")
    p.add_argument("--backend", default=None, help="ringfa4 backend (default auto, torch with --tiny)")
    p.add_argument("--no-recompute", action="store_true", help="keep activations (no activation checkpointing)")
    p.add_argument("--commit", default=None, help="commit recorded in the results (default: git rev-parse)")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "train.json"))
    opts = p.parse_args()
    tiny = opts.tiny
    opts.model = opts.model or ("tiny" if tiny else "llama3-1b")
    opts.seq_len = opts.seq_len or (256 if tiny else 65536)
    opts.steps = opts.steps or (4 if tiny else 24)
    opts.warmup = opts.warmup if opts.warmup is not None else (1 if tiny else 4)
    opts.backend = opts.backend or ("torch" if tiny else "auto")
    if not 0 <= opts.warmup < opts.steps:
        p.error("--warmup must be in [0, --steps)")
    if opts.commit is None:
        try:
            opts.commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                         check=True, cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            opts.commit = "unknown"

    if launch.under_torchrun():
        rank = int(os.environ["RANK"])
        result = worker(opts, rank, int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"]))
        if rank != 0:
            return
    elif tiny:
        result = launch.spawn(worker, launch.CPU_WORKERS, opts)
    else:
        p.error("run under torchrun (torchrun --nproc_per_node=2 bench/train.py), or pass --tiny for the CPU run")

    rows = {r["impl"]: r for r in result["rows"]}
    report = {"device": result["device"], "gpus": result["world"], "date": datetime.date.today().isoformat(),
              "commit": opts.commit, "torch": torch.__version__, "model": opts.model, "seq_len": opts.seq_len,
              "cp": result["world"], "dp_shard": 1, "global_batch": 1, "dtype": "fp32" if tiny else "bf16",
              "recompute": not opts.no_recompute, "steps": opts.steps, "warmup": opts.warmup,
              "rows": result["rows"], "torch_cp_failed": result["torch_cp_failed"]}
    if "torch_cp" in rows:
        # Same weights, same first batch: the two rings must agree on the first loss (bf16 noise).
        a, b = rows["ringfa4"]["losses"][0], rows["torch_cp"]["losses"][0]
        report["first_loss_rel_diff"] = abs(a - b) / abs(b)
    Path(opts.out).parent.mkdir(parents=True, exist_ok=True)
    Path(opts.out).write_text(json.dumps(report, indent=2) + "\n")

    print(f"\n{opts.model}, {opts.seq_len} tokens/step, cp={result['world']} on {result['device']}, "
          f"{report['dtype']}, recompute={report['recompute']}, {opts.steps - opts.warmup} timed steps, commit {opts.commit}")
    print("| impl | backend | step s | tokens/s | TFLOP/s/GPU | MFU | peak mem GiB | loss first -> last |")
    print("|---|---|---|---|---|---|---|---|")
    for r in result["rows"]:
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
        print(f"| {r['impl']} | {r.get('backend', 'cuDNN SDPA')} | {r['step_s']:.3f} | "
              f"{r['tokens_per_s']:,.0f} | {r['tflops_per_gpu']:.2f} | {mfu} | {r['peak_mem_gib']:.1f} | "
              f"{r['losses'][0]:.4f} -> {r['losses'][-1]:.4f} |")
    if "torch_cp" in rows:
        print(f"first-step loss ringfa4 vs torch_cp: relative difference {report['first_loss_rel_diff']:.2e}")
        print(f"ringfa4 / torch_cp tokens/s: {rows['ringfa4']['tokens_per_s'] / rows['torch_cp']['tokens_per_s']:.2f}x")
    print(f"wrote {opts.out}")
    if result["torch_cp_failed"]:
        # On CPU this is expected: PyTorch's ring shards only the CUDA SDPA kernels (flash,
        # efficient, cuDNN), not the CPU one.
        print(f"{'NOT COMPARED' if tiny else 'FAILED'}: {result['torch_cp_failed']}")
        if not tiny:
            sys.exit(1)


if __name__ == "__main__":
    main()
