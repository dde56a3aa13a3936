"""Ring attention forward+backward on W GPUs against (a) the same kernels on one GPU at the same
total length and (b) PyTorch's context_parallel ring over cuDNN SDPA, on the same inputs, in one run.

    torchrun --nproc_per_node=2 bench/ring.py --commit $(git rev-parse --short HEAD)
    torchrun --nproc_per_node=2 bench/ring.py --head-groups 1,2   # U x R = 1 x 2 and 2 x 1 side by side
    torchrun --nproc_per_node=2 bench/ring.py --overhead 512,1024,2048,4096   # per-step cost, eager vs CUDA graph
    torchrun --nproc_per_node=2 bench/ring.py --smoke      # CPU (gloo), torch backend, tiny shapes

Batch 1, hdim 128, bf16; heads/kv_heads 32/32 and 32/8; total causal sequence 16k..128k plus
non-causal 32k. Times are per fwd+bwd call, CUDA events around a fixed number of calls after
warm-up, the slowest rank's, the median of rounds in which the 1-GPU call, the ring of every
head-group split and PyTorch's ring take turns (see Timer). A split U x R (--head-groups, U
dividing W) is ringfa4's 2-D context parallelism: all-to-alls over a head group of U consecutive
ranks around a ring over R = W / U (ringfa4.nn.parallel.build_mesh lays the groups out as the
trainer does); U = 1 is the plain ring, R = 1 pure head parallelism. FLOPs 3.5 * 4*s*s*h*d
(halved for causal): backward = 2.5x forward. efficiency = single_ms / (W * ringfa4_ms).
PyTorch's ring gets the same q, k, v with kv heads repeated to the query heads (its SDPA path
takes no GQA; torchtitan does the same), default rotate method and load balancer (disabled for
non-causal, which it refuses otherwise). One more call per split runs under
ringfa4.ring.timeline: per-step compute, merge and transfer times from CUDA events. Before
timing, every split's output is compared with the single-GPU one, so nothing wrong is timed.
--overhead LOCALS measures instead what a step of the plain causal ring (first backend, first
heads pair) costs beyond its kernels at short local lengths: per step, (call - the rank's kernels
timed alone, bench/simulate.py's _kernels_ms) / (2 W), eager (against the kernels called back to
back) and with the whole fwd+bwd call, NCCL sends and receives included, captured in one CUDA
graph and replayed (against the kernels replayed from graphs); the worst rank's. Rows:
ring_overhead.json.
Rows go to ring.json in a temporary directory, --out-dir DIR, or with --record
bench/results/ring.json (bench/measure.py); a markdown table is printed last. `python -m
ringfa4.plan --refit` takes these rows to check its predictions against (U x R rows included).
"""
import contextlib
import functools
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import ringfa4  # noqa: E402
from bench import measure  # noqa: E402
from ringfa4 import backends, flops  # noqa: E402
from ringfa4.nn import parallel  # noqa: E402
from ringfa4.ring import comm, heads, merge, timeline  # noqa: E402
from ringfa4.train import launch  # noqa: E402

# The ring's bf16 output vs one GPU's: two roundings of values |O| < ~4 apart, never more.
MAX_DIFF = 3e-2


def parse_args():
    p = measure.parser(__doc__.split("\n\n")[0])
    p.add_argument("--backends", default="fa4,cute", help="comma list; a backend that cannot run is reported and skipped")
    p.add_argument("--seqs", default="16384,32768,65536,131072", help="total causal sequence lengths")
    p.add_argument("--full-seqs", default="32768", help="total non-causal sequence lengths")
    p.add_argument("--heads", default="32:32,32:8", help="heads:kv_heads pairs")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--head-groups", default="1", help="comma list of head-group sizes U (each divides the world; 1: plain ring)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--iters", type=int, default=3, help="calls per round")
    p.add_argument("--rounds", type=int, default=3, help="rounds, taken in turn by the contenders of a row")
    p.add_argument("--overhead", default=None, metavar="LOCALS",
                   help="comma list of local lengths: per-step cost beyond the kernels, eager and CUDA-graphed")
    p.add_argument("--smoke", action="store_true", help="CPU/gloo, backend torch, float32, tiny shapes")
    args = p.parse_args()
    if args.smoke:
        args.backends, args.seqs, args.full_seqs, args.heads, args.head_dim = "torch", "256", "256", "4:4,4:2", 32
    measure.check_output_args(p, args, args.smoke)
    args.head_groups = [int(u) for u in args.head_groups.split(",")]
    return args


def fwd_bwd(attn, leaves, dout):
    def run():
        out = attn(*leaves)
        torch.autograd.grad(out, leaves, dout)
        return out
    return run


