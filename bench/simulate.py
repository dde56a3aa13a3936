"""One rank of a W-GPU ring simulated on one GPU (ringfa4.ring.simulate): its compute time per step
and in total, against the same attention on one GPU, and what a ring step costs beyond its kernels.

    python bench/simulate.py --seqs 131072 --heads 32:8,64:8 --worlds 8,16,32,64,72
    python bench/simulate.py --overhead                  # per-step cost beyond the kernels, short chunks
    python bench/simulate.py --smoke                     # CPU, torch backend, tiny shapes

Efficiency rows: for each W, the pure ring (U = 1) and every head group size U that divides W, is at
most --max-head-group and splits the heads (ringfa4.ring.heads.check_split); a length that does not
split over U x R becomes the nearest one that does, with chunks of whole 128-row tiles (both are
recorded). The rank time is the slowest of the simulated ring ranks (--ranks: the first and the
last, the two extremes of the zigzag schedule), one fwd+bwd call each, the Timer's median; on a
GPU each rank's call is also captured in a CUDA graph and replayed (graph_rank_ms,
graph_efficiency): its compute without the host's time to issue the steps, which bounds short
chunks eagerly and varies with the machine's CPU; the planner's compute side is checked against
these. compute efficiency = (t1 / W) / t_rank, t1 the 1-GPU fwd+bwd call at the same length; above
--single-max tokens t1 is t1(single-max) x (seq / single-max)^2, the ratio of their FLOPs (the
kernels' TFLOP/s is flat past 32k tokens, bench/results/kernels.json). The all-to-all of a head
group is a device copy here, not an NVLink transfer: the planner adds link times.

Overhead rows (--overhead): a ring of --overhead-world ranks at short local lengths; per step,
(rank call - sum of its kernels alone) / (2 W), the kernels timed on the step's own shapes; eager
(the kernels called back to back), and with the rank's whole call captured in a CUDA graph and
replayed (the kernels replayed from graphs too; no host work per step: what is left is the GPU's
own cost of the step's extra passes and launches); and the
host's own time per step (the call until Python returns): where it exceeds the kernels' time the
ring is launch-bound, which a graph removes and nothing on the device can.
"""
import itertools
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from ringfa4 import backends, flops  # noqa: E402
from ringfa4.ring import heads, schedule, timeline  # noqa: E402
from ringfa4.ring.layout import nearest_length  # noqa: E402
from ringfa4.ring.simulate import Rank  # noqa: E402

from bench import measure  # noqa: E402

ALIGN = 128  # rows of a query tile: every chunk a whole number of them


def parse_args():
    p = measure.parser(__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="auto", help="cute, fa4, torch, or auto (cute on Hopper)")
    p.add_argument("--seqs", default="131072,1048576")
    p.add_argument("--heads", default="32:8,64:8", help="heads:kv_heads pairs")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--no-causal", dest="causal", action="store_false")
    p.add_argument("--worlds", default="8,16,32,64,72")
    p.add_argument("--max-head-group", type=int, default=8, help="largest U tried (the NVLink all-to-all domain)")
    p.add_argument("--ranks", default="first,last", help="ring ranks simulated: first, last or both")
    p.add_argument("--single-max", type=int, default=131072, help="longest 1-GPU call measured; longer ones scale")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--overhead", action="store_true", help="per-step overhead rows instead of efficiency rows")
    p.add_argument("--overhead-world", type=int, default=8)
    p.add_argument("--overhead-locals", default="512,1024,2048,4096", help="tokens per rank")
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args()
    measure.check_output_args(p, args, args.smoke)
    if args.smoke:
        args.backend, args.seqs, args.heads, args.head_dim, args.worlds = "torch", "768", "4:2", 32, "6"
        args.overhead_world, args.overhead_locals, args.single_max, args.rounds = 4, "128", 512, 1
    return args


def _device_dtype(smoke):
    return (torch.device("cpu"), torch.float32) if smoke else (torch.device("cuda"), torch.bfloat16)


def _backend(name, device, dtype, head_dim):
    probe = torch.empty(1, 128, 1, head_dim, device=device, dtype=dtype)
    if name != "auto":
        return backends.get(name)
    for candidate in backends.AUTO_ORDER:
        module = backends.get(candidate)
        if module.unsupported_reason(probe, probe, probe, True, True) is None:
            return module
    raise SystemExit("no backend runs here")


