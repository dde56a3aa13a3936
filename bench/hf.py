"""A transformers Llama-architecture model trained with ringfa4's attention vs SDPA: on one GPU
against attn_implementation="sdpa", under torchrun against PyTorch's context_parallel over SDPA;
tokens/s and peak memory of a training step.

    python bench/hf.py --commit $(git rev-parse --short HEAD) [--seq-lens 32768,65536] [--record]
    torchrun --nproc_per_node=2 bench/hf.py --commit $(git rev-parse --short HEAD)   # cp = 2
    python bench/hf.py --smoke                            # CPU: tiny model, torch backend, float32
    torchrun --nproc_per_node=2 bench/hf.py --smoke       # CPU, gloo: the cp mode's code path

The model is transformers' LlamaForCausalLM built from a config of Llama 3.2 1B's shape (random
weights, nothing downloaded): 16 layers, hidden 2048, 32 query / 8 kv heads of 64, ffn 8192,
vocab 128256, tied embeddings; AdamW, activation checkpointing (--activation-checkpointing,
ringfa4.hf.enable_checkpointing: "full" recomputes every layer, "selective" all but the attention,
ours or SDPA's alike, "pointwise" only norms, RoPE and activations), one sequence per step. One
model serves both contenders, which take turns (bench/measure.py Timer: 1 warm-up step each, then
rounds, median kept).

One GPU (python): bf16 parameters; only ``model.set_attn_implementation`` changes between
  ringfa4  ringfa4.hf.register(): ringfa4.attention on the one GPU (backend cute: our CuTe kernels)
           with the kv heads as they are;
  sdpa     transformers' SDPA path (torch's default SDPA dispatch, causal, no mask).

Under torchrun, W ranks: cp = W (mesh ringfa4.nn.build_mesh(device, 1, W)), FSDP2 over the same
ranks (ringfa4.hf.fully_shard_model: fp32 masters, bf16 compute, fp32 gradient reduction); the
sequence lengths are totals, each rank holds 1/W of the tokens. Same weights, same tokens:
  ringfa4   ringfa4.hf.register(group=the cp group): ringfa4.ring_attention, zigzag, kv heads as
            they are; the batch sharded by Ring.shard_batch;
  torch_cp  torch.distributed.tensor.experimental.context_parallel over cuDNN SDPA (bench/measure.py,
            as bench/train.py), its head-tail load balancer; input_ids, position_ids and labels
            sharded by it along dim 1. The attention is a small function registered with
            transformers under TORCH_CP, not transformers' own "sdpa": that one, given the sharded
            (load-balanced) position_ids, reads their jump between the two chunks as packed
            sequences and builds a block-diagonal mask (SDPA with a mask, which context_parallel
            refuses, and wrong besides), and without a mask it calls SDPA with enable_gqa=True,
            which cuDNN's SDPA path does not take. Ours passes no mask (is_causal) and repeats the
            kv heads to the query heads first (measure.sdpa_layout), as transformers' SDPA path
            does where it cannot use enable_gqa, and as bench/train.py and torchtitan do for
            PyTorch's ring.
If torch_cp cannot run (always on CPU: PyTorch's ring shards only the CUDA SDPA kernels), its error
goes into the row and the table, and on GPU the run exits non-zero.

The loss is the sum of next-token losses over the (local) tokens, from the final hidden states
through the tied head in checkpointed chunks of 8192 tokens, the same for every contender, divided
by the global token count: the full fp32 logits of 64k tokens x 128k vocab (34 GB, and as much
again for their gradient) would otherwise dominate the memory that the attention implementations
are compared on. Before timing, every contender gives the loss of the same weights and tokens
(forward, no grad; they must agree), and each contender's peak memory is taken over one step of
its own (the largest over the ranks). Tokens/s count the global tokens per step; TFLOP/s per GPU
and MFU count model FLOPs (ringfa4.hf.flops_per_token), not the recomputation. Rows: hf.json.
"""
import contextlib
import math
import os
import sys
import time
import types

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