def inputs(seq, heads, kv_heads, head_dim, dtype, device, seed):
    gen = torch.Generator(device=device).manual_seed(seed)
    return [torch.randn(1, seq, n, head_dim, device=device, generator=gen, dtype=torch.float32).to(dtype)
            for n in (heads, kv_heads, kv_heads, heads)]


def summarize(spans):
    """{phase_kind: [ms per step]} from a timeline (rank-local)."""
    out = {}
    for phase, _step, kind, ms in spans:
        out.setdefault(f"{phase}_{kind}", []).append(round(ms, 4))
    return out


@contextlib.contextmanager
def torch_cp(q, k, v, dout, causal, mesh):
    """Yields (fn, rotate method): fn is one fwd+bwd of PyTorch's context_parallel over cuDNN SDPA.

    Its context stays entered while fn runs, so that fn can take turns with ours in one Timer
    call; it changes only SDPA, which ringfa4 does not call."""
    # Fresh buffers in SDPA's layout: CP shards them in place.
    bufs = [t.contiguous() for t in measure.sdpa_layout(q, k, v) + [dout.transpose(1, 2)]]
    with measure.torch_context_parallel(mesh, bufs, [2] * 4, load_balance=causal) as options:
        leaves = [t.detach().requires_grad_() for t in bufs[:3]]
        yield fwd_bwd(lambda *qkv: measure.sdpa(*qkv, causal), leaves, bufs[3]), str(options.rotate_method.name)


def enter_torch_cp(stack, q, k, v, dout, causal, mesh, say):
    """(fn or None, rotate method, error): PyTorch's ring entered on ``stack`` and tried once."""
    if mesh is None:
        return None, None, "CUDA only (cuDNN SDPA)"
    try:
        fn, rotate = stack.enter_context(torch_cp(q, k, v, dout, causal, mesh))
        fn()
        return fn, rotate, None
    except Exception as e:  # reported in the row and the table, never hidden
        stack.close()
        error = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        say(f"torch context_parallel failed: {error}", flush=True)
        return None, None, error


def overhead_rows(args, timer, device, dtype, meta, rows):
    """Per-step cost of the plain causal ring beyond its kernels at each local length of --overhead."""
    from bench import simulate

    rank, world = dist.get_rank(), dist.get_world_size()
    name = args.backends.split(",")[0]
    h, hk = map(int, args.heads.split(",")[0].split(":"))
    d = args.head_dim
    alone = measure.Timer(device, rounds=args.rounds, warmup=1, turn_ms=None if device.type == "cpu" else 200)
    for local in map(int, args.overhead.split(",")):
        seq = local * world
        q, k, v, dout = inputs(seq, h, hk, d, dtype, device, seed=seq)
        leaves = [ringfa4.shard(t).detach().requires_grad_() for t in (q, k, v)]
        ring = fwd_bwd(functools.partial(ringfa4.ring_attention, causal=True, backend=name), leaves, ringfa4.shard(dout))
        mine = simulate._rank(backends.get(name), seq, h, hk, d, True, dtype, device, 1, world, rank)
        kernels, gpu_kernels = [None] * world, [None] * world
        dist.all_gather_object(kernels, simulate._kernels_ms(mine, alone))
        dist.all_gather_object(gpu_kernels, simulate._kernels_ms(mine, alone, graphs=True) if device.type == "cuda"
                               else None)
        eager = timer(ring)[0]
        replay, error = measure.graphed(ring) if device.type == "cuda" else (None, "CPU: no CUDA graph")
        errors = [None] * world
        dist.all_gather_object(errors, error)
        error = next((e for e in errors if e), None)
        graph = timer(replay)[0] if error is None else None
        # Eager against the kernels called eagerly (the planner adds the host's floor apart), the
        # graph against the kernels replayed from graphs: each beyond the same kind of kernel time.
        def per_step(ms, alone):
            return None if ms is None or None in alone else max(ms - k for k in alone) / (2 * world) * 1e3
        rows.add(dict(meta, kind="overhead_nccl", backend=name, world=world, local=local, heads=h, kv_heads=hk,
                      head_dim=d, causal=True, dtype=str(dtype).split(".")[-1], kernels_ms_by_rank=kernels,
                      graphed_kernels_ms_by_rank=gpu_kernels, eager_ms=eager, graph_ms=graph, graph_error=error,
                      eager_overhead_us_per_step=per_step(eager, kernels),
                      graph_overhead_us_per_step=per_step(graph, gpu_kernels)))
        del leaves, ring, mine


