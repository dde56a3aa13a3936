"""Packed documents (issue 14): attention over document mixes on one GPU, ringfa4 vs upstream FA4's
varlen kernels, and the per-rank work of a ring with documents vs the dense causal ring.

    python bench/documents.py                     # both parts, H100/H200, bf16, hdim 128
    python bench/documents.py --part ring --worlds 2,4,8
    python bench/documents.py --smoke             # CPU, torch backend, tiny shapes, no FA4
    torchrun --nproc_per_node=2 bench/documents.py --part ring   # the ring over NCCL on 2 GPUs

Document mixes: ringfa4.ring.balance.document_mix (log-normal lengths, median 4096, fixed seed,
packed to the total; "long" first places 3 documents of 64k+ tokens, clipped to the total).
FLOPs count the (query, key) pairs the causal document mask leaves visible only: per document of
n tokens n (n + 1) / 2 pairs, each 4 * heads * head_dim FLOPs forward (ringfa4.flops), 3.5x that
for forward + backward.

Attention rows (one GPU, causal): ringfa4.attention(cu_seqlens=) with --backend (auto picks cute
on Hopper) vs flash_attn.cute.flash_attn_varlen_func on the same packed documents, both called as a
model's layers call them (cu_seqlens on the GPU, the same tensor every call), and PyTorch's
FlexAttention (torch.compile'd, the causal document mask as a block mask built once, kv heads
given as they are), outs compared first; forward (no grad) and forward + backward (autograd). The
backward is torch.autograd.grad, as in bench/kernels.py and bench/ring.py: gradients handed back as a
model's layer hands them to the projections before it, not added into the leaves' .grad (that add,
~3 memory passes over q, k and v per call, is no part of attention and weighs ~13x more next to
4k-token documents' work than next to a dense sequence's). No
cuDNN/SDPA column: SDPA takes documents only as a dense mask, which is not the same work.

Ring rows: every rank of a W-rank ring simulated on this GPU (ringfa4.ring.simulate.SimulatedRing:
the real ring_forward / ring_backward, transfers as device copies), fwd+bwd timed over back-to-back
calls (at least 100 ms of them per round, as the attention rows), for the dense causal
ring (zigzag) and for the documents in zigzag and the document layouts; the ring's time is its slowest
rank's. TFLOP/s per GPU = visible-pair FLOPs / W / slowest rank time; ratio = that / the dense
ring's (target >= 0.85), peak memory of the slowest rank's call against the dense one's, and the
steps the documents skipped and the transfers a ring stopped early did not make
(ringfa4.ring.documents.counting).

Under torchrun (--part ring) the ring runs over NCCL on the W GPUs instead (gloo on the CPU with
--smoke; rows in documents_ring_ranks[_wW][_seedS].json, W and S named where not 2 and 0): every
rank makes the same inputs, takes its shard (ringfa4.shard, cu_seqlens on the GPU) and calls the
public ringfa4.ring_attention forward and backward through autograd, as a model's layer does; the
dense causal ring (zigzag) and the mixes in document_balanced, each first checked against one
GPU's ringfa4.attention on the full sequence. A case's calls are timed back to back (as many as
fill ~100 ms, the same count on every rank), the round's time the slowest rank's (Timer with the
process group); peak memory is the largest rank's.
"""
import inspect
import math
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import ringfa4  # noqa: E402
from ringfa4 import documents, flops  # noqa: E402
from ringfa4.api import _choose_backend  # noqa: E402
from ringfa4.ring import balance  # noqa: E402
from ringfa4.ring import layout as ring_layout  # noqa: E402
from ringfa4.ring.attention import ring_backward, ring_forward  # noqa: E402
from ringfa4.ring.documents import RingDocuments, counting  # noqa: E402
from ringfa4.ring.simulate import SimulatedRing  # noqa: E402
from ringfa4.train import launch  # noqa: E402

import measure  # noqa: E402

MIXES = {"log-normal": 0, "long": 3}


def parse_args():
    p = measure.parser(__doc__.split("\n\n")[0])
    p.add_argument("--part", default="all", choices=("all", "attention", "ring"))
    p.add_argument("--backend", default="auto")
    p.add_argument("--seqs", default="32768,131072")
    p.add_argument("--ring-seq", type=int, default=131072)
    p.add_argument("--worlds", default="2,4,8")
    p.add_argument("--heads", default="32:8", help="heads:kv_heads")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args()
    measure.check_output_args(p, args, args.smoke)
    if args.smoke:
        args.seqs, args.ring_seq, args.worlds, args.heads, args.head_dim = "256", 256, "2", "4:2", 16
        args.backend, args.rounds = "torch", 1
    return args


