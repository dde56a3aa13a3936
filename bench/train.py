"""Long-context training throughput: ringfa4's ring vs PyTorch context_parallel, one run, same GPUs.

    torchrun --nproc_per_node=2 bench/train.py --record    # full run, rows into bench/results/train.json
    python bench/train.py --tiny                           # CPU smoke run: 2 gloo workers, tiny model

The trainer's own job (ringfa4.train: build, make_batch, train_step) for the llama3-1b shape at
65536 tokens per sequence, one sequence per step, cp = all ranks, FSDP2 over the same ranks, bf16
params and compute, fp32 gradient reduction, activation checkpointing and torch.compile as
flagged (default: full, eager), AdamW at a constant learning rate, synthetic tokens. The model,
batches and initial weights are identical for both; only attention differs:
  ringfa4   ringfa4.ring_attention (backend auto: own CuTe kernels, else FA4, else torch), zigzag,
            K/V of the kv heads only travel the ring;
  torch_cp  torch.distributed.tensor.experimental.context_parallel over cuDNN SDPA
            (bench/measure.py), its default load balancer; K/V heads repeated to the query heads
            first (its ring has no GQA), as torchtitan does.
Step time: the median over the timed steps (measure.Timer, every step started on all ranks at
once, each step's time the slowest rank's). Per-GPU TFLOP/s count model FLOPs
(ModelArgs.flops_per_token: 6 per matmul parameter per token plus causal attention), not the
recomputation; MFU divides by the dense bf16 peak. The report goes to train.json in a new
temporary directory unless --out-dir or --record says otherwise (a smoke run never records).
"""
import functools
import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench import measure  # noqa: E402
from ringfa4 import flops  # noqa: E402
from ringfa4.nn.model import ACTIVATION_CHECKPOINTING  # noqa: E402
from ringfa4.nn.parallel import CP  # noqa: E402
from ringfa4.train import config, launch, metrics, trainer  # noqa: E402

GRAD_CLIP = 1.0


class SDPAttention(nn.Module):
    """The attention PyTorch's context_parallel knows how to shard: SDPA on (b, h, s, d)."""

    def forward(self, q, k, v):
        return measure.sdpa(*measure.sdpa_layout(q, k, v), causal=True).transpose(1, 2)


def job_config(opts, world):
    """The trainer's JobConfig for this bench: the named model preset, synthetic tokens, one
    sequence per step over a ring of all ranks, a constant learning rate."""
    return config.compose(
        f"model={opts.model}", *([f"model.n_layers={opts.n_layers}"] if opts.n_layers is not None else []),
        "data=synthetic", f"parallel.cp={world}", "parallel.dp_shard=1",
        f"parallel.backend={opts.backend}", f"train.seq_len={opts.seq_len}", "train.global_batch=1",
        f"train.steps={opts.steps}", "train.lr=1e-4", "train.min_lr=1e-4", "train.warmup_steps=0",
        f"train.grad_clip={GRAD_CLIP}", f"train.activation_checkpointing={opts.activation_checkpointing}",
        f"train.compile={opts.compile}",
        f"train.mixed_precision={'fp32' if opts.tiny else 'bf16'}", f"train.device={'cpu' if opts.tiny else 'cuda'}")


def torch_cp_step(run, position, global_tokens):
    """One train step with PyTorch's context_parallel sharding the whole sequences in place."""
    from torch.distributed.tensor.experimental import context_parallel

    samples = trainer.local_samples(run, position).to(run.device)
    tokens, labels = samples[:, :-1].contiguous(), samples[:, 1:].contiguous()
    positions = torch.arange(tokens.shape[1], device=run.device).unsqueeze(0)
    buffers = [tokens, labels, positions]
    context = functools.partial(context_parallel, run.mesh[CP], buffers=buffers, buffer_seq_dims=[1, 1, 1],
                                no_restore_buffers=set(buffers))
    return trainer.train_step(run.model, run.optimizer, buffers, global_tokens, GRAD_CLIP, context)


