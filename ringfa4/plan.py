"""Performance model of context-parallel attention: compute vs. link time per step for a topology,
for the ring alone and for heads x ring (U x R) splits, and the efficiency that follows
(python -m ringfa4.plan --help).

    python -m ringfa4.plan --preset gb200-nvl72 --heads 64 --kv-heads 8 --seq 1048576
    python -m ringfa4.plan --preset h200-x2 --heads 32 --kv-heads 8 --seq 32768 --worlds 2

The ring (zigzag layout, R ranks, local length L = S/R, each step's work taken from
ringfa4.ring.schedule for the first and the last rank, the two extremes):
  forward  step i computes its block while the next KV block (2*L*hk*d elements) travels;
  backward visits the blocks in reverse, starting on the forward's last block and ending on the local
           one: step j computes while the next block (for j + 2 < R) and the previous step's dK/dV sums
           (j >= 1; fp32 for R > 2) travel, on one NCCL stream, so their times add. Nothing is exposed.
  A step costs max(compute, transfer); all ranks step together, so every hop runs at the slowest
  link's speed (InfiniBand once the U x R ranks exceed the NVLink domain).
A step's compute = its kernel + the memory-bound passes the ring runs inside it (merge, dq add, start
of the dK/dV sums; their bytes at the GPU's HBM bandwidth) + a fixed per-step overhead. The passes
outside the steps (casts, zeroing, later dK/dV sums) add their bytes once.
Heads x ring (ringfa4.ring.heads): a head group of U consecutive ranks trades sequence for heads by
all-to-alls (q, k, v, out forward; dout, dq, dk, dv backward), exposed, over NVLink when U fits the
domain (at the all-to-all's own fit where the calibration has one: bench/ring.py U x 1 rows), each
also packing and unpacking its tensor in HBM; the ring then runs over R = W/U ranks on
h/U heads (kv heads split, or one each when U exceeds them) of S/R tokens per rank. R = 1 is one
call per rank on the whole sequence. efficiency = t(1 GPU) / (W * t(rank)).
Kernel time = FLOPs (ringfa4.flops) / TFLOP/s of the backend at the step's own loop length (keys per
query tile forward, queries per key tile backward, times the GQA heads a cute backward CTA walks;
log-interpolated, clamped); link time = latency + bytes / bandwidth.

Per-step overhead: eager, or (--graphed) with each rank's ring call captured whole in a CUDA graph,
which issues no step from the host.
Measured numbers come from the calibration files shipped in ringfa4/data (one per GPU, format
CALIBRATION_FORMAT; --calibration names another), and every printed number says which file or which
assumption it comes from. ``--refit`` writes such a file from explicit bench JSON files.
"""
import argparse
import itertools
import json
import math
import statistics
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path

from ringfa4 import flops
from ringfa4.ring import balance, heads, schedule
from ringfa4.ring.layout import nearest_length, required_multiple

MiB = 1 << 20
CALIBRATION_FORMAT = 1
CALIBRATED_GPUS = ("H200", "H100")
# Assumptions (no measurement lent), labelled as such wherever they are printed: FA4 is reported at
# ~1600 TFLOP/s forward on B200 against ~650 measured on Hopper, so Blackwell's curves are the H200's
# times this factor (--tflops-scale overrides); NVLink 5 keeps NVLink 4's measured fraction of its
# nominal rate (900 against 450 GB/s per direction); NCCL over one 400 Gb/s NIC per GPU reaches ~90%
# of 50 GB/s; the ring's memory-bound passes reach 80% of nominal HBM bandwidth.
BLACKWELL_OVER_HOPPER = 2.4
NVLINK4_NOMINAL_GBPS = 450.0
NVLINK5_NOMINAL_GBPS = 900.0
IB_400G = dict(gbps=0.9 * 50.0, latency_ms=0.03)
HBM_EFFICIENCY = 0.8
ALIGN = 128  # rows of a query tile: a suggested length gives every chunk whole tiles


@dataclass(frozen=True)
class Link:
    name: str
    gbps: float  # asymptotic GB/s per direction per GPU
    latency_ms: float
    source: str

    def ms(self, nbytes):
        return self.latency_ms + nbytes / (self.gbps * 1e9) * 1e3


FREE_LINK = Link("none", math.inf, 0.0, "compute only: transfers cost nothing")


@dataclass(frozen=True)
class Gpu:
    name: str
    hbm_gbps: float  # nominal
    tflops: dict  # {(direction, causal): ((seq, TFLOP/s), ...)}
    source: str
    sms: int = 132  # Hopper's; where a kernel splits work by the SMs it fills (cute's backward heads)

    def kernel_tflops(self, direction, causal, seq):
        """TFLOP/s at this call length: log-linear interpolation, clamped to the measured range."""
        points = self.tflops[(direction, causal)]
        if seq <= points[0][0]:
            return points[0][1]
        for (s0, t0), (s1, t1) in zip(points, points[1:]):
            if seq <= s1:
                f = math.log(seq / s0) / math.log(s1 / s0)
                return t0 + f * (t1 - t0)
        return points[-1][1]


