"""Fine-tune a transformers Llama-architecture model with ring attention, FSDP2 over (dp_shard, cp).

    # CPU, two gloo ranks, a tiny randomly initialised Llama on the corpus shipped with ringfa4
    # (byte-level tokens; nothing is downloaded):
    torchrun --nproc_per_node=2 examples/hf_finetune.py --steps 20

    # GPUs: a model you point to (a local folder or a hub name) on your text, 64k-token sequences
    # in rings of 4 GPUs, 2 rings sharding the parameters; resumable from DCP checkpoints:
    torchrun --nproc_per_node=8 examples/hf_finetune.py --model /models/Llama-3.2-1B \
        --text '/data/books/*.txt' --seq-len 65536 --cp 4 --global-batch 2 --steps 1000 --lr 2e-5 \
        --activation-checkpointing selective --checkpoint-dir /ckpt/llama-64k --resume

    # Packed documents: each sequence holds several documents, each attending to itself only:
    torchrun --nproc_per_node=2 examples/hf_finetune.py --packed-documents --layout document_zigzag --seq-len 1024

Every rank holds seq_len / cp tokens of each sequence (ringfa4.hf.Ring.shard_batch, zigzag by
default) and the attention runs around the cp ring (ringfa4.hf.register). Rank 0 reads the
weights (or draws the tiny model's) and broadcasts each rank its shard, so a node holds one
full copy in host memory, not one per GPU. Needs `pip install "ringfa4[hf]"`.

The data is one stream of tokens cut into sequences. With --packed-documents a document of the
stream ends at an end-of-text mark: a blank line in the byte-level text of the tiny model (the
shipped corpus separates its stories so), the tokenizer's EOS token, appended after every --text
file, for a --model (a file is a document). position_ids restart at 0 at every document start,
transformers' packed format (DataCollatorWithFlattening's); Ring.shard_batch turns them into the
documents' boundaries, so a token attends to its own document only (layout document_zigzag
balances the ring over them) and a document's last token is not scored against the next one.
"""
import argparse
import glob
import math
import os
import time

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from ringfa4 import documents, flops, hf
from ringfa4.nn import build_mesh
from ringfa4.nn.model import ACTIVATION_CHECKPOINTING
from ringfa4.nn.parallel import CP, DP_SHARD
from ringfa4.ring.layout import LAYOUTS
from ringfa4.train import checkpoint, data, launch, metrics

BLANK_LINE = b"\n\n"  # ends a document of byte-level text (--packed-documents), as in the trainer's data=text


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="local folder or hub name of a Llama-architecture causal LM; "
                                   "default: a tiny randomly initialised Llama over byte-level tokens")
    p.add_argument("--text", nargs="*", default=[], help="text files or globs (default: the corpus shipped with ringfa4)")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--global-batch", type=int, default=4, help="sequences per step over all data-parallel ranks")
    p.add_argument("--cp", type=int, default=None, help="ranks per ring (default: all); dp_shard = world / cp")
    p.add_argument("--layout", default="zigzag", choices=LAYOUTS,
                   help="how a sequence is cut over the ring; the document layouts follow the documents "
                        "(--packed-documents)")
    p.add_argument("--packed-documents", action="store_true",
                   help="several documents per sequence, each attending to itself only; a document ends at a "
                        "blank line of the tiny model's byte-level text, at the EOS token appended after every "
                        "--text file for a --model")
    p.add_argument("--backend", default="auto", help="ringfa4 attention backend: auto, cute, fa4, torch")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=5, help="steps of linear warmup, then constant")
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--activation-checkpointing", choices=ACTIVATION_CHECKPOINTING, default="none",
                   help="what backward recomputes: none, pointwise (norms, RoPE and activations only), "
                        "selective (all but the attention, whose ring runs once) or full")
    p.add_argument("--checkpoint-dir", help="write DCP checkpoints here (storage every rank sees)")
    p.add_argument("--checkpoint-interval", type=int, default=10)
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --checkpoint-dir")
    p.add_argument("--run-dir", default=".", help="where metrics.jsonl (and tensorboard/, wandb/) go")
    p.add_argument("--metrics", default="console,jsonl", help=f"comma-separated sinks from {metrics.SINKS}")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.metrics = args.metrics.split(",") if args.metrics else []
    problem = metrics.sink_problem(args.metrics)
    if problem:
        p.error(f"--metrics: {problem}")
    if args.resume and not args.checkpoint_dir:
        p.error("--resume needs --checkpoint-dir")
    if args.layout in documents.LAYOUTS and not args.packed_documents:
        p.error(f"--layout {args.layout} follows the documents: it needs --packed-documents")
    return args