def measure_impl(impl, job, opts, device):
    run = trainer.build(job, device)
    if impl == "torch_cp":
        for layer in run.model.layers:
            layer.attention.core = SDPAttention()
    global_tokens = job.train.global_batch * job.train.seq_len
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    losses = []

    def step():
        position = len(losses) * job.train.global_batch
        if impl == "ringfa4":
            loss, _ = trainer.train_step(run.model, run.optimizer, trainer.make_batch(run, position),
                                         global_tokens, GRAD_CLIP)
        else:
            loss, _ = torch_cp_step(run, position, global_tokens)
        losses.append(loss)
        if dist.get_rank() == 0 and (len(losses) <= opts.warmup or len(losses) == opts.steps):
            print(f"{impl}: step {len(losses)}/{opts.steps} loss {loss.item():.4f}", flush=True)

    timer = measure.Timer(device, rounds=opts.steps - opts.warmup, warmup=opts.warmup, group=dist.group.WORLD)
    (ms,) = timer(step)
    world = dist.get_world_size()
    model_flops = run.settings.model.flops_per_token(job.train.seq_len) * global_tokens / world
    peak = metrics.peak_flops(device)
    row = {"impl": impl, "backend": run.backend if impl == "ringfa4" else "cuDNN SDPA", "step_s": ms / 1e3,
           "tokens_per_s": global_tokens / (ms / 1e3), "tflops_per_gpu": flops.tflops(model_flops, ms),
           "mfu": model_flops / (ms / 1e3) / peak if peak else None,
           "peak_mem_gib": metrics.peak_memory_gib(device), "losses": [x.item() for x in losses]}
    return row


def worker(opts, rank, world, local_rank):
    job = job_config(opts, world)
    with launch.process_group(config.device_type(job.train), rank, world, local_rank) as device:
        rows = [measure_impl("ringfa4", job, opts, device)]
        failed = None
        try:
            if "torch_cp" in opts.impls:
                rows.append(measure_impl("torch_cp", job, opts, device))
        except Exception as e:  # kept in the results and printed; on GPU the run then exits non-zero
            failed = f"torch_cp could not run on {device.type}: {type(e).__name__}: {str(e).splitlines()[0]}"
        return {"rows": rows, "torch_cp_failed": failed, "world": world, "n_layers": job.model.n_layers,
                "meta": measure.metadata(device, opts.commit)}


def parse_args():
    p = measure.parser(__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="CPU smoke run: 2 gloo workers, tiny model, torch backend")
    p.add_argument("--model", default=None, help="model preset of ringfa4/configs/model (default llama3-1b, "
                                                 "tiny with --tiny)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default 65536, 256 with --tiny)")
    p.add_argument("--steps", type=int, default=None, help="steps per implementation (default 24, 4 with --tiny)")
    p.add_argument("--warmup", type=int, default=None, help="untimed first steps (default 4, 1 with --tiny)")
    p.add_argument("--backend", default=None, help="ringfa4 backend (default auto, torch with --tiny)")
    p.add_argument("--activation-checkpointing", choices=ACTIVATION_CHECKPOINTING, default="full",
                   help="what each block recomputes in backward (train.activation_checkpointing; default full)")
    p.add_argument("--compile", action="store_true", help="torch.compile each block (train.compile)")
    p.add_argument("--no-torch-cp", dest="impls", action="store_const", const=("ringfa4",), default=("ringfa4", "torch_cp"),
                   help="time ringfa4 alone (a long shape whose PyTorch run would double the time; the table says so)")
    p.add_argument("--n-layers", type=int, default=None,
                   help="layers of the model preset, overridden (e.g. llama3-8b's shape on one GPU, whose "
                        "32 layers' fp32 weights and AdamW state do not fit)")
    opts = p.parse_args()
    tiny = opts.tiny
    opts.model = opts.model or ("tiny" if tiny else "llama3-1b")
    opts.seq_len = opts.seq_len or (256 if tiny else 65536)
    opts.steps = opts.steps or (4 if tiny else 24)
    opts.warmup = opts.warmup if opts.warmup is not None else (1 if tiny else 4)
    opts.backend = opts.backend or ("torch" if tiny else "auto")
    if not 0 <= opts.warmup < opts.steps:
        p.error("--warmup must be in [0, --steps)")
    measure.check_output_args(p, opts, smoke=tiny)
    if not (tiny or launch.under_torchrun()):
        p.error("run under torchrun (torchrun --nproc_per_node=2 bench/train.py), or pass --tiny for the CPU run")
    # Settings are checked before any worker starts (the world size is known only to the workers).
    job_config(opts, launch.CPU_WORKERS if tiny else int(os.environ["WORLD_SIZE"]))
    return opts