# The repository root instead of this script's folder: transformers probes for a package named
# "kernels" (Hugging Face's kernel hub) and would import bench/kernels.py in its place.
sys.path[0] = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")

from bench import measure  # noqa: E402
from ringfa4 import hf  # noqa: E402
from ringfa4.nn.model import ACTIVATION_CHECKPOINTING  # noqa: E402
from ringfa4.nn.parallel import CP, build_mesh  # noqa: E402
from ringfa4.train import launch, metrics  # noqa: E402

LOSS_CHUNK = 8192
TORCH_CP = "torch_cp_sdpa"  # attn_implementation of the torch_cp contender


def llama_config(smoke):
    from transformers import LlamaConfig

    if smoke:
        return LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    return LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                       num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0,
                       max_position_embeddings=131072, tie_word_embeddings=True)


def _chunk_loss(h, weight, labels):
    return F.cross_entropy(F.linear(h, weight).float(), labels, reduction="sum", ignore_index=hf.IGNORE_INDEX)


def loss_sum(model, input_ids, labels, position_ids=None):
    """Sum of next-token losses of one sequence's tokens (labels already shifted, IGNORE_INDEX
    where none), head applied in chunks."""
    h = model.model(input_ids=input_ids, position_ids=position_ids, use_cache=False).last_hidden_state[0]
    weight = model.lm_head.weight
    return sum(checkpoint(_chunk_loss, h[i:i + LOSS_CHUNK], weight, labels[i:i + LOSS_CHUNK], use_reentrant=False)
               for i in range(0, h.shape[0], LOSS_CHUNK))


def use_attention(model, impl):
    """Switch the model's attention to ``impl``. transformers only logs a warning where it cannot
    (a heuristic on the model class's source), which would time one implementation twice."""
    model.set_attn_implementation(impl)
    if model.config._attn_implementation != impl:
        raise RuntimeError(f"{type(model).__name__} kept attn_implementation {model.config._attn_implementation!r} "
                           f"when set to {impl!r}")


def adamw(model, device):
    """Both sides' optimizer: fused AdamW on GPUs (the trainer's choice, ringfa4.train.trainer)."""
    return torch.optim.AdamW(model.parameters(), lr=1e-5, betas=(0.9, 0.95), fused=device.type == "cuda")


def train_step(loss_fn, optimizer):
    loss_fn(backward=True)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def forward_loss(loss_fn):
    """The global mean loss of a contender's loss_fn (each rank's share, summed), no grad."""
    with torch.no_grad():
        share = loss_fn(backward=False)
    if dist.is_initialized():
        dist.all_reduce(share)
    return share.item()


def peak_memory(step, device):
    """Peak memory (GiB) of one call of ``step`` on its own (the largest over the ranks)."""
    if device.type != "cuda":
        step()
        return metrics.peak_memory_gib(device)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    step()
    torch.cuda.synchronize(device)
    peak = torch.tensor(torch.cuda.max_memory_allocated(device) / 2**30, device=device)
    if dist.is_initialized():
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return peak.item()


def _error(e):
    return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}"


def prepare(loss_fns, optimizer, device, fallible=()):
    """(losses, peaks, errors) per contender: every contender's loss of the same weights (forward,
    no grad), then each one's peak memory over one training step. A contender in ``fallible``
    that raises is reported in ``errors`` instead (on every rank: a failure on one fails it
    everywhere)."""
    def step_peak(loss_fn):
        return peak_memory(lambda: train_step(loss_fn, optimizer), device)

    losses, peaks, errors = {}, {}, {}
    for measured, run in ((losses, forward_loss), (peaks, step_peak)):
        for impl, fn in loss_fns.items():
            if impl in errors:
                continue
            try:
                measured[impl] = run(fn)
            except Exception as e:
                if impl not in fallible:
                    raise
                errors[impl] = _error(e)
                optimizer.zero_grad(set_to_none=True)
    if dist.is_initialized():
        failed = torch.tensor([impl in errors for impl in loss_fns], dtype=torch.int32, device=device)
        dist.all_reduce(failed, op=dist.ReduceOp.MAX)
        for impl, bad in zip(loss_fns, failed.tolist()):
            if bad and impl not in errors:
                errors[impl] = "failed on another rank"
    ours = losses["ringfa4"]
    for impl, loss in losses.items():
        if impl not in errors and abs(ours - loss) > 2e-2 * abs(loss):
            raise AssertionError(f"ringfa4 loss {ours} vs {impl} {loss}: the contenders disagree, nothing timed")
    return losses, peaks, errors