def _rank(module, seq, h, hk, d, causal, dtype, device, head_world, ring_world, rank):
    """A simulated rank of U x R over ``seq`` tokens (random inputs of the rank's heads)."""
    n, nk = h // head_world, max(1, hk // head_world)
    q, dout = (torch.randn(1, seq, n, d, device=device, dtype=dtype) for _ in range(2))
    k, v = (torch.randn(1, seq, nk, d, device=device, dtype=dtype) for _ in range(2))
    return Rank(module, q, k, v, dout, causal, d ** -0.5, rank, ring_world, "zigzag",
                head_world=head_world, seq_heads=(h, hk))


def _single_ms(module, seq, h, hk, d, causal, dtype, device, timer):
    q, dout = (torch.randn(1, seq, h, d, device=device, dtype=dtype) for _ in range(2))
    k, v = (torch.randn(1, seq, hk, d, device=device, dtype=dtype) for _ in range(2))

    def call():
        out, lse = module.forward(q, k, v, causal, d ** -0.5)
        module.backward(dout, q, k, v, out, lse, causal, d ** -0.5)
    return timer(call)[0]


def _step_spans(rank):
    """Median compute ms of the forward and backward steps of one recorded call (CUDA only)."""
    if not rank.q.is_cuda:
        return None, None
    with timeline.recording() as tl:
        rank()
    spans = tl.milliseconds()
    med = [sorted(ms for p, _, kind, ms in spans if p == phase and kind == "compute") for phase in ("fwd", "bwd")]
    return tuple(m[len(m) // 2] for m in med)


def head_groups(world, h, hk, largest):
    """The U of the efficiency rows: 1 and every U dividing W that splits these heads."""
    for u in range(1, min(world, largest, h) + 1):
        if world % u == 0 and heads.splits(h, hk, u):
            yield u


def efficiency_rows(args, module, device, dtype, rows):
    timer = measure.Timer(device, rounds=args.rounds, warmup=1)
    which = {"first": lambda r: 0, "last": lambda r: r - 1}
    for seq, pair in itertools.product(map(int, args.seqs.split(",")), args.heads.split(",")):
        h, hk = map(int, pair.split(":"))
        d = args.head_dim
        base = min(seq, args.single_max)
        t1_base = _single_ms(module, base, h, hk, d, args.causal, dtype, device, timer)
        for world in map(int, args.worlds.split(",")):
            for u in head_groups(world, h, hk, args.max_head_group):
                ring_world = world // u
                used = nearest_length(seq, ring_world, "zigzag", u, align=ALIGN)
                t1 = t1_base * (used / base) ** 2
                per_rank, graph_ms, graph_errors = {}, {}, []
                for r in sorted({which[name](ring_world) for name in args.ranks.split(",")}):
                    rank = _rank(module, used, h, hk, d, args.causal, dtype, device, u, ring_world, r)
                    per_rank[r] = (timer(rank)[0], _step_spans(rank))
                    if device.type == "cuda":
                        replay, error = measure.graphed(rank)
                        if replay is None:
                            graph_errors.append(f"rank {r}: {error}")
                        else:
                            graph_ms[str(r)] = timer(replay)[0]
                        del replay
                    del rank
                slowest = max(per_rank, key=lambda r: per_rank[r][0])
                t_rank, (fwd_step, bwd_step) = per_rank[slowest]
                graph = dict(graph_rank_ms=graph_ms or None, graph_error="; ".join(graph_errors) or None,
                             graph_efficiency=(t1 / world / max(graph_ms.values())
                                               if graph_ms and not graph_errors else None))
                rows.add(dict(measure.metadata(device, args.commit), kind="efficiency", backend=module.__name__,
                              seq=seq, seq_used=used, heads=h, kv_heads=hk, head_dim=d, causal=args.causal,
                              dtype=str(dtype).removeprefix("torch."),
                              world=world, head_world=u, ring_world=ring_world,
                              rank_ms={str(r): ms for r, (ms, _) in per_rank.items()}, slowest_rank=slowest,
                              rank_tflops=flops.attention(1, used, used, h, d, args.causal, "fwd+bwd") / world
                              / (t_rank * 1e9), fwd_step_ms=fwd_step, bwd_step_ms=bwd_step,
                              single_ms=t1, single_measured_at=base, efficiency=t1 / world / t_rank, **graph))


def _kernels_ms(rank, timer, graphs=False):
    """Sum over the rank's forward and backward steps of each step's kernel timed alone: called
    back to back, or (``graphs``, CUDA) replayed from CUDA graphs of GRAPH_CALLS calls each, the
    GPU's time alone, as a graphed ring call spends it (eager calls of short kernels are
    host-bound)."""
    module, q, (k, v), dout = rank.backend, rank.q, rank.blocks[rank.rank], rank.dout
    out, lse = module.forward(q, k, v, rank.causal, rank.scale)
    state = module.query_state(dout, q, out, lse, rank.scale,
                               schedule.row_chunk(rank.layout, rank.causal, q.shape[1]), False)
    shapes = {}
    for i in range(rank.world):
        s = schedule.plan(rank.rank, (rank.rank - i) % rank.world, rank.layout, rank.causal, q.shape[1])
        if s is not None:
            shapes[(s.q.start, s.q.stop, s.kv.start, s.kv.stop, s.causal)] = \
                shapes.get((s.q.start, s.q.stop, s.kv.start, s.kv.stop, s.causal), 0) + 1
    total = 0.0
    for (q0, q1, k0, k1, causal), count in shapes.items():
        rows, kv = slice(q0, q1), slice(k0, k1)

        def fwd():
            module.forward(q[:, rows], k[:, kv], v[:, kv], causal, rank.scale)

        def bwd():
            module.backward(dout[:, rows], q[:, rows], k[:, kv], v[:, kv], out[:, rows], lse[:, :, rows], causal,
                            rank.scale, dq=state.rows(rows))
        fns = (fwd, bwd) if not graphs else tuple(_graph_of_calls(fn) for fn in (fwd, bwd))
        total += count * sum(timer(*fns)) / (GRAPH_CALLS if graphs else 1)
    return total


GRAPH_CALLS = 10  # calls per graph: the replay's own launch is spread over them


def _graph_of_calls(fn):
    """The replay of a CUDA graph of GRAPH_CALLS calls of ``fn``."""
    def calls():
        for _ in range(GRAPH_CALLS):
            fn()
    replay, error = measure.graphed(calls)
    if error is not None:
        raise RuntimeError(f"cannot capture a step's kernel: {error}")
    return replay


def _host_ms(rank, device, calls=5):
    """Host time of the rank's call: from its start until Python returns (the device not awaited),
    the median of ``calls``. Above the device's time per call the ring is launch-bound."""
    times = []
    for _ in range(calls):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        rank()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def overhead_rows(args, module, device, dtype, rows):
    timer = measure.Timer(device, rounds=args.rounds, warmup=1, turn_ms=None if args.smoke else 200)
    world = args.overhead_world
    h, hk = map(int, args.heads.split(",")[0].split(":"))
    d = args.head_dim
    for local in map(int, args.overhead_locals.split(",")):
        rank = _rank(module, local * world, h, hk, d, args.causal, dtype, device, 1, world, 0)
        kernels = _kernels_ms(rank, timer)
        eager = timer(rank)[0]
        host = _host_ms(rank, device)
        replay, error = measure.graphed(rank) if device.type == "cuda" else (None, "CPU: no CUDA graph")
        graphed = timer(replay)[0] if replay else None
        gpu_kernels = _kernels_ms(rank, timer, graphs=True) if replay else None

        # Eager against the kernels called eagerly, the graph against the kernels replayed.
        def per_step(ms, alone):
            return None if ms is None else (ms - alone) / (2 * world) * 1e3
        rows.add(dict(measure.metadata(device, args.commit), kind="overhead", backend=module.__name__, world=world,
                      local=local, heads=h, kv_heads=hk, head_dim=d, causal=args.causal, kernels_ms=kernels,
                      graphed_kernels_ms=gpu_kernels, eager_ms=eager, graph_ms=graphed, graph_error=error,
                      host_us_per_step=host / (2 * world) * 1e3, eager_overhead_us_per_step=per_step(eager, kernels),
                      graph_overhead_us_per_step=per_step(graphed, gpu_kernels)))


def main():
    args = parse_args()
    device, dtype = _device_dtype(args.smoke)
    module = _backend(args.backend, device, dtype, args.head_dim)
    out = measure.output_dir(args)
    rows = measure.Rows(out / ("simulate_overhead.json" if args.overhead else "simulate.json"))
    (overhead_rows if args.overhead else efficiency_rows)(args, module, device, dtype, rows)


if __name__ == "__main__":
    main()