def report(opts, result):
    rows = {r["impl"]: r for r in result["rows"]}
    summary = {**result["meta"], "gpus": result["world"], "model": opts.model, "seq_len": opts.seq_len,
               "cp": result["world"], "dp_shard": 1, "global_batch": 1, "dtype": "fp32" if opts.tiny else "bf16",
               "activation_checkpointing": opts.activation_checkpointing, "compile": opts.compile,
               "n_layers": result["n_layers"], "steps": opts.steps, "warmup": opts.warmup,
               "rows": result["rows"], "torch_cp_failed": result["torch_cp_failed"], "impls": list(opts.impls)}
    if "torch_cp" in rows:
        # Same weights, same first batch: the two rings must agree on the first loss (bf16 noise).
        a, b = rows["ringfa4"]["losses"][0], rows["torch_cp"]["losses"][0]
        summary["first_loss_rel_diff"] = abs(a - b) / abs(b)
    out = measure.output_dir(opts) / "train.json"
    out.write_text(json.dumps(summary, indent=2) + "\n")

    print(f"\n{opts.model}, {opts.seq_len} tokens/step, cp={result['world']} on {summary['device']}, "
          f"{summary['dtype']}, {summary['n_layers']} layers, activation_checkpointing={opts.activation_checkpointing}"
          f", compile={opts.compile}, {opts.steps - opts.warmup} timed steps, commit {summary['commit']}")
    print("| impl | backend | step s | tokens/s | TFLOP/s/GPU | MFU | peak mem GiB | loss first -> last |")
    print("|---|---|---|---|---|---|---|---|")
    for r in result["rows"]:
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
        print(f"| {r['impl']} | {r['backend']} | {r['step_s']:.3f} | {r['tokens_per_s']:,.0f} | "
              f"{r['tflops_per_gpu']:.2f} | {mfu} | {r['peak_mem_gib']:.1f} | "
              f"{r['losses'][0]:.4f} -> {r['losses'][-1]:.4f} |")
    if "torch_cp" not in opts.impls:
        print("torch_cp: not run (--no-torch-cp)")
    if "torch_cp" in rows:
        print(f"first-step loss ringfa4 vs torch_cp: relative difference {summary['first_loss_rel_diff']:.2e}")
        print(f"ringfa4 / torch_cp tokens/s: {rows['ringfa4']['tokens_per_s'] / rows['torch_cp']['tokens_per_s']:.2f}x")
    print(f"wrote {out}")
    if result["torch_cp_failed"]:
        # On CPU this is expected: PyTorch's ring shards only the CUDA SDPA kernels (flash,
        # efficient, cuDNN), not the CPU one.
        print(f"{'NOT COMPARED' if opts.tiny else 'FAILED'}: {result['torch_cp_failed']}")
        if not opts.tiny:
            sys.exit(1)


def main():
    opts = parse_args()
    if launch.under_torchrun():
        rank = int(os.environ["RANK"])
        result = worker(opts, rank, int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"]))
        if rank != 0:
            return
    else:
        result = launch.spawn(worker, launch.CPU_WORKERS, opts)
    report(opts, result)


if __name__ == "__main__":
    main()
    if launch.under_torchrun():  # a rank ends as the trainer's do (see launch.end_process)
        launch.end_process()