def measure_row(row, loss_fns, optimizer, device, timer, config, fallible=()):
    """``row`` completed with each contender's step time, tokens/s, TFLOP/s per GPU, MFU, peak
    memory and loss, the baseline's speedup (its step time / ringfa4's) or its error."""
    seq_len, world = row["seq_len"], row["cp"]
    losses, peaks, errors = prepare(loss_fns, optimizer, device, fallible)
    timed = [impl for impl in loss_fns if impl not in errors]
    ms = dict(zip(timed, timer(*[lambda fn=loss_fns[impl]: train_step(fn, optimizer) for impl in timed])))
    flops = hf.flops_per_token(config, seq_len) * seq_len / world
    peak = metrics.peak_flops(device)
    for impl in loss_fns:
        if impl in errors:
            row[impl] = {"error": errors[impl]}
            continue
        row[impl] = {"step_ms": round(ms[impl], 2), "tokens_per_s": round(seq_len / ms[impl] * 1e3, 1),
                     "tflops": round(flops / ms[impl] / 1e9, 1),
                     "mfu": round(flops / ms[impl] * 1e3 / peak, 4) if peak else None,
                     "peak_mem_gib": round(peaks[impl], 2), "loss": losses[impl]}
    base = row["baseline"]
    row["speedup"] = round(ms[base] / ms["ringfa4"], 3) if base in ms else None
    return row


# ---------------------------------------------------------------- one GPU


def one_gpu_loss_fns(model, input_ids, labels):
    """{impl: loss_fn(backward)}: the mean loss over the sequence through impl's attention."""
    def loss_fn(impl, backward):
        use_attention(model, impl)
        loss = loss_sum(model, input_ids, labels) / labels.numel()
        if backward:
            loss.backward()
        return loss.detach()
    return {impl: (lambda backward, impl=impl: loss_fn(impl, backward)) for impl in ("ringfa4", "sdpa")}


def run_one_gpu(args, seq_lens):
    device = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    backend = args.backend or ("torch" if args.smoke else "cute")
    from transformers import AutoModelForCausalLM

    hf.register(backend=backend)
    config = llama_config(args.smoke)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    hf.enable_checkpointing(model, args.activation_checkpointing)
    model.train()
    optimizer = adamw(model, device)
    timer = measure.Timer(device, rounds=args.rounds or (1 if args.smoke else 3), warmup=1, reduce="median")
    meta = measure.metadata(device, args.commit, dtype=str(dtype).removeprefix("torch."),
                            model="tiny" if args.smoke else "Llama 3.2 1B shape",
                            activation_checkpointing=args.activation_checkpointing)
    rows = measure.Rows(measure.output_dir(args) / "hf.json")
    start = time.perf_counter()
    for seq_len in seq_lens:
        print(f"[{time.perf_counter() - start:.0f} s] seq {seq_len}", flush=True)
        gen = torch.Generator().manual_seed(seq_len)
        tokens = torch.randint(config.vocab_size, (seq_len + 1,), generator=gen).to(device)
        loss_fns = one_gpu_loss_fns(model, tokens[:-1].unsqueeze(0), tokens[1:])
        row = {**meta, "seq_len": seq_len, "cp": 1, "backend": backend, "loss_chunk": LOSS_CHUNK, "baseline": "sdpa"}
        rows.add(measure_row(row, loss_fns, optimizer, device, timer, config))
    print(markdown(rows))
    return 0


# ---------------------------------------------------------------- context parallel (torchrun)