@dataclass(frozen=True)
class Topology:
    name: str
    description: str
    gpu: Gpu
    domain: int  # GPUs in one NVLink domain
    nvlink: Link
    network: Link  # between domains
    backend: str = "fa4"  # whose kernels: "fa4" (upstream) or "cute" (ours)
    step_overhead_ms: tuple = (0.0, 0.0)  # (forward, backward) per ring step, beyond kernel and memory passes
    overhead_source: str = "none assumed"
    # The host's time to issue one ring step (launches, Python): a step whose kernels are shorter
    # waits for the host, so short chunks are launch-bound whatever their FLOPs
    step_host_ms: float = 0.0
    # (forward, backward) kernel time of the calibration run per kernel-row ms: the fitted slope,
    # applied to the ring's steps and the 1-GPU call alike (it cancels in the efficiency)
    kernel_scale: tuple = (1.0, 1.0)
    checks: tuple = ()  # measured rows (ring and simulated) of this GPU to print beside the model
    # The per-step overhead of a ring captured in a CUDA graph, for the simulated rows replayed
    # from one (the checks of the compute side without the host's time to issue each step)
    graph_step_overhead_ms: "float | None" = None
    # The head group's all-to-alls within the domain, when measured apart from the ring's transfers
    # (one exchange among all members costs a different fixed time than a ring's send/recv pair)
    all_to_all: "Link | None" = None

    def link(self, world):
        return self.nvlink if world <= self.domain else self.network

    def a2a_link(self, head_world):
        return (self.all_to_all or self.nvlink) if head_world <= self.domain else self.network


# ---------------------------------------------------------------- calibration files


def calibration_path(gpu):
    """The calibration file shipped for ``gpu`` (one of CALIBRATED_GPUS)."""
    return resources.files("ringfa4") / "data" / f"calibration-{gpu.lower()}.json"


def load_calibration(path):
    """The calibration dict of a file (a path or a package resource), its name under "_file"."""
    path = Path(path) if isinstance(path, str) else path
    data = json.loads(path.read_text())
    if data.get("format") != CALIBRATION_FORMAT:
        raise ValueError(f"{path}: calibration format {data.get('format')!r}, this planner reads {CALIBRATION_FORMAT}")
    return dict(data, _file=str(path))


def _curves(table):
    """{"fwd/causal": [[seq, tflops], ...]} -> {("fwd", True): ((seq, tflops), ...)}."""
    return {(k.split("/")[0], k.split("/")[1] == "causal"): tuple(map(tuple, v)) for k, v in table.items()}


def _gpu_and_link(cal, backend):
    f = cal["_file"]
    kernels = cal["kernels"][backend]
    gpu = Gpu(cal["gpu"], cal["hbm_gbps"], _curves(kernels["tflops"]), f"{kernels['source']} [{f}]")
    nv = cal["nvlink"]
    return gpu, Link(nv["name"], nv["gbps"], nv["latency_ms"], f"{nv['source']} [{f}]")


def _all_to_all(cal, scale=1.0, assumed=None, name=None):
    """The all-to-all link fitted in ``cal`` (bandwidth times ``scale``; ``assumed`` labels a
    transfer to another fabric, ``name`` names it), or None where the file has none."""
    a2a = cal.get("nvlink_all_to_all")
    if a2a is None:
        return None
    source = f"{a2a['source']} [{cal['_file']}]"
    return Link(name or a2a["name"], a2a["gbps"] * scale, a2a["latency_ms"],
                f"assumed: {assumed} ({source})" if assumed else source)


def _overhead(cal, backend):
    """Topology fields of the per-step overhead fitted for ``backend`` in ``cal``, or None."""
    step = cal["step_overhead"].get(backend)
    if step is None:
        return None
    return dict(step_overhead_ms=tuple(step["ms"]), kernel_scale=tuple(step["kernel_scale"]),
                step_host_ms=step.get("host_ms", 0.0), overhead_source=f"{step['source']} [{cal['_file']}]")


def _graph_overhead(cal, backend):
    """Topology fields of the per-step overhead with the ring captured whole in a CUDA graph
    (measured for ``backend`` in ``cal``), or None: the graph issues no step from the host."""
    step = cal.get("step_overhead_graph", {}).get(backend)
    if step is None:
        return None
    return dict(step_overhead_ms=(step["ms"], step["ms"]), kernel_scale=(1.0, 1.0), step_host_ms=0.0,
                overhead_source=f"{step['source']} [{cal['_file']}]")


def _assumed(own, measured):
    """A GPU's own overhead, else the measured one's (without its run-specific kernel slope)."""
    if own is not None:
        return own
    if measured is None:
        return dict(overhead_source="not measured: none assumed")
    return dict(step_overhead_ms=measured["step_overhead_ms"], step_host_ms=measured["step_host_ms"],
                overhead_source=f"assumed as on H200: "
                f"{measured['overhead_source']}")