def merge_microbench(timer, local, heads, head_dim, device):
    """ms of one merge of a half-block partial into the running (out, lse), fused vs eager."""
    gen = torch.Generator(device=device).manual_seed(0)
    out = torch.randn(1, local, heads, head_dim, device=device, generator=gen)
    lse = torch.randn(1, heads, local, device=device, generator=gen)
    part = torch.randn(1, local // 2, heads, head_dim, device=device, generator=gen).to(torch.bfloat16)
    lse_part = torch.randn(1, heads, local // 2, device=device, generator=gen)
    half = local // 2
    view = (out[:, half:], lse[:, :, half:], part, lse_part)
    return timer(lambda: merge.merge_(*view), lambda: merge._merge_into(*view))


def main():
    args = parse_args()
    if args.smoke:
        dist.init_process_group("gloo")
        device, dtype = torch.device("cpu"), torch.float32
        torch.set_num_threads(1)
    else:
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device, pg_options=comm.nccl_options())
        dtype = torch.bfloat16
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = None
    if device.type == "cuda":
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cuda", (world,))
    timer = measure.Timer(device, rounds=args.rounds, warmup=args.warmup, iters=args.iters, reduce="median",
                          group=dist.group.WORLD)
    say = print if rank == 0 else (lambda *a, **k: None)
    meta = measure.metadata(device, args.commit, world=world)
    say(f"# bench/ring.py {meta}", flush=True)
    rows = measure.Rows(measure.output_dir(args) / ("ring_overhead.json" if args.overhead else "ring.json")
                        if rank == 0 else None)
    if args.overhead:
        overhead_rows(args, timer, device, dtype, meta, rows)
        if rank == 0:
            print(overhead_table(rows))
        dist.destroy_process_group()
        return

    splits = {}  # U -> (ring group, head group or None), as the trainer's mesh lays them out
    for u in args.head_groups:
        if u < 1 or world % u:
            raise SystemExit(f"--head-groups: {u} does not divide the world size {world}")
        grid = parallel.build_mesh(device.type, 1, world, cp_heads=u)
        splits[u] = grid[parallel.CP].get_group(), parallel.head_group(grid)
    head_pairs = [tuple(int(x) for x in pair.split(":")) for pair in args.heads.split(",")]
    configs = [(int(s), True) for s in args.seqs.split(",")] + [(int(s), False) for s in args.full_seqs.split(",")]
    for h, hk in head_pairs:
        for seq, causal in configs:
            d = args.head_dim
            q, k, v, dout = inputs(seq, h, hk, d, dtype, device, seed=1000 + seq + h + hk)
            work = flops.attention(1, seq, seq, h, d, causal, "fwd+bwd")
            for name in args.backends.split(","):
                reason = backends.get(name).unsupported_reason(q, k, v, causal, True)
                if reason is not None:
                    say(f"backend {name}: skipped, {reason}", flush=True)
                    continue

                def single_attn(q_, k_, v_):
                    return ringfa4.attention(q_, k_, v_, causal=causal, backend=name)[0]

                single = fwd_bwd(single_attn, [t.detach().clone().requires_grad_() for t in (q, k, v)], dout)
                expected = single()
                rings, diffs = {}, {}
                for u, (group, head_group) in splits.items():
                    if not heads.splits(h, hk, u):
                        say(f"U={u}: skipped, heads {h}/{hk} do not split over it", flush=True)
                        continue
                    part = functools.partial(ringfa4.shard, group=group, head_group=head_group)
                    local = [part(t).detach().requires_grad_() for t in (q, k, v)]
                    rings[u] = fwd_bwd(functools.partial(ringfa4.ring_attention, causal=causal, backend=name,
                                                         group=group, head_group=head_group), local, part(dout))
                    diff = (rings[u]().float() - part(expected).float()).abs().max()
                    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
                    if not diff.item() < MAX_DIFF:
                        raise RuntimeError(f"U={u} output differs from one GPU's by {diff.item():.3g} "
                                           f"({name} seq={seq} causal={causal})")
                    diffs[u] = diff.item()
                del expected
                with contextlib.ExitStack() as stack:
                    cp, cp_rotate, cp_error = enter_torch_cp(stack, q, k, v, dout, causal, mesh, say)
                    single_ms, *ring_ms = timer(single, *rings.values(), *([cp] if cp else []))
                    cp_ms = ring_ms.pop() if cp else None
                    mallocs = timer.mallocs
                    del cp  # its closure holds PyTorch's buffers: free them with the context
                for i, (u, ring) in enumerate(rings.items()):
                    with timeline.recording() as tl:
                        ring()
                    by_rank = [None] * world
                    dist.all_gather_object(by_rank, summarize(tl.milliseconds()) if device.type == "cuda" else {})
                    r_world = world // u
                    row = dict(meta, seq=seq, causal=causal, heads=h, kv_heads=hk, head_dim=d,
                               dtype=str(dtype).split(".")[-1], backend=name, head_world=u, ring_world=r_world,
                               ringfa4_ms=round(ring_ms[i], 3), single_ms=round(single_ms, 3),
                               efficiency=round(single_ms / (world * ring_ms[i]), 4),
                               tflops_per_gpu=round(flops.tflops(work / world, ring_ms[i]), 1),
                               single_tflops=round(flops.tflops(work, single_ms), 1),
                               torch_cp_ms=None if cp_ms is None else round(cp_ms, 3),
                               torch_cp_tflops_per_gpu=None if cp_ms is None else round(flops.tflops(work / world, cp_ms), 1),
                               torch_cp_rotate=cp_rotate, torch_cp_error=cp_error,
                               max_abs_diff_vs_single=float(f"{diffs[u]:.3g}"),
                               device_mallocs_while_timed={"single": mallocs[0], "ring": mallocs[1 + i],
                                                           "torch_cp": mallocs[-1] if cp_ms is not None else None},
                               kv_bytes_per_step=2 * (seq // world) * hk * d * q.element_size() if r_world > 1 else None,
                               step_ms=by_rank[0], step_ms_by_rank=by_rank)
                    if device.type == "cuda" and u == 1 and seq // world == 16384 and causal:
                        fused, eager = merge_microbench(timer, seq // world, h, d, device)
                        row.update(merge_fused_ms=round(fused, 4), merge_eager_ms=round(eager, 4))
                    rows.add(row)
                del single, rings
            del q, k, v, dout
            if device.type == "cuda":
                torch.cuda.empty_cache()

    if rank == 0:
        print(table(rows))
        print(f"wrote {rows.path}")
    dist.destroy_process_group()


def _tokens(n):
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def _mean_ms(spans, key):
    values = spans.get(key)
    return f"{sum(values) / len(values):.2f}" if values else "-"


def overhead_table(rows):
    lines = ["| local | kernels ms, called / replayed (worst rank) | eager ms | graph ms | eager us/step beyond kernels "
             "| graph us/step |", "|---|---|---|---|---|---|"]
    for r in rows:
        g = "n/a" if r["graph_ms"] is None else f"{r['graph_ms']:.3f}"
        gs = r["graph_error"] if r["graph_ms"] is None else f"{r['graph_overhead_us_per_step']:.1f}"
        replayed = r["graphed_kernels_ms_by_rank"]
        kg = "n/a" if None in replayed else f"{max(replayed):.3f}"
        lines.append(f"| {r['local']} | {max(r['kernels_ms_by_rank']):.3f} / {kg} | {r['eager_ms']:.3f} | {g} "
                     f"| {r['eager_overhead_us_per_step']:.1f} | {gs} |")
    return "\n".join(lines)


def table(rows):
    """Markdown: timings, efficiency, PyTorch's ring, and rank 0's per-step timeline (means over
    steps; "-": no such transfer, e.g. no KV travels in a 2-rank backward)."""
    lines = ["| backend | U x R | seq | causal | heads/kv | ringfa4 ms | 1-GPU ms | efficiency | TFLOP/s/GPU | torch CP TFLOP/s/GPU | vs torch CP "
             "| fwd step: compute / kv / merge ms | bwd step: compute / kv / dkv / dkv wait ms |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cp, s = r["torch_cp_tflops_per_gpu"], r["step_ms"]
        cp_cells = ("n/a", "n/a") if cp is None else (f"{cp:.0f}", f"{r['tflops_per_gpu'] / cp:.2f}x")
        fwd = " / ".join(_mean_ms(s, k) for k in ("fwd_compute", "fwd_kv", "fwd_merge"))
        bwd = " / ".join(_mean_ms(s, k) for k in ("bwd_compute", "bwd_kv", "bwd_dkv", "bwd_wait_dkv"))
        lines.append(
            f"| {r['backend']} | {r['head_world']} x {r['ring_world']} | {_tokens(r['seq'])} | {'yes' if r['causal'] else 'no'} | {r['heads']}/{r['kv_heads']} "
            f"| {r['ringfa4_ms']:.2f} | {r['single_ms']:.2f} | {r['efficiency']:.3f} | {r['tflops_per_gpu']:.0f} "
            f"| {cp_cells[0]} | {cp_cells[1]} | {fwd} | {bwd} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
    if launch.under_torchrun():  # a rank ends as the trainer's do (see launch.end_process)
        launch.end_process()