def sdpa_repeated_kv(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention-function signature around bench/train.py's torch_cp attention:
    causal SDPA (measure.sdpa: cuDNN on CUDA) with the kv heads repeated to the query heads
    (measure.sdpa_layout, on the (b, s, heads, d) views of transformers' (b, heads, s, d) inputs)."""
    if attention_mask is not None or dropout:
        raise ValueError(f"{TORCH_CP} takes no attention_mask and no dropout (got a mask: "
                         f"{attention_mask is not None}, dropout {dropout})")
    if scaling is not None and not math.isclose(scaling, query.shape[-1] ** -0.5, rel_tol=1e-6):
        raise ValueError(f"{TORCH_CP} runs SDPA's default scale head_dim ** -0.5, got scaling={scaling}")
    qkv = measure.sdpa_layout(*(t.transpose(1, 2) for t in (query, key, value)))
    return measure.sdpa(*qkv, causal=True).transpose(1, 2), None


@contextlib.contextmanager
def torch_cp_batch(mesh, input_ids):
    """(input_ids, position_ids, shift_labels) of full sequences, sharded in place by PyTorch's
    context_parallel over ``mesh`` (head-tail load balance, the causal one), which stays entered
    (SDPA is its ring) for the block. Fresh tensors each time: it resizes them in place."""
    ids = input_ids.clone()
    positions = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
    labels = torch.cat([ids[:, 1:], ids.new_full((ids.shape[0], 1), hf.IGNORE_INDEX)], dim=1)  # as shard_batch
    with measure.torch_context_parallel(mesh, [ids, positions, labels], [1] * 3, load_balance=True):
        yield ids, positions, labels


def cp_loss_fns(model, ring, cp_mesh, input_ids):
    """{impl: loss_fn(backward)}: this rank's share of the global mean loss through impl's ring."""
    batch = ring.shard_batch(input_ids)
    num_tokens = hf.global_token_count(batch)

    def share(impl, ids, positions, labels, backward):
        use_attention(model, impl)
        loss = model.loss_sum(ids, labels[0], positions) / num_tokens
        if backward:
            loss.backward()
        return loss.detach()

    def ringfa4(backward):
        return share(ring.name, batch["input_ids"], batch["position_ids"], batch["shift_labels"], backward)

    def torch_cp(backward):
        with torch_cp_batch(cp_mesh, input_ids) as local:
            return share(TORCH_CP, *local, backward)
    return {"ringfa4": ringfa4, "torch_cp": torch_cp}


def sharded_model(config, mesh, device, activation_checkpointing):
    """The model on every rank with rank 0's weights, FSDP2 over ``mesh``, activation checkpointing;
    ``model.loss_sum`` runs as an FSDP2 forward (the chunked head reads the root unit's weights)."""
    from torch.distributed.fsdp import register_fsdp_forward_method
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    for t in [*model.parameters(), *model.buffers()]:
        dist.broadcast(t.detach(), src=0)
    hf.fully_shard_model(model, mesh, param_dtype=torch.bfloat16 if device.type == "cuda" else None,
                         activation_checkpointing=activation_checkpointing)
    model.loss_sum = types.MethodType(loss_sum, model)
    register_fsdp_forward_method(model, "loss_sum")
    model.train()
    return model


def run_context_parallel(args, seq_lens):
    from transformers import AttentionInterface

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    with launch.process_group("cpu" if args.smoke else "cuda", rank, world, int(os.environ["LOCAL_RANK"])) as device:
        backend = args.backend or ("torch" if args.smoke else "cute")
        mesh = build_mesh(device.type, 1, world)
        ring = hf.register(group=mesh[CP].get_group(), backend=backend)
        AttentionInterface.register(TORCH_CP, sdpa_repeated_kv)
        config = llama_config(args.smoke)
        model = sharded_model(config, mesh, device, args.activation_checkpointing)
        optimizer = adamw(model, device)
        timer = measure.Timer(device, rounds=args.rounds or (1 if args.smoke else 3), warmup=1, reduce="median",
                              group=dist.group.WORLD)
        dtype = "float32" if args.smoke else "float32 params, bfloat16 compute"
        meta = measure.metadata(device, args.commit, dtype=dtype, model="tiny" if args.smoke else "Llama 3.2 1B shape",
                                activation_checkpointing=args.activation_checkpointing)
        rows = measure.Rows(measure.output_dir(args) / "hf.json" if rank == 0 else None)
        start = time.perf_counter()
        for seq_len in seq_lens:
            if rank == 0:
                print(f"[{time.perf_counter() - start:.0f} s] seq {seq_len}, cp {world}", flush=True)
            gen = torch.Generator().manual_seed(seq_len)
            input_ids = torch.randint(config.vocab_size, (1, seq_len), generator=gen).to(device)
            row = {**meta, "seq_len": seq_len, "cp": world, "backend": backend, "loss_chunk": LOSS_CHUNK,
                   "baseline": "torch_cp"}
            loss_fns = cp_loss_fns(model, ring, mesh[CP], input_ids)
            rows.add(measure_row(row, loss_fns, optimizer, device, timer, config, fallible=("torch_cp",)))
    if rank != 0:
        return 0
    print(markdown(rows))
    failed = [r["torch_cp"]["error"] for r in rows if "error" in r["torch_cp"]]
    if failed:
        print(f"{'NOT COMPARED' if args.smoke else 'FAILED'}: torch_cp: {failed[0]}", flush=True)
    return 1 if failed and not args.smoke else 0


# ---------------------------------------------------------------- report and entry


def markdown(rows):
    r = rows[0]
    b = r["baseline"]
    out = [f"transformers LlamaForCausalLM ({r['model']}), {r['device']}, cp={r['cp']}, commit {r['commit']}, "
           f"backend {r['backend']}: training step ({r['dtype']}, AdamW, {r['activation_checkpointing']} activation "
           "checkpointing), one sequence, "
           "median step; TFLOP/s and GiB per GPU", "",
           f"| seq | ringfa4 tok/s | {b} tok/s | speedup | ringfa4 TFLOP/s | {b} TFLOP/s | ringfa4 MFU | {b} MFU "
           f"| ringfa4 GiB | {b} GiB |", "|---|---|---|---|---|---|---|---|---|---|"]
    columns = (("tokens_per_s", "{:,.0f}"), ("tflops", "{}"), ("mfu", "{:.1%}"), ("peak_mem_gib", "{}"))
    for r in rows:
        cells = [_cell(r[impl], key, fmt) for key, fmt in columns for impl in ("ringfa4", b)]
        cells.insert(2, "n/a" if r["speedup"] is None else f"{r['speedup']:.3f}x")
        out.append("| " + " | ".join([str(r["seq_len"]), *cells]) + " |")
    out += [f"{b} failed at {r['seq_len']}: {r[b]['error']}" for r in rows if "error" in r[b]]
    return "\n".join(out)


def _cell(result, key, fmt):
    if "error" in result:
        return "failed"
    return "n/a" if result[key] is None else fmt.format(result[key])


def main():
    p = measure.parser(__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="CPU: tiny model, torch backend, float32")
    p.add_argument("--seq-lens", default=None,
                   help="comma list of tokens per sequence (total over the cp ranks under torchrun); "
                        "default 32768,65536, 64,128 with --smoke")
    p.add_argument("--backend", default=None, help="ringfa4 backend (default cute, torch with --smoke)")
    p.add_argument("--rounds", type=int, default=None, help="timed rounds, median kept (default 3, 1 with --smoke)")
    p.add_argument("--activation-checkpointing", choices=ACTIVATION_CHECKPOINTING, default="full",
                   help="what backward recomputes, for both contenders (ringfa4.hf.enable_checkpointing)")
    args = p.parse_args()
    measure.check_output_args(p, args, args.smoke)
    seq_lens = [int(s) for s in (args.seq_lens or ("64,128" if args.smoke else "32768,65536")).split(",")]
    if launch.under_torchrun():
        return run_context_parallel(args, seq_lens)
    return run_one_gpu(args, seq_lens)


if __name__ == "__main__":
    status = main()
    if launch.under_torchrun():  # a rank ends as the trainer's do (see launch.end_process)
        launch.end_process(status)
    sys.exit(status)
