"""A transformers Llama-architecture model trained with ringfa4's attention vs attn_implementation="sdpa",
one GPU, one run: tokens/s and peak memory of a training step.

    python bench/hf.py --commit $(git rev-parse --short HEAD) [--seq-lens 32768,65536] [--record]
    python bench/hf.py --smoke        # CPU: a tiny shape, torch backend, float32, to prove the script

The model is transformers' LlamaForCausalLM built from a config of Llama 3.2 1B's shape (random
weights, nothing downloaded): 16 layers, hidden 2048, 32 query / 8 kv heads of 128, ffn 8192,
vocab 128256, tied embeddings; bf16 parameters, AdamW, activation checkpointing (transformers'
gradient_checkpointing_enable), one sequence per step. One model serves both contenders, which
take turns (bench/measure.py Timer: 1 warm-up step each, then rounds, median kept); only
``model.set_attn_implementation`` changes between them:
  ringfa4  ringfa4.hf.register(): ringfa4.attention on the one GPU (backend cute: our CuTe kernels)
           with the kv heads as they are;
  sdpa     transformers' SDPA path (torch's default SDPA dispatch, causal, no mask).
The loss is the sum of next-token losses over the sequence, from the final hidden states through
the tied head in checkpointed chunks of 8192 tokens, the same for both: the full fp32 logits of
64k tokens x 128k vocab (34 GB, and as much again for their gradient) would otherwise dominate
the memory that the attention implementations are compared on. Before timing, both give the
loss of the same weights and tokens (forward, no grad), and each contender's peak memory is
taken over one step of its own. TFLOP/s count model FLOPs (ringfa4.hf.flops_per_token), not the
recomputation. Rows: hf.json.
"""
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

# The repository root instead of this script's folder: transformers probes for a package named
# "kernels" (Hugging Face's kernel hub) and would import bench/kernels.py in its place.
sys.path[0] = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")

from bench import measure  # noqa: E402
from ringfa4 import hf  # noqa: E402
from ringfa4.train import metrics  # noqa: E402

LOSS_CHUNK = 8192
IMPLS = ("ringfa4", "sdpa")


def llama_config(smoke):
    from transformers import LlamaConfig

    if smoke:
        return LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    return LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                       num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0,
                       max_position_embeddings=131072, tie_word_embeddings=True)


def _chunk_loss(h, weight, labels):
    return F.cross_entropy(F.linear(h, weight).float(), labels, reduction="sum")


def loss_sum(model, input_ids, labels):
    """Sum of next-token losses of one sequence (labels already shifted), head applied in chunks."""
    h = model.model(input_ids=input_ids, use_cache=False).last_hidden_state[0]
    weight = model.lm_head.weight
    return sum(checkpoint(_chunk_loss, h[i:i + LOSS_CHUNK], weight, labels[i:i + LOSS_CHUNK], use_reentrant=False)
               for i in range(0, h.shape[0], LOSS_CHUNK))


def train_step(model, optimizer, impl, input_ids, labels):
    model.set_attn_implementation(impl)
    (loss_sum(model, input_ids, labels) / labels.numel()).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def peak_memory(step, device):
    """Peak memory (GiB) of one call of ``step`` on its own."""
    if device.type != "cuda":
        return metrics.peak_memory_gib(device)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    step()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) / 2**30


def bench_length(seq_len, model, optimizer, config, device, timer, meta, backend):
    gen = torch.Generator().manual_seed(seq_len)
    tokens = torch.randint(config.vocab_size, (seq_len + 1,), generator=gen).to(device)
    input_ids, labels = tokens[:-1].unsqueeze(0), tokens[1:]
    with torch.no_grad():
        losses = {}
        for impl in IMPLS:
            model.set_attn_implementation(impl)
            losses[impl] = (loss_sum(model, input_ids, labels) / seq_len).item()
    if abs(losses["ringfa4"] - losses["sdpa"]) > 2e-2 * abs(losses["sdpa"]):
        raise AssertionError(f"seq {seq_len}: ringfa4 loss {losses['ringfa4']} vs sdpa {losses['sdpa']}")
    steps = {impl: (lambda impl=impl: train_step(model, optimizer, impl, input_ids, labels)) for impl in IMPLS}
    peaks = {impl: peak_memory(step, device) for impl, step in steps.items()}
    ms = dict(zip(IMPLS, timer(*steps.values())))
    flops = hf.flops_per_token(config, seq_len) * seq_len
    peak = metrics.peak_flops(device)
    row = {**meta, "seq_len": seq_len, "backend": backend, "loss_chunk": LOSS_CHUNK}
    for impl in IMPLS:
        row[impl] = {"step_ms": round(ms[impl], 2), "tokens_per_s": round(seq_len / ms[impl] * 1e3, 1),
                     "tflops": round(flops / ms[impl] / 1e9, 1),
                     "mfu": round(flops / ms[impl] * 1e3 / peak, 4) if peak else None,
                     "peak_mem_gib": round(peaks[impl], 2), "loss": losses[impl]}
    row["speedup"] = round(ms["sdpa"] / ms["ringfa4"], 3)
    return row


def markdown(rows):
    r = rows[0]
    out = [f"transformers LlamaForCausalLM ({r['model']}), {r['device']}, commit {r['commit']}, backend {r['backend']}: "
           f"training step ({r['dtype']}, AdamW, activation checkpointing), one sequence, median step", "",
           "| seq | ringfa4 tok/s | sdpa tok/s | speedup | ringfa4 TFLOP/s | sdpa TFLOP/s | ringfa4 GiB | sdpa GiB |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        a, b = r["ringfa4"], r["sdpa"]
        out.append(f"| {r['seq_len']} | {a['tokens_per_s']:,.0f} | {b['tokens_per_s']:,.0f} | {r['speedup']:.3f}x "
                   f"| {a['tflops']} | {b['tflops']} | {a['peak_mem_gib']} | {b['peak_mem_gib']} |")
    return "\n".join(out)


def main():
    p = measure.parser(__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="CPU: tiny model, torch backend, float32")
    p.add_argument("--seq-lens", default=None, help="comma list (default 32768,65536; 64,128 with --smoke)")
    p.add_argument("--backend", default=None, help="ringfa4 backend (default cute, torch with --smoke)")
    p.add_argument("--rounds", type=int, default=None, help="timed rounds, median kept (default 3, 1 with --smoke)")
    args = p.parse_args()
    measure.check_output_args(p, args, args.smoke)
    seq_lens = [int(s) for s in (args.seq_lens or ("64,128" if args.smoke else "32768,65536")).split(",")]
    device = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    backend = args.backend or ("torch" if args.smoke else "cute")
    from transformers import AutoModelForCausalLM

    hf.register(backend=backend)
    config = llama_config(args.smoke)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, betas=(0.9, 0.95), fused=device.type == "cuda")
    timer = measure.Timer(device, rounds=args.rounds or (1 if args.smoke else 3), warmup=1, reduce="median")
    meta = measure.metadata(device, args.commit, dtype=str(dtype).removeprefix("torch."),
                            model="tiny" if args.smoke else "Llama 3.2 1B shape")
    rows = measure.Rows(measure.output_dir(args) / "hf.json")
    start = time.perf_counter()
    for seq_len in seq_lens:
        print(f"[{time.perf_counter() - start:.0f} s] seq {seq_len}", flush=True)
        rows.add(bench_length(seq_len, model, optimizer, config, device, timer, meta, backend))
    print(markdown(rows))


if __name__ == "__main__":
    main()