def presets(backend="fa4", calibrations=None, graphed=False):
    """The modelled topologies, from the calibration files (``calibrations``: {gpu: dict}, default
    the shipped ones) and the labelled assumptions. ``graphed``: each rank's ring call captured
    whole in a CUDA graph and replayed (torch.cuda.make_graphed_callables; README), with its own
    measured per-step overhead."""
    cals = calibrations or {g: load_calibration(calibration_path(g)) for g in CALIBRATED_GPUS}
    ib = Link("InfiniBand 400 Gb/s", IB_400G["gbps"], IB_400G["latency_ms"], "assumed: 90% of 50 GB/s per NIC")
    h200, nv4 = _gpu_and_link(cals["H200"], backend)
    h100, nv4_h100 = _gpu_and_link(cals["H100"], backend)
    ex = cals["H200"]["nvlink_exchange"]
    nv5 = Link("NVLink5", ex["gbps"] * NVLINK5_NOMINAL_GBPS / NVLINK4_NOMINAL_GBPS, ex["latency_ms"],
               f"assumed: NVLink4's {ex['gbps'] / NVLINK4_NOMINAL_GBPS:.0%} of nominal in the {ex['source']} "
               f"[{cals['H200']['_file']}], of 900 GB/s")
    gb200 = Gpu("GB200", 8000.0, {k: tuple((s, t * BLACKWELL_OVER_HOPPER) for s, t in v) for k, v in h200.tflops.items()},
                f"assumed: the H200 curves x {BLACKWELL_OVER_HOPPER} ({h200.source})", sms=148)
    overhead = _graph_overhead if graphed else _overhead
    measured = overhead(cals["H200"], backend)
    if graphed and measured is None:
        raise ValueError(f"{cals['H200']['_file']} has no per-step overhead of a CUDA-graphed ring for backend "
                         f"{backend!r} (bench/ring.py --overhead rows, then --refit)")
    on_h200 = _assumed(measured, None)
    graph_h200 = _graph_overhead(cals["H200"], backend)
    on_h100 = _assumed(overhead(cals["H100"], backend), measured)
    checks = tuple(dict(r, _file=cals["H200"]["_file"]) for r in cals["H200"].get("checks", ())
                   if r.get("backend") == backend)
    a2a = _all_to_all(cals["H200"])
    a2a_h100 = _all_to_all(cals["H100"]) or _all_to_all(cals["H200"], assumed="as on 2 x H200")
    a2a_nv5 = _all_to_all(cals["H200"], NVLINK5_NOMINAL_GBPS / NVLINK4_NOMINAL_GBPS,
                          assumed="the 2 x H200 fit with NVLink5's bandwidth (x2)", name="NVLink5 all-to-all")
    return {
        "h200-x2": Topology("h200-x2", "2 x H200 on NVLink (the lent machine); more GPUs across IB 400G",
                            h200, 2, nv4, ib, backend, checks=checks, all_to_all=a2a,
                            graph_step_overhead_ms=graph_h200 and graph_h200["step_overhead_ms"][0], **on_h200),
        "h100-node": Topology("h100-node", "8 x H100 on NVLink (one HGX node); more GPUs across IB 400G",
                              h100, 8, nv4_h100, ib, backend, all_to_all=a2a_h100, **on_h100),
        "gb200-nvl72": Topology("gb200-nvl72", "72 x GB200 in one NVLink domain (900 GB/s per direction per GPU); "
                                "144+ across racks over IB 400G", gb200, 72, nv5, ib, backend, all_to_all=a2a_nv5,
                                **_assumed(None, measured)),
        "ib-400g": Topology("ib-400g", "H100 ranks on different nodes: every hop over InfiniBand 400 Gb/s per GPU",
                            h100, 1, nv4_h100, ib, backend, **on_h100),
    }


@dataclass(frozen=True)
class Shape:
    heads: int
    kv_heads: int
    head_dim: int
    seq: int
    causal: bool
    elem: int  # bytes per q/k/v element


def _loop(topo, shape, direction, sq, sk, causal):
    """The length of each CTA's loop, what sets a kernel's efficiency in the kernel rows (they vary
    only that; their CTA count is fixed): a forward CTA loops over the keys of one query tile, a
    backward CTA over the queries of one key tile, and in cute's backward over those of every query
    head of the GQA group it walks (the kernel rows have one query head per kv head)."""
    if direction == "fwd":
        return sk
    if topo.backend != "cute":
        return sq
    from ringfa4.backends.cute.interface import head_splits

    group = shape.heads // shape.kv_heads
    splits = head_splits(1, sq, sk, shape.heads, shape.kv_heads, shape.head_dim, causal, False, topo.gpu.sms)
    return sq * group // splits


def _kernel_ms(topo, shape, direction, sq, sk, causal):
    work = flops.attention(1, sq, sk, shape.heads, shape.head_dim, causal, direction)
    loop = _loop(topo, shape, direction, sq, sk, causal)
    return work / (topo.gpu.kernel_tflops(direction, causal, loop) * 1e12) * 1e3


def _hbm_ms(gpu, nbytes):
    return nbytes / (gpu.hbm_gbps * HBM_EFFICIENCY * 1e9) * 1e3


def _rank_steps(shape, world, rank):
    """(sq, sk, causal) of each forward step of ``rank``, from the ring's own zigzag schedule (step 0 is
    the local block; the backward visits the same blocks in reverse order)."""
    local = shape.seq // world
    steps = [schedule.plan(rank, (rank - i) % world, "zigzag", shape.causal, local) for i in range(world)]
    return [(s.q.stop - s.q.start, s.kv.stop - s.kv.start, s.causal) for s in steps]


def _memory_bytes(shape, world, steps, dq_adds):
    """Bytes read + written by the memory-bound passes of ring/attention.py for one rank's forward
    steps: (inside each forward step, inside each backward step, outside the steps).

    Partial sums live in the input dtype for W = 2 and in fp32 otherwise (ring.attention._sum_dtype);
    dq_adds: the backend adds a fresh dq into the ring's fp32 one (fa4) instead of accumulating in
    its kernel (cute: one fragment-order accumulator per call, ringfa4.kernels.bwd_sm90.QueryState)."""
    h, hk, d, e = shape.heads, shape.kv_heads, shape.head_dim, shape.elem
    L = steps[0][0]
    a = e if world == 2 else 4
    cast = 0 if a == e else e + a  # bytes per element of a cast between the two dtypes
    q_el, kv_el = L * h * d, 2 * L * hk * d
    summed = a + e + a  # per element of a sum: partial and step term in, sum out
    fwd = [q_el * cast] + [sq * h * d * summed for sq, _, _ in steps[1:]]  # step-0 output into the sum dtype; merges
    bwd = [sq * h * d * (4 + e + 4) if dq_adds else 0 for sq, _, _ in reversed(steps)]  # dq += step gradient
    first_sk = steps[-1][1]  # the backward starts on the forward's last block: its dK/dV sums start there
    bwd[0] += kv_el * cast if first_sk == L else kv_el * a + first_sk * 2 * hk * d * summed
    outside = (q_el * cast  # output cast
               + q_el * 4 + q_el * (4 + e)  # fp32 dq (fa4) or accumulator (cute): zeros, final cast or postprocess
               + sum(sk for _, sk, _ in steps[:-1]) * 2 * hk * d * summed  # dK/dV sums of later steps, after their wait
               + kv_el * cast)  # dK/dV cast
    return fwd, bwd, outside