def say(message):
    if dist.get_rank() == 0:
        print(f"hf_finetune: {message}", flush=True)


def tiny_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=data.BYTE_VOCAB, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0, tie_word_embeddings=True)


def build_model(args, ring, mesh, device):
    """The model, sharded with FSDP2 over the mesh: rank 0 loads or draws the full weights and
    every rank receives its shard of them (other ranks build it on the meta device)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(args.model) if args.model else tiny_config()
    if dist.get_rank() == 0:
        torch.manual_seed(args.seed)
        model = (AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation=ring.name)
                 if args.model else AutoModelForCausalLM.from_config(config, attn_implementation=ring.name,
                                                                     dtype=torch.float32))
        full = model.state_dict()
    else:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, attn_implementation=ring.name, dtype=torch.float32)
        model.tie_weights()  # some 5.x releases leave a meta-built model's tied embeddings untied
        full = {}
    param_dtype = torch.bfloat16 if device.type == "cuda" else None
    hf.fully_shard_model(model, mesh, param_dtype=param_dtype, activation_checkpointing=args.activation_checkpointing)
    if dist.get_rank() != 0:
        model.to_empty(device=device)
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    for buffer in model.buffers():  # non-persistent buffers (RoPE frequencies) are in no state dict
        dist.broadcast(buffer, src=0)
    return model, config


def token_stream(args, vocab_size):
    """Byte-level tokens of the text for the tiny model, the model's own tokenizer's otherwise; and
    with --packed-documents where its documents end (data.DocumentBoundaries), else None."""
    if not args.model:
        ends = data.DocumentBoundaries(tuple(BLANK_LINE)) if args.packed_documents else None
        return data.text_stream(args.text), ends
    from transformers import AutoTokenizer

    files = sorted(f for pattern in args.text for f in glob.glob(os.path.expanduser(pattern)))
    if not files:
        raise SystemExit("--text names no file: a real model fine-tunes on your text (--text FILE_OR_GLOB ...)")
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    eos = [tokenizer.eos_token_id] if args.packed_documents else []
    if eos == [None]:
        raise SystemExit(f"--packed-documents ends every --text file with the tokenizer's EOS token, and the "
                         f"tokenizer of {args.model} has none")
    ids = [i for f in files for i in tokenizer(open(f, encoding="utf-8").read())["input_ids"] + eos]
    stream = data.TokenStream(torch.tensor(ids, dtype=torch.int64), vocab_size, f"{len(files)} text file(s)")
    return stream, (data.DocumentBoundaries(tuple(eos)) if eos else None)


def load_batch(sampler, ends, first, count, seq_len, vocab_size):
    """Samples first .. first+count-1 as full sequences: input_ids (count, seq_len), and position_ids
    that restart at 0 at every document start where ``ends`` (packed documents) is given, else None
    (one document per sequence)."""
    input_ids = data.load_samples(sampler, first, count, vocab_size)[:, :seq_len]
    return input_ids, (None if ends is None else ends.positions(input_ids))


def main(argv=None):
    args = parse_args(argv)
    dev_type = "cuda" if torch.cuda.is_available() else "cpu"
    env = [int(os.environ[name]) for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK")]  # set by torchrun
    with launch.process_group(dev_type, *env) as device:
        train(args, device)


def train(args, device):
    world, rank = dist.get_world_size(), dist.get_rank()
    cp = args.cp or world
    if world % cp or args.global_batch % (world // cp):
        raise SystemExit(f"--cp={cp} must divide the world size {world}, and --global-batch={args.global_batch} "
                         f"must be a multiple of dp_shard = world / cp = {world // max(cp, 1)}")
    mesh = build_mesh(device.type, world // cp, cp)
    ring = hf.register(mesh[CP].get_group(), layout=args.layout, backend=args.backend)
    model, config = build_model(args, ring, mesh, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0,
                                  fused=device.type == "cuda")
    stream, ends = token_stream(args, config.vocab_size)
    sampler = data.StreamSampler(stream, args.seq_len, args.seed)
    local_batch = args.global_batch // (world // cp)

    start, position = 0, 0
    step = checkpoint.newest_valid(args.checkpoint_dir, say) if args.resume else None
    if step is not None:
        start, position = checkpoint.load(args.checkpoint_dir, step, model, optimizer, device)
    writer = metrics.Writer(args.metrics if rank == 0 else [], args.steps, args.run_dir, config=vars(args))
    say(f"{world} rank(s) on {device.type}, dp_shard={world // cp} x cp={cp} ({args.layout}), "
        f"{args.model or 'tiny random Llama'}, seq_len={args.seq_len}, global batch {args.global_batch}"
        + (", packed documents" if ends is not None else "")
        + (f", resumed at step {start}" if start else ""))
    flops_per_step = hf.flops_per_token(config, args.seq_len) * args.global_batch * args.seq_len
    pair_flops = 2 * (hf.flops_per_token(config, 1) - hf.flops_per_token(config, 0))  # s * s / 2 pairs per row
    peak, last = metrics.peak_flops(device), time.perf_counter()
    for step in range(start + 1, args.steps + 1):
        lr = args.lr * min(1.0, step / max(1, args.warmup))
        for group in optimizer.param_groups:
            group["lr"] = lr
        first = position + mesh.get_local_rank(DP_SHARD) * local_batch
        input_ids, position_ids = load_batch(sampler, ends, first, local_batch, args.seq_len, config.vocab_size)
        batch = ring.shard_batch(input_ids, position_ids=position_ids)
        batch = {k: t if k == "cu_seqlens" else t.to(device) for k, t in batch.items()}  # read on the host
        share = hf.causal_lm_loss(model, batch, hf.global_token_count(batch))
        share.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        position += args.global_batch
        # The global loss, and the pairs hidden in the global batch: a ring's ranks share their rows.
        hidden = flops.hidden_pairs(batch["cu_seqlens"].tolist(), args.seq_len) / cp
        totals = torch.tensor([0.0, hidden], dtype=torch.float64, device=device)
        totals[0] = share.detach()
        dist.all_reduce(totals)
        loss, hidden = totals.tolist()
        if not math.isfinite(loss):
            raise FloatingPointError(f"loss is {loss} at step {step}; no checkpoint written")
        now = time.perf_counter()
        seconds, last = now - last, now
        step_flops = flops_per_step - pair_flops * hidden
        writer.write({"step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm.full_tensor().item(),
                      "tokens_per_s": args.global_batch * args.seq_len / seconds,
                      "tflops_per_device": step_flops / world / seconds / 1e12,
                      "mfu": step_flops / world / seconds / peak if peak else None,
                      "peak_mem_gib": metrics.peak_memory_gib(device)})
        if args.checkpoint_dir and (step % args.checkpoint_interval == 0 or step == args.steps):
            checkpoint.save(args.checkpoint_dir, step, model, optimizer, position, device, keep=2)
            last = time.perf_counter()  # throughput counts training, not saving
    writer.close()


if __name__ == "__main__":
    main()
    if launch.under_torchrun():  # a rank ends as the trainer's do (see launch.end_process)
        launch.end_process()