def visible_flops(row, heads, head_dim, direction):
    """FLOPs of the causal document mask's visible pairs (see the module docstring)."""
    return flops.attention(1, 1, 1, heads, head_dim, causal=False, direction=direction) * flops.causal_pairs(row)


def inputs(seq, heads, kv_heads, head_dim, device, dtype, seed):
    gen = torch.Generator(device=device).manual_seed(seed)
    return [torch.randn(1, seq, n, head_dim, device=device, dtype=dtype, generator=gen) for n in (heads, kv_heads,
                                                                                                   kv_heads, heads)]


def fa4_varlen(q, k, v, cu, row):
    """Upstream FA4's public varlen function on the packed (total, heads, dim) rows: its out. The
    longest document comes from the host boundaries ``row``, as a user's batch would give it once
    for every layer (reading it from ``cu`` would time a device sync per call)."""
    from flash_attn.cute import flash_attn_varlen_func

    longest = max(b - a for a, b in zip(row, row[1:]))
    kwargs = {"cu_seqlens_q": cu, "cu_seqlens_k": cu, "causal": True}
    if "max_seqlen_q" in inspect.signature(flash_attn_varlen_func).parameters:
        kwargs.update(max_seqlen_q=longest, max_seqlen_k=longest)
    out = flash_attn_varlen_func(q[0], k[0], v[0], **kwargs)
    return (out[0] if isinstance(out, tuple) else out)[None]