def _rank_ms(topo, shape, world, steps):
    """Compute-stream ms of each forward and backward step of one rank, and of the passes outside them."""
    gpu = topo.gpu
    fwd_bytes, bwd_bytes, outside = _memory_bytes(shape, world, steps, topo.backend != "cute")
    over_f, over_b = topo.step_overhead_ms
    scale_f, scale_b = topo.kernel_scale
    host = topo.step_host_ms
    fwd = [max(host, scale_f * _kernel_ms(topo, shape, "fwd", *s) + _hbm_ms(gpu, n) + over_f)
           for s, n in zip(steps, fwd_bytes)]
    bwd = [max(host, scale_b * _kernel_ms(topo, shape, "bwd", *s) + _hbm_ms(gpu, n) + over_b)
           for s, n in zip(reversed(steps), bwd_bytes)]
    return fwd, bwd, _hbm_ms(gpu, outside)


@dataclass
class Prediction:
    world: int
    local: int
    link: Link
    fwd_compute: list  # ms per step, of the slowest rank
    bwd_compute: list
    fwd_transfer: list  # ms of the transfers in flight during each step
    bwd_transfer: list
    kv_ms: float
    dkv_ms: float
    extra_ms: float  # memory-bound passes outside the steps
    ring_ms: float
    single_ms: float
    hidden: bool  # every rank's compute covers the transfers of each of its steps

    @property
    def efficiency(self):
        return self.single_ms / (self.world * self.ring_ms)


def single_ms(topo, shape):
    s = shape.seq
    return sum(scale * _kernel_ms(topo, shape, d, s, s, shape.causal)
               for d, scale in zip(("fwd", "bwd"), topo.kernel_scale))


def predict(topo, shape, world, link=None):
    """Time of one fwd+bwd ring call on the slowest rank, step by step (hops over ``link``, default
    the topology's link for ``world`` GPUs)."""
    if world < 2:
        raise ValueError(f"world must be >= 2, got {world}")
    L, hk, d, e = shape.seq // world, shape.kv_heads, shape.head_dim, shape.elem
    link = link or topo.link(world)
    kv = link.ms(2 * L * hk * d * e)
    dkv = link.ms(2 * L * hk * d * (e if world == 2 else 4))
    fwd_transfer = [kv] * (world - 1) + [0.0]
    bwd_transfer = [(kv if j + 2 < world else 0.0) + (dkv if j >= 1 else 0.0) for j in range(world)]
    transfers = fwd_transfer + bwd_transfer
    overhead = [topo.step_overhead_ms[0]] * world + [topo.step_overhead_ms[1]] * world
    # Zigzag: the first rank's remote steps are all (L/2 queries, L keys), the last rank's all
    # (L, L/2); every other rank mixes the two, so its time lies between theirs.
    ranks = []
    for rank in sorted({0, world - 1}):
        fwd, bwd, extra = _rank_ms(topo, shape, world, _rank_steps(shape, world, rank))
        ring = sum(max(c, t) for c, t in zip(fwd + bwd, transfers)) + extra
        # A transfer is hidden when the step's work covers it: the fixed overhead does not grow with
        # the chunk, and counting on it would call tiny chunks "hidden".
        hidden = all(c - o >= t for c, o, t in zip(fwd + bwd, overhead, transfers))
        ranks.append((ring, fwd, bwd, extra, hidden))
    ring, fwd, bwd, extra, _ = max(ranks, key=lambda r: r[0])
    return Prediction(world, L, link, fwd, bwd, fwd_transfer, bwd_transfer, kv, dkv, extra, ring,
                      single_ms(topo, shape), all(r[4] for r in ranks))


def hiding_chunk(topo, shape, world):
    """Smallest local length (multiple of 2*128 tokens) at which every step's compute covers its transfers."""
    def hidden(L):
        return predict(topo, replace(shape, seq=L * world), world).hidden
    step = 256
    hi = step
    while not hidden(hi):
        hi *= 2
        if hi > 1 << 26:
            return None
    lo = hi // 2
    while hi - lo > step:
        mid = (lo + hi) // 2 // step * step
        if mid <= lo:
            break
        lo, hi = (lo, mid) if hidden(mid) else (mid, hi)
    return hi


# ---------------------------------------------------------------- heads x ring


@dataclass
class Split:
    head_world: int  # U
    ring_world: int  # R
    seq: int  # the length modelled: the asked one, or the nearest that splits over U x R
    ring: "Prediction | None"  # the ring over R (None for R = 1)
    local_ms: float  # R = 1: the rank's one call on the whole sequence
    a2a_ms: float  # all-to-alls, exposed, with their packing
    single_ms: float

    @property
    def world(self):
        return self.head_world * self.ring_world

    @property
    def rank_ms(self):
        return (self.ring.ring_ms if self.ring else self.local_ms) + self.a2a_ms

    @property
    def efficiency(self):
        return self.single_ms / (self.world * self.rank_ms)


def _a2a_traffic(shape, head_world, ring_world):
    """(bytes sent, bytes packed) of each of the rank's all-to-alls in one fwd+bwd call: q, k, v, out
    forward, dout, dq, dk, dv backward (lse's is a few bytes). Of its L = S/(U*R) rows, each sends
    what the U-1 other members' heads need (a kv head read by several members goes to each) and
    packs and unpacks the whole exchange in HBM (two copies: read + write each)."""
    L, u, d, e = shape.seq // (head_world * ring_world), head_world, shape.head_dim, shape.elem
    per_member = {"q": shape.heads // u, "kv": max(1, shape.kv_heads // u)}
    return [((u - 1) * L * per_member[name] * d * e, 4 * u * L * per_member[name] * d * e)
            for name in ("q", "kv", "kv", "q") * 2]


def _a2a_ms(topo, shape, head_world, ring_world, link):
    return sum(link.ms(sent) + _hbm_ms(topo.gpu, packed) for sent, packed in _a2a_traffic(shape, head_world, ring_world))


def predict_split(topo, shape, head_world, ring_world, links=True):
    """A fwd+bwd call on U x R ranks (``links=False``: transfers free, the compute of the simulator)."""
    world = head_world * ring_world
    seq = shape.seq
    if seq % (required_multiple(ring_world, "zigzag", head_world) * ALIGN):
        seq = nearest_length(seq, ring_world, "zigzag", head_world, align=ALIGN)
    full = replace(shape, seq=seq)
    mine = replace(full, heads=shape.heads // head_world, kv_heads=max(1, shape.kv_heads // head_world))
    a2a = FREE_LINK if not links else topo.a2a_link(head_world)
    ring_link = FREE_LINK if not links else topo.link(world)
    a2a_ms = _a2a_ms(topo, full, head_world, ring_world, a2a) if head_world > 1 else 0.0
    ring = predict(topo, mine, ring_world, ring_link) if ring_world > 1 else None
    local = single_ms(topo, mine) if ring_world == 1 else 0.0
    return Split(head_world, ring_world, seq, ring, local, a2a_ms, single_ms(topo, full))


def splits(topo, shape, world, max_head_group=None):
    """Every U x R = world whose head group fits the heads and the NVLink domain (and, given,
    ``max_head_group``)."""
    largest = min(max_head_group or topo.domain, max(topo.domain, 1))
    return [predict_split(topo, shape, u, world // u) for u in range(1, largest + 1)
            if world % u == 0 and heads.splits(shape.heads, shape.kv_heads, u)]


# ---------------------------------------------------------------- refitting a calibration file


def _rows(paths):
    """Every row of the given bench JSON files (lists of dicts), each with its file under "_file"."""
    rows = []
    for path in paths:
        data = json.loads(Path(path).read_text())
        if not isinstance(data, list):
            raise ValueError(f"{path}: expected a JSON list of bench rows")
        rows += [dict(r, _file=Path(path).name) for r in data if isinstance(r, dict)]
    return rows


def _envelope(points):
    """Best TFLOP/s at or below each length, one point per length. The kernel rows hold the CTA
    count fixed, so a longer loop can only amortise more; a lower reading at a longer length is run
    noise, and noise only ever slows a kernel."""
    best, out = 0.0, {}
    for s, t in sorted(points):
        best = max(best, t)
        out[s] = best
    return [[s, t] for s, t in out.items()]


def _bare(cal, backend):
    gpu, nvlink = _gpu_and_link(cal, backend)
    return Topology(cal["gpu"], "refit", gpu, 2, nvlink, FREE_LINK, backend)


def fit_link(name, points, source):
    """Least-squares latency + bytes/bandwidth through (bytes, ms) points."""
    n = len(points)
    mx = sum(b for b, _ in points) / n
    my = sum(t for _, t in points) / n
    sxx = sum((b - mx) ** 2 for b, _ in points)
    if n < 2 or sxx == 0:
        b, t = points[0]
        return Link(name, b / (t * 1e-3) / 1e9, 0.0, source)
    slope = sum((b - mx) * (t - my) for b, t in points) / sxx  # ms per byte
    latency = max(0.0, my - slope * mx)
    return Link(name, 1e3 / slope / 1e9 if slope > 0 else float("inf"), latency, source)


def fit_all_to_all(gpu, hbm_gbps, rows):
    """Latency + bytes/bandwidth of one all-to-all, from bench/ring.py rows of U x 1 splits (pure
    head parallelism, no ring): the rank's time beyond its attention, with that attention taken as
    the measured 1-GPU call's 1/U (the same kernels on 1/U of the heads), minus the packing's HBM
    time, is its 8 exchanges' time; a line through (bytes sent, that time) over the rows."""
    hbm = Gpu(gpu, hbm_gbps, {}, "")
    points = []
    for r in rows:
        traffic = _a2a_traffic(_row_shape(r), r["head_world"], 1)
        exposed = r["ringfa4_ms"] - r["single_ms"] / r["head_world"] - sum(_hbm_ms(hbm, p) for _, p in traffic)
        points.append((sum(sent for sent, _ in traffic), exposed))
    line = fit_link("", points, "")
    return Link("", line.gbps, line.latency_ms / 8, f"fit to {len(points)} U x 1 rows of bench/ring.py on "
                f"{rows[0]['world']} GPUs: the call's time beyond the 1-GPU call's 1/U, less the packing")


def fit_step_overhead(topo, rows):
    """((forward, backward) overhead ms, (forward, backward) slope, number of steps) from the rows'
    per-step timelines: a robust line, measured = overhead + slope * model, through every rank's
    steps, the model being this one's kernel + memory time for the step.

    The intercept is what a ring step costs beyond its work and what the kernel rows (back-to-back
    calls of one kernel) cannot see: launch gaps between a step's ops, allocation, NCCL kernels
    sharing the SMs. The slope says how fast this run's kernels ran against the kernel rows (another
    run, maybe another machine; the two GPUs of one run differ by up to 11% on identical steps). The
    two belong together: an intercept used without its slope is off by (slope - 1) x the step, which
    at 150 ms backward steps and a slope of 1.03 turned it negative (-0.4 ms per step at ec5cf12)."""
    bare = replace(topo, step_overhead_ms=(0.0, 0.0), kernel_scale=(1.0, 1.0))
    points = ([], [])
    for r in rows:
        shape, world = _row_shape(r), r["world"]
        for rank, spans in enumerate(r["step_ms_by_rank"]):
            fwd, bwd, _ = _rank_ms(bare, shape, world, _rank_steps(shape, world, rank))
            points[0].extend(zip(fwd, spans["fwd_compute"]))
            points[1].extend(zip(bwd, spans["bwd_compute"]))
    lines = [_theil_sen(p) for p in points]
    # A step cannot cost less than its work: a negative intercept says the model's kernel times are
    # off by step length (the kernel rows' CTA counts are not the ring's), not that steps save time.
    return tuple(max(0.0, c) for c, _ in lines), tuple(s for _, s in lines), sum(map(len, points))


def _theil_sen(points):
    """(intercept, slope) of the Theil-Sen line through (x, y) points: medians of the pairwise slopes
    and of the intercepts they leave, so a minority of noisy steps cannot move it. Slope 1 when all
    x are equal (one step shape: only the gap is known)."""
    slopes = [(y1 - y0) / (x1 - x0) for (x0, y0), (x1, y1) in itertools.combinations(points, 2) if x1 != x0]
    slope = statistics.median(slopes) if slopes else 1.0
    return statistics.median(y - slope * x for x, y in points), slope


def refit(base, paths):
    """``base`` (a calibration dict) with what the bench rows of ``paths`` measure on its GPU put in:
    kernel curves (bench/kernels.py rows), the NVLink fit (bench/ring.py forward KV transfers), the
    per-step overhead (bench/ring.py timelines against this model; bench/simulate.py --overhead;
    bench/ring.py --overhead for a ring captured in a CUDA graph) and the rows to check against
    (bench/ring.py efficiency rows, bench/simulate.py efficiency rows)."""
    rows = [r for r in _rows(paths) if base["gpu"] in str(r.get("device", ""))]
    cal = json.loads(json.dumps({k: v for k, v in base.items() if k != "_file"}))
    for backend, key in (("fa4", "fa4_tflops"), ("cute", "ringfa4_tflops")):
        kernels = [r for r in rows if r.get(key) and r.get("hdim") == 128 and "direction" in r]
        fitted = []
        for direction, causal in itertools.product(("fwd", "bwd"), (False, True)):
            pts = {(r["seq"], r[key]) for r in kernels if (r["direction"], r["causal"]) == (direction, causal)}
            if pts:
                fitted.append(f"{direction}/{'causal' if causal else 'full'}")
                cal["kernels"][backend]["tflops"][fitted[-1]] = _envelope(pts)
        if fitted:
            files = ", ".join(sorted({r["_file"] for r in kernels}))
            rest = "" if len(fitted) == 4 else f"; the other curves: {cal['kernels'][backend]['source']}"
            cal["kernels"][backend]["source"] = (f"{', '.join(fitted)}: {backend} kernels measured by bench/kernels.py "
                                                 f"({files}), the best reading at or below each length{rest}")
    transfers = [(r["kv_bytes_per_step"], ms) for r in rows if r.get("kv_bytes_per_step") and r.get("head_world", 1) == 1
                 for ms in r.get("step_ms", {}).get("fwd_kv", [])]
    if transfers:
        link = fit_link(cal["nvlink"]["name"], transfers, "")
        cal["nvlink"].update(gbps=link.gbps, latency_ms=link.latency_ms, source=f"fit to {len(transfers)} "
                             f"forward KV transfers of bench/ring.py on 2 GPUs")
    for backend in ("fa4", "cute"):
        timelines = [r for r in rows if r.get("backend") == backend and r.get("step_ms_by_rank")
                     and r.get("head_world", 1) == 1]
        if timelines:
            overhead, slope, n = fit_step_overhead(_bare(dict(cal, _file=""), backend), timelines)
            cal["step_overhead"][backend] = dict(ms=list(overhead), kernel_scale=list(slope), source=(
                f"intercept of a Theil-Sen line through {n} step compute spans of bench/ring.py against this "
                f"model's kernel + memory time; its slopes {slope[0]:.3f} / {slope[1]:.3f} (that run's kernels "
                f"vs the kernel rows) scale the kernel times of the ring and the 1-GPU call"))
    heads_only = [r for r in rows if r.get("head_world", 1) > 1 and r.get("ring_world") == 1 and "ringfa4_ms" in r]
    if heads_only:
        link = fit_all_to_all(cal["gpu"], cal["hbm_gbps"], heads_only)
        cal["nvlink_all_to_all"] = dict(name=f"{cal['nvlink']['name']} all-to-all", gbps=link.gbps,
                                        latency_ms=link.latency_ms, source=link.source)
    for backend in ("fa4", "cute"):
        measured = [r for r in rows if r.get("kind") == "overhead" and _backend_name(r["backend"]) == backend
                    and r.get("eager_overhead_us_per_step") is not None]
        if measured:
            us = statistics.median(r["eager_overhead_us_per_step"] for r in measured)
            host_us = statistics.median(r["host_us_per_step"] for r in measured)
            locals_ = ", ".join(str(r["local"]) for r in measured)
            cal["step_overhead"][backend] = dict(
                ms=[us / 1e3, us / 1e3], kernel_scale=[1.0, 1.0], host_ms=host_us / 1e3, source=(
                    f"bench/simulate.py --overhead: one rank's ring call minus its steps' kernels timed alone, "
                    f"per step, and the host's time to issue a step ({host_us:.0f} us, a floor under every step), "
                    f"medians over local lengths {locals_} at W={measured[0]['world']}"))
    for backend in ("fa4", "cute"):
        graphed = [r for r in rows if r.get("kind") == "overhead_nccl" and _backend_name(r["backend"]) == backend
                   and r.get("graph_overhead_us_per_step") is not None]
        if graphed:
            us = sorted(r["graph_overhead_us_per_step"] for r in graphed)
            locals_ = ", ".join(str(r["local"]) for r in graphed)
            cal.setdefault("step_overhead_graph", {})[backend] = dict(
                ms=max(0.0, statistics.median(us)) / 1e3, source=(
                    f"bench/ring.py --overhead: the ring call, NCCL included, captured in one CUDA graph and "
                    f"replayed, minus its kernels timed alone, per step; median over local lengths {locals_} at "
                    f"W={graphed[0]['world']} (readings {us[0]:.0f} to {us[-1]:.0f} us)"))
    checks = [_check_row(r) for r in rows if r.get("efficiency") and ("ringfa4_ms" in r or r.get("kind") == "efficiency")]
    if checks:  # a case measured again replaces its older rows (the kernels under it may have changed)
        newest = {_check_case(c): c for c in checks}
        cal["checks"] = [c for c in cal.get("checks", []) if _check_case(c) not in newest] + list(newest.values())
    return cal


def _check_case(row):
    """What a check row measured, without the measurement."""
    return tuple((k, row.get(k)) for k in ("kind",) + CHECK_FIELDS if k not in MEASURED_FIELDS)


def _backend_name(name):
    """bench rows name a backend ("cute") or its module ("ringfa4.backends.cute")."""
    return name.rsplit(".", 1)[-1]


CHECK_FIELDS = ("backend", "seq", "heads", "kv_heads", "head_dim", "causal", "dtype", "world", "efficiency",
                "ringfa4_ms", "single_ms", "head_world", "ring_world", "rank_ms", "seq_used", "graph_rank_ms",
                "graph_efficiency")
MEASURED_FIELDS = ("efficiency", "ringfa4_ms", "single_ms", "rank_ms", "graph_rank_ms", "graph_efficiency")


def _check_row(r):
    row = {k: r[k] for k in CHECK_FIELDS if r.get(k) is not None}
    if r.get("kind") == "efficiency":  # bench/simulate.py: the backend is a module name
        row.update(kind="simulated", backend=_backend_name(r["backend"]))
    else:
        row["kind"] = "ring"
    return row


# ---------------------------------------------------------------- command line

WORLDS = (2, 4, 8, 16, 32, 64, 72, 144, 288, 576)
DTYPE_BYTES = {"bf16": 2, "fp16": 2}
ROW_DTYPE_BYTES = {"bfloat16": 2, "float16": 2}  # torch dtype names in bench rows


def _row_shape(r):
    return Shape(r["heads"], r["kv_heads"], r["head_dim"], r["seq"], r["causal"], ROW_DTYPE_BYTES[r["dtype"]])


def _err(predicted, measured):
    return f"{predicted / measured - 1:+6.1%}"


def _header(topo, shape):
    g, nv, net = topo.gpu, topo.nvlink, topo.network
    return [f"== {topo.name}: {topo.description}",
            f"   kernel TFLOP/s ({topo.backend}): {g.source}",
            f"   {nv.name}: {nv.gbps:.0f} GB/s + {nv.latency_ms * 1e3:.0f} us per transfer ({nv.source})",
            f"   {net.name}: {net.gbps:.0f} GB/s + {net.latency_ms * 1e3:.0f} us per transfer ({net.source})",
            *([] if topo.all_to_all is None else [
                f"   {topo.all_to_all.name}: {topo.all_to_all.gbps:.0f} GB/s + {topo.all_to_all.latency_ms * 1e3:.0f} us "
                f"per exchange ({topo.all_to_all.source})"]),
            f"   HBM {g.hbm_gbps:.0f} GB/s nominal, assumed {HBM_EFFICIENCY:.0%} reached by the memory-bound passes",
            f"   per ring step overhead {topo.step_overhead_ms[0]:.3f} ms forward, {topo.step_overhead_ms[1]:.3f} ms "
            f"backward, no step shorter than the host's {topo.step_host_ms:.3f} ms to issue it "
            f"({topo.overhead_source}); not charged to the 1-GPU call: the kernel rows time whole calls",
            f"   {'causal' if shape.causal else 'full'} attention, seq {shape.seq}, heads {shape.heads}/{shape.kv_heads}, "
            f"head_dim {shape.head_dim}, {shape.elem * 8}-bit; zigzag layout; a head group is U consecutive GPUs",
            "      W   U x R     seq used  links (a2a/ring)  ring steps fwd|bwd ms  a2a ms   rank ms  1-GPU ms  "
            "efficiency"]


def _split_line(topo, s, best):
    a2a = "-" if s.head_world == 1 else ("NVLink" if s.head_world <= topo.domain else "IB")
    ring = "-" if s.ring_world == 1 else ("NVLink" if s.world <= topo.domain else "IB")
    steps = (f"{s.ring.fwd_compute[-1]:8.3f} | {s.ring.bwd_compute[0]:8.3f}" if s.ring else f"{'one call':>19s}")
    return (f"   {s.world:4d}  {s.head_world:2d} x {s.ring_world:<3d} {s.seq:9d}  {a2a:>6s} / {ring:6s}   {steps}"
            f"   {s.a2a_ms:7.3f} {s.rank_ms:9.2f} {s.single_ms:9.2f}   {s.efficiency:6.3f}{'  <- best' if best else ''}")


def _check_lines(topo):
    out = []
    for r in topo.checks:
        shape = _row_shape(r)
        if r["kind"] == "ring":
            u = r.get("head_world", 1)
            s = predict_split(topo, shape, u, r["world"] // u)
            out.append(f"   ring      {r['seq']:8d} W={r['world']:<3d} {u} x {r['world'] // u:<3d} efficiency "
                       f"{r['efficiency']:.3f} | {s.efficiency:.3f} ({_err(s.efficiency, r['efficiency'])})   ring ms "
                       f"{r['ringfa4_ms']:.2f} | {s.rank_ms:.2f} ({_err(s.rank_ms, r['ringfa4_ms'])})")
        else:
            out.append(_simulated_line("simulated", topo, shape, r, r["efficiency"], r["rank_ms"]))
            if r.get("graph_efficiency") is not None and topo.graph_step_overhead_ms is not None:
                g = topo.graph_step_overhead_ms
                graphed = replace(topo, step_overhead_ms=(g, g), kernel_scale=(1.0, 1.0), step_host_ms=0.0)
                out.append(_simulated_line("  graphed", graphed, shape, r, r["graph_efficiency"], r["graph_rank_ms"]))
    if out:
        files = ", ".join(sorted({r["_file"] for r in topo.checks}))
        out.insert(0, f"   measured vs predicted (rows of {files}; errors are predicted / measured - 1; simulated "
                      "rows against the model with free links, eager and, replayed from a CUDA graph, against "
                      "the graphed model):")
    return out


def _simulated_line(label, topo, shape, r, efficiency, rank_ms):
    s = predict_split(topo, shape, r["head_world"], r["ring_world"], links=False)
    measured = max(rank_ms.values())
    return (f"   {label} {r['seq']:8d} W={r['world']:<3d} {r['head_world']} x {r['ring_world']:<3d} "
            f"efficiency {efficiency:.3f} | {s.efficiency:.3f} ({_err(s.efficiency, efficiency)})   "
            f"rank ms {measured:.2f} | {s.rank_ms:.2f} ({_err(s.rank_ms, measured)})")


def report(topo, shape, worlds, max_head_group):
    out = _header(topo, shape)
    for w in worlds:
        options = splits(topo, shape, w, max_head_group)
        best = max(options, key=lambda s: s.efficiency)
        for s in options:
            out.append(_split_line(topo, s, s is best and len(options) > 1))
        moved = sorted({s.seq for s in options if s.seq != shape.seq})
        if moved:
            out.append(f"      (seq {shape.seq} does not split into whole {ALIGN}-row tiles over some of these; "
                       f"the nearest lengths that do are modelled: {', '.join(map(str, moved))})")
    for label, w in (("NVLink", 2 if topo.domain > 1 else None), ("IB", topo.domain + 1)):
        if w is not None:
            chunk = hiding_chunk(topo, shape, w)
            out.append(f"   smallest local chunk whose compute hides the ring's transfers over {label}: "
                       f"{chunk if chunk else '> 64M'} tokens per rank")
    return "\n".join(out + _check_lines(topo))


def _parser():
    p = argparse.ArgumentParser(prog="python -m ringfa4.plan", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="all", help="a topology name or 'all'")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--seq", type=int, default=1 << 17, help="total sequence length")
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--dtype", default="bf16", help=f"one of {sorted(DTYPE_BYTES)}")
    p.add_argument("--backend", default="fa4", choices=("fa4", "cute"), help="whose kernel TFLOP/s and step overhead")
    p.add_argument("--worlds", default=",".join(map(str, WORLDS)))
    p.add_argument("--max-head-group", type=int, default=None,
                   help="largest head group U modelled (default: the topology's NVLink domain)")
    p.add_argument("--graphed", action="store_true",
                   help="each rank's ring call captured whole in a CUDA graph and replayed "
                        "(torch.cuda.make_graphed_callables around ring_attention; README): its measured "
                        "per-step overhead instead of the eager one")
    p.add_argument("--calibration", action="append", default=[], metavar="FILE",
                   help="a calibration file to use instead of the shipped one of its GPU (repeatable)")
    p.add_argument("--tflops-scale", type=float, default=None, help="multiply the kernel curves (e.g. for other GPUs)")
    p.add_argument("--refit", default=None, metavar="FILES",
                   help="comma list of bench JSON files: write a calibration of --gpu from them (see --write)")
    p.add_argument("--gpu", default="H200", choices=CALIBRATED_GPUS, help="the GPU --refit calibrates")
    p.add_argument("--write", default=None, metavar="FILE", help="where --refit writes (default: stdout)")
    p.add_argument("--documents", action="store_true",
                   help="print instead the load balance of packed documents per layout at W = 2, 4, 8, for "
                        "--seq and 4x --seq tokens (ringfa4.ring.balance)")
    return p


def _check_args(p, args):
    if args.dtype not in DTYPE_BYTES:
        p.error(f"--dtype must be one of {sorted(DTYPE_BYTES)}, got {args.dtype!r}")
    for name in ("heads", "kv_heads", "head_dim", "seq", "max_head_group"):
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.heads % args.kv_heads:
        p.error(f"--heads ({args.heads}) must be a multiple of --kv-heads ({args.kv_heads})")
    worlds = [int(w) for w in args.worlds.split(",")]
    if any(w < 2 for w in worlds):
        p.error(f"--worlds must all be >= 2, got {args.worlds}")
    return worlds


def main(argv=None):
    p = _parser()
    args = p.parse_args(argv)
    cals = {g: load_calibration(calibration_path(g)) for g in CALIBRATED_GPUS}
    for path in args.calibration:
        cal = load_calibration(path)
        cals[cal["gpu"]] = cal
    if args.refit:
        text = json.dumps(refit(cals[args.gpu], args.refit.split(",")), indent=1) + "\n"
        print(text, end="") if args.write is None else Path(args.write).write_text(text)
        return
    worlds = _check_args(p, args)
    if args.documents:
        print("\n".join(balance.report(totals=(args.seq, 4 * args.seq))))
        return
    try:
        topos = presets(args.backend, cals, args.graphed)
    except ValueError as e:
        p.error(str(e))
    chosen = sorted(topos) if args.preset == "all" else [args.preset]
    if any(n not in topos for n in chosen):
        p.error(f"--preset must be one of {sorted(topos)} or 'all', got {args.preset!r}")
    shape = Shape(args.heads, args.kv_heads, args.head_dim, args.seq, args.causal, DTYPE_BYTES[args.dtype])
    for name in chosen:
        topo = topos[name]
        if args.tflops_scale:
            topo = replace(topo, gpu=replace(topo.gpu, tflops={k: tuple((s, t * args.tflops_scale) for s, t in v)
                                                                   for k, v in topo.gpu.tflops.items()},
                                             source=f"{topo.gpu.source} x {args.tflops_scale}"))
        print(report(topo, shape, worlds, args.max_head_group))
        print()


if __name__ == "__main__":
    main()