def flex_documents(row, seq, device):
    """PyTorch's FlexAttention, compiled, with the causal document mask as a block mask built once
    for the documents (as a model builds it once per batch): a fn of (b, s, h, d) q, k, v."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    doc = documents.local_ids([row], seq, device)[0][0]
    # compiled: built eagerly the mask is materialised whole (128 GiB at 128k tokens)
    block_mask = create_block_mask(lambda b, h, i, j: (doc[i] == doc[j]) & (j <= i), None, None, seq, seq,
                                   device=device, _compile=True)
    flex = torch.compile(flex_attention)
    return lambda q, k, v: flex(*(t.transpose(1, 2) for t in (q, k, v)), block_mask=block_mask,
                                enable_gqa=True).transpose(1, 2)


def attention_rows(args, device, dtype, rows):
    heads, kv_heads = map(int, args.heads.split(":"))
    for seq in map(int, args.seqs.split(",")):
        for mix, long_docs in MIXES.items():
            row = balance.document_mix(seq, args.seed, long_docs)
            cu = torch.tensor(row, dtype=torch.int32, device=device)
            q, k, v, dout = inputs(seq, heads, kv_heads, args.head_dim, device, dtype, args.seed)
            ours = lambda *t: ringfa4.attention(*t, causal=True, backend=args.backend, cu_seqlens=cu)[0]  # noqa: E731
            contenders = {"ringfa4": ours}
            if not args.smoke:
                contenders["fa4_varlen"] = lambda *t: fa4_varlen(*t, cu, row)
                contenders["flex"] = flex_documents(row, seq, device)
                for name in ("fa4_varlen", "flex"):
                    err = (ours(q, k, v).float() - contenders[name](q, k, v).float()).abs().max().item()
                    assert err < 2e-2, f"ringfa4 and {name} differ by {err} at seq {seq} ({mix})"
            timer = measure.Timer(device, rounds=args.rounds, turn_ms=None if args.smoke else 100, reduce="min")
            for direction in ("fwd", "fwd+bwd"):
                # auto chooses per call and may choose differently when gradients are needed.
                probe = q.detach().requires_grad_(direction != "fwd")
                backend = _name(_choose_backend(args.backend, probe, k, v, True,
                                                documents.local_ids([row], seq, device)))
                fns = []
                for fn in contenders.values():
                    if direction == "fwd":
                        fns.append(torch.no_grad()(lambda fn=fn: fn(q, k, v)))
                    else:
                        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
                        fns.append(lambda fn=fn, leaves=leaves: torch.autograd.grad(fn(*leaves), leaves, dout))
                times = timer(*fns)
                work = visible_flops(row, heads, args.head_dim, direction)
                rows.add(measure.metadata(device, args.commit, part="attention", seq=seq, mix=mix,
                                          documents=len(row) - 1, heads=heads, kv_heads=kv_heads,
                                          head_dim=args.head_dim, direction=direction, backend=backend,
                                          visible_flops=work,
                                          **{f"{name}_ms": ms for name, ms in zip(contenders, times)},
                                          **{f"{name}_tflops": flops.tflops(work, ms)
                                             for name, ms in zip(contenders, times)}))


def rank_call(backend, full, rank, world, layout, row, device):
    """fwd+bwd of ring rank ``rank`` on this device; ``row`` None: no documents (dense ring)."""
    q, k, v, dout = full
    rows = None if row is None else [row]
    blocks = [[ring_layout.part(t, r, world, layout, rows=rows) for t in (k, v)] for r in range(world)]
    q_local, dout_local = (ring_layout.part(t, rank, world, layout, rows=rows) for t in (q, dout))
    docs = None if row is None else RingDocuments([row], rank, world, layout, q.shape[1], device)
    scale = q.shape[-1] ** -0.5

    def call():
        ring = SimulatedRing(rank, world, blocks, device, steps=None if docs is None else docs.steps(True))
        out, lse, kv_last = ring_forward(backend, q_local, *blocks[rank], True, scale, ring, layout, docs)
        ring_backward(backend, dout_local, q_local, *blocks[rank], out, lse, kv_last, True, scale, ring.turned(),
                      layout, False, docs)
    return call


def _name(backend):
    return backend.__name__.rsplit(".", 1)[-1]


def ring_backend(args, full, world, row):
    """The backend --backend picks for a rank's steps (the ring runs forward and backward: the
    backend must take both, hence the requires_grad probe); ``row`` None: no documents."""
    q, k, v = (t[:, :t.shape[1] // world] for t in full[:3])
    doc_ids = None if row is None else documents.local_ids([row], q.shape[1], q.device)
    return _choose_backend(args.backend, q.detach().requires_grad_(), k, v, True, doc_ids)


def ring_work(row, seq, heads, head_dim):
    """fwd+bwd FLOPs of the ring: the documents' visible pairs, or the dense causal sequence's."""
    if row is None:
        return flops.attention(1, seq, seq, heads, head_dim, causal=True, direction="fwd+bwd")
    return visible_flops(row, heads, head_dim, "fwd+bwd")


def peak_bytes(device, fn):
    """(fn(), the bytes allocated at its peak beyond those allocated before it; 0 off CUDA)."""
    if device.type != "cuda":
        return fn(), 0
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    result = fn()
    return result, torch.cuda.max_memory_allocated(device) - base


def ring_rows(args, device, dtype, rows):
    heads, kv_heads = map(int, args.heads.split(":"))
    seq = args.ring_seq
    full = inputs(seq, heads, kv_heads, args.head_dim, device, dtype, args.seed)
    for world in map(int, args.worlds.split(",")):
        dense_mem = dense_tflops = None
        cases = [("dense", "zigzag", None)] + [(mix, layout, balance.document_mix(seq, args.seed, n))
                                               for mix, n in MIXES.items() for layout in ("zigzag",) + documents.LAYOUTS]
        for mix, layout, row in cases:
            backend = ring_backend(args, full, world, row)
            # Back-to-back calls, as a model's layers make them: one call between two events would
            # also count the host's latency before its first kernel (0.5-0.9 ms, 10% of a rank's
            # call with documents at W = 8), which a training step hides behind the layer before.
            timer = measure.Timer(device, rounds=args.rounds, turn_ms=None if args.smoke else 100, reduce="median")
            times, mems, skipped, saved = [], [], {"fwd": 0, "bwd": 0}, {"fwd": 0, "bwd": 0}
            for rank in range(world):
                call = rank_call(backend, full, rank, world, layout, row, device)
                with counting() as count:
                    call()
                skipped = {p: skipped[p] + count.skipped[p] for p in skipped}
                saved = {p: saved[p] + count.transfers_saved[p] for p in saved}
                (ms,), mem = peak_bytes(device, lambda: timer(call))
                times.append(ms)
                mems.append(mem)
            work = ring_work(row, seq, heads, args.head_dim)
            slowest = max(times)
            per_gpu = flops.tflops(work / world, slowest)
            if row is None:
                dense_mem, dense_tflops = max(mems), per_gpu
            rows.add(measure.metadata(device, args.commit, part="ring", seq=seq, world=world, mix=mix, layout=layout,
                                      documents=1 if row is None else len(row) - 1, heads=heads, kv_heads=kv_heads,
                                      head_dim=args.head_dim, backend=_name(backend), rank_ms=times,
                                      slowest_ms=slowest, tflops_per_gpu=per_gpu,
                                      vs_dense=per_gpu / dense_tflops, peak_mem_bytes=max(mems),
                                      mem_vs_dense=max(mems) / dense_mem if dense_mem else None,
                                      skipped_steps=skipped, transfers_saved=saved))


def ranks_ring_rows(args, device, dtype, rows):
    """The dense causal ring and the mixes in document_balanced over this process group (see the
    module docstring)."""
    heads, kv_heads = map(int, args.heads.split(":"))
    seq, world = args.ring_seq, dist.get_world_size()
    full = inputs(seq, heads, kv_heads, args.head_dim, device, dtype, args.seed)
    dense_mem = dense_tflops = None
    cases = [("dense", "zigzag", None)] + [(mix, documents.DOCUMENT_BALANCED, balance.document_mix(seq, args.seed, n))
                                           for mix, n in MIXES.items()]
    for mix, layout, row in cases:
        cu = None if row is None else torch.tensor(row, dtype=torch.int32, device=device)
        q, k, v, dout = (ringfa4.shard(t, dim=1, layout=layout, cu_seqlens=cu) for t in full)
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]

        def call(leaves=leaves, dout=dout, layout=layout, cu=cu):
            out = ringfa4.ring_attention(*leaves, causal=True, layout=layout, backend=args.backend, cu_seqlens=cu)
            torch.autograd.grad(out, leaves, dout)
            return out

        with torch.no_grad():
            expected = ringfa4.attention(*full[:3], causal=True, backend=args.backend, cu_seqlens=cu)[0]
        err = (call().float() - ringfa4.shard(expected, dim=1, layout=layout, cu_seqlens=cu).float()).abs().max()
        assert err.item() < 2e-2, f"the {mix} ring's out differs from one GPU's by {err.item()}"
        with counting() as count:
            call()
        (first,), mem = peak_bytes(device, lambda: measure.Timer(device, rounds=1, warmup=0,
                                                                group=dist.group.WORLD)(call))
        mem = torch.tensor(float(mem), device=device)
        dist.all_reduce(mem, op=dist.ReduceOp.MAX)
        timer = measure.Timer(device, rounds=args.rounds, iters=max(1, math.ceil(100 / first)), reduce="median",
                              group=dist.group.WORLD)
        (ms,) = timer(call)
        per_gpu = flops.tflops(ring_work(row, seq, heads, args.head_dim) / world, ms)
        if row is None:
            dense_mem, dense_tflops = mem.item(), per_gpu
        rows.add(measure.metadata(device, args.commit, part="ring_ranks", seq=seq, world=world, mix=mix,
                                  layout=layout, documents=1 if row is None else len(row) - 1, heads=heads,
                                  kv_heads=kv_heads, head_dim=args.head_dim,
                                  backend=_name(ring_backend(args, full, world, row)),
                                  calls_per_turn=timer.calls[0], slowest_ms=ms, tflops_per_gpu=per_gpu,
                                  vs_dense=per_gpu / dense_tflops, peak_mem_bytes=mem.item(),
                                  mem_vs_dense=mem.item() / dense_mem if dense_mem else None,
                                  skipped_steps=count.skipped, transfers_saved=count.transfers_saved))


def ranks_main(args):
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if args.part != "ring":
        raise SystemExit("under torchrun bench/documents.py runs the ring only: pass --part ring")
    with launch.process_group("cpu" if args.smoke else "cuda", rank, world, int(os.environ["LOCAL_RANK"])) as device:
        # one file per ring size and seed, so that runs into one --out-dir keep each other's rows
        name = "documents_ring_ranks" + (f"_w{world}" if world != 2 else "") + (f"_seed{args.seed}" if args.seed else "")
        path = measure.output_dir(args) / f"{name}.json" if rank == 0 else None
        ranks_ring_rows(args, device, torch.float32 if args.smoke else torch.bfloat16, measure.Rows(path))


def main():
    args = parse_args()
    if launch.under_torchrun():
        ranks_main(args)
        return
    device = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    out = measure.output_dir(args)
    if args.part in ("all", "attention"):
        attention_rows(args, device, dtype, measure.Rows(out / "documents_attention.json"))
    if args.part in ("all", "ring"):
        ring_rows(args, device, dtype, measure.Rows(out / "documents_ring.json"))


if __name__ == "__main__":
    main()
    if launch.under_torchrun():  # a rank ends as the trainer's do (see launch.end_process)
        launch.end_process()
