"""Performance model of the ring: compute vs. link time per step for a topology, and the efficiency
that follows (python -m ringfa4.plan --help).

    python -m ringfa4.plan --preset gb200-nvl72 --heads 64 --kv-heads 8 --seq 1048576
    python -m ringfa4.plan --preset h200-x2 --heads 32 --kv-heads 8 --seq 32768 --worlds 2

The model follows ringfa4.ring.attention step by step (zigzag layout, W ranks, local length L = S/W,
each step's work taken from ringfa4.ring.schedule for the first and the last rank, the two extremes):
  forward  step i computes its block while the next KV block (2*L*hk*d elements) travels;
  backward visits the blocks in reverse, starting on the forward's last block and ending on the local
           one: step j computes while the next block (for j + 2 < W) and the previous step's dK/dV sums
           (j >= 1; fp32 for W > 2) travel, on one NCCL stream, so their times add. Nothing is exposed.
  A step costs max(compute, transfer); all ranks step together, so every hop runs at the slowest
  link's speed (InfiniBand once W exceeds the NVLink domain). efficiency = t(1 GPU) / (W * t(ring)).
A step's compute = its kernel + the memory-bound passes the ring runs inside it (merge, dq add, start
of the dK/dV sums; their bytes at the GPU's HBM bandwidth) + a fixed per-step overhead. The passes
outside the steps (casts, zeroing, later dK/dV sums) add their bytes once.
Kernel time = FLOPs / TFLOP/s of the backend at the step's own loop length (keys per query tile
forward, queries per key tile backward; log-interpolated, clamped); link time = latency + bytes /
bandwidth (fitted per link).

Numbers come from bench/results/*.json when they hold rows for the preset's GPU (kernel TFLOP/s:
bench/kernels.py rows; link: the forward KV transfer times that bench/ring.py records; per-step
overhead: bench/ring.py's per-step timeline against this model), otherwise from the defaults below,
each with its source. Predictions for measured ring rows are printed next to the measurements.
"""
import argparse
import glob
import itertools
import json
import math
import os
import statistics
from dataclasses import dataclass, replace

from ringfa4 import flops
from ringfa4.ring import schedule

MiB = 1 << 20

# FA4 (flash_attn.cute, sm90) bf16 hdim 128, TFLOP/s by sequence length, measured on the lent machines
# on 2026-11-21 (shared/device/README.md): {(direction, causal): ((seq, TFLOP/s), ...)}.
FA4_H200 = {
    ("fwd", False): ((1024, 545), (4096, 638), (8192, 663), (16384, 677), (32768, 653)),
    ("fwd", True): ((1024, 406), (4096, 570), (8192, 607), (16384, 603), (32768, 639)),
    ("bwd", False): ((1024, 472), (4096, 568), (8192, 599), (16384, 567), (32768, 622)),
    ("bwd", True): ((1024, 362), (4096, 514), (8192, 562), (16384, 590), (32768, 614)),
}
FA4_H100 = {
    ("fwd", False): ((1024, 552), (4096, 632), (8192, 664), (16384, 664), (32768, 645)),
    ("fwd", True): ((1024, 386), (4096, 563), (8192, 611), (16384, 611), (32768, 635)),
    ("bwd", False): ((1024, 458), (4096, 564), (8192, 600), (32768, 615)),
    ("bwd", True): ((1024, 326), (4096, 509), (8192, 557), (32768, 626)),
}
# Not measured here (no Blackwell is lent): FA4 is reported at ~1600 TFLOP/s forward on B200 against
# ~650 measured above on Hopper, so the H200 curves are scaled by this factor. Override with --tflops-scale.
BLACKWELL_OVER_HOPPER = 2.4
# NCCL ring exchange (send next, receive previous, all ranks at once) on 2 x H200, NVLink NV18, per
# direction per rank (shared/device/README.md): (bytes, GB/s).
NVLINK4_EXCHANGE = ((16 * MiB, 85.0), (64 * MiB, 172.0), (256 * MiB, 246.0))
NVLINK4_NOMINAL_GBPS = 450.0  # 18 links x 25 GB/s per direction
# Assumptions (no measurement lent): NVLink 5 keeps NVLink 4's measured fraction of its nominal
# 900 GB/s per direction; NCCL over one 400 Gb/s NIC per GPU reaches ~90% of 50 GB/s; HBM copies reach
# 80% of nominal bandwidth.
NVLINK5_NOMINAL_GBPS = 900.0
IB_400G = dict(gbps=0.9 * 50.0, latency_ms=0.03)
HBM_EFFICIENCY = 0.8
NO_OVERHEAD = "not measured: none assumed"


@dataclass(frozen=True)
class Link:
    name: str
    gbps: float  # asymptotic GB/s per direction per GPU
    latency_ms: float
    source: str

    def ms(self, nbytes):
        return self.latency_ms + nbytes / (self.gbps * 1e9) * 1e3


@dataclass(frozen=True)
class Gpu:
    name: str
    match: str  # substring of torch.cuda.get_device_name() for results of this GPU
    hbm_gbps: float  # nominal
    tflops: dict  # {(direction, causal): ((seq, TFLOP/s), ...)}
    source: str

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
    overhead_source: str = NO_OVERHEAD
    # (forward, backward) kernel time of the calibration run per kernel-row ms: the fitted slope,
    # applied to the ring's steps and the 1-GPU call alike (it cancels in the efficiency)
    kernel_scale: tuple = (1.0, 1.0)

    def link(self, world):
        return self.nvlink if world <= self.domain else self.network


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


def _nvlink4():
    return fit_link("NVLink4 (NV18)", [(b, b / (g * 1e9) * 1e3) for b, g in NVLINK4_EXCHANGE],
                    "fit to NCCL ring exchange at 16/64/256 MiB on 2 x H200 (shared/device/README.md)")


def presets():
    nv4 = _nvlink4()
    nv5 = Link("NVLink5", nv4.gbps * NVLINK5_NOMINAL_GBPS / NVLINK4_NOMINAL_GBPS, nv4.latency_ms,
               f"assumed: NVLink4's measured {nv4.gbps / NVLINK4_NOMINAL_GBPS:.0%} of nominal, of 900 GB/s")
    ib = Link("InfiniBand 400 Gb/s", IB_400G["gbps"], IB_400G["latency_ms"], "assumed: 90% of 50 GB/s per NIC")
    h200 = Gpu("H200", "H200", 4800.0, FA4_H200, "FA4 on H200, shared/device/README.md (2026-11-21)")
    h100 = Gpu("H100", "H100", 3350.0, FA4_H100, "FA4 on H100, shared/device/README.md (2026-11-21)")
    gb200 = Gpu("GB200", "GB200", 8000.0,
                {k: tuple((s, t * BLACKWELL_OVER_HOPPER) for s, t in v) for k, v in FA4_H200.items()},
                f"assumed: H200 FA4 curve x {BLACKWELL_OVER_HOPPER}")
    return {
        "h200-x2": Topology("h200-x2", "2 x H200 on NVLink (the lent machine); more GPUs across IB 400G", h200, 2, nv4, ib),
        "h100-node": Topology("h100-node", "8 x H100 on NVLink (one HGX node); more GPUs across IB 400G", h100, 8, nv4, ib),
        "gb200-nvl72": Topology("gb200-nvl72", "72 x GB200 in one NVLink domain (900 GB/s per direction per GPU); "
                                "144+ across racks over IB 400G", gb200, 72, nv5, ib),
        "ib-400g": Topology("ib-400g", "H100 ranks on different nodes: every hop over InfiniBand 400 Gb/s per GPU",
                            h100, 1, nv4, ib),
    }


# ---------------------------------------------------------------- calibration from bench/results


def default_results_dir():
    return os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "results")


def _rows(results_dir):
    rows = []
    for path in sorted(glob.glob(os.path.join(results_dir, "*.json"))):
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, ValueError):
            continue
        if isinstance(data, list):
            rows += [dict(r, _file=os.path.basename(path)) for r in data if isinstance(r, dict)]
    return rows


def _envelope(points):
    """Best TFLOP/s at or below each length. The kernel rows hold the CTA count fixed (32k tokens x 16
    heads per call), so a longer loop can only amortise more; a lower reading at a longer length is
    run noise (FA4's backward: 611 at 16k, 519 at 32k causal), and noise only ever slows a kernel."""
    best, out = 0.0, []
    for s, t in points:
        best = max(best, t)
        out.append((s, best))
    return tuple(out)


def calibrate(topo, rows, backend, head_dim):
    """The topology with kernel curves, NVLink and per-step overhead fitted to measured rows of its GPU, where any."""
    mine = [r for r in rows if topo.gpu.match in str(r.get("device", ""))]
    key = "fa4_tflops" if backend == "fa4" else "ringfa4_tflops"
    curves, files = dict(topo.gpu.tflops), set()
    for direction, causal in curves:
        pts = sorted({(r["seq"], r[key]) for r in mine
                      if r.get("direction") == direction and r.get("causal") == causal
                      and r.get("hdim") == head_dim and r.get(key)})
        if pts:
            curves[(direction, causal)] = _envelope(pts)
            files |= {r["_file"] for r in mine if r.get("direction") == direction and r.get(key)}
    gpu = topo.gpu
    if files:
        gpu = replace(gpu, tflops=curves, source=f"{backend} measured in bench/results/{', '.join(sorted(files))}, "
                      f"best reading at or below each length (missing directions: {gpu.source})")
    transfers = [(r["kv_bytes_per_step"], ms) for r in mine if r.get("kv_bytes_per_step")
                 for ms in r.get("step_ms", {}).get("fwd_kv", [])]
    nvlink = topo.nvlink
    if transfers and topo.domain > 1:
        nvlink = fit_link(nvlink.name, transfers, f"fit to {len(transfers)} forward KV transfers in bench/results/ring.json")
    topo = replace(topo, gpu=gpu, nvlink=nvlink, backend=backend)
    timelines = [r for r in mine if r.get("backend") == backend and r.get("step_ms_by_rank")]
    if timelines:
        overhead, slope, n = fit_step_overhead(topo, timelines)
        where = ", ".join(sorted({r["_file"] for r in timelines}))
        topo = replace(topo, step_overhead_ms=overhead, kernel_scale=slope,
                       overhead_source=f"intercept of a Theil-Sen line through {n} step compute spans in bench/results/"
                       f"{where} against this model's kernel + memory time; its slopes {slope[0]:.3f} / {slope[1]:.3f} "
                       f"(that run's kernels vs the kernel rows) scale the kernel times of the ring and the 1-GPU call")
    return topo


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


# ---------------------------------------------------------------- the model


@dataclass(frozen=True)
class Shape:
    heads: int
    kv_heads: int
    head_dim: int
    seq: int
    causal: bool
    elem: int  # bytes per q/k/v element


ROW_DTYPE_BYTES = {"bfloat16": 2, "float16": 2}  # torch dtype names in bench/ring.py rows


def _row_shape(r):
    return Shape(r["heads"], r["kv_heads"], r["head_dim"], r["seq"], r["causal"], ROW_DTYPE_BYTES[r["dtype"]])


def _kernel_ms(gpu, shape, direction, sq, sk, causal):
    work = flops.attention(1, sq, sk, shape.heads, shape.head_dim, causal, direction)
    # The kernel rows vary only the length of each CTA's loop (their CTA count is fixed), and that
    # length is what sets the kernel's efficiency: a forward CTA loops over the keys of one query
    # tile, a backward CTA over the queries of one key tile.
    loop = sk if direction == "fwd" else sq
    return work / (gpu.kernel_tflops(direction, causal, loop) * 1e12) * 1e3


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
    fwd = [scale_f * _kernel_ms(gpu, shape, "fwd", *s) + _hbm_ms(gpu, n) + over_f for s, n in zip(steps, fwd_bytes)]
    bwd = [scale_b * _kernel_ms(gpu, shape, "bwd", *s) + _hbm_ms(gpu, n) + over_b
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
    return sum(scale * _kernel_ms(topo.gpu, shape, d, s, s, shape.causal)
               for d, scale in zip(("fwd", "bwd"), topo.kernel_scale))


def predict(topo, shape, world):
    """Time of one fwd+bwd ring call on the slowest rank, step by step."""
    if world < 2:
        raise ValueError(f"world must be >= 2, got {world}")
    L, hk, d, e = shape.seq // world, shape.kv_heads, shape.head_dim, shape.elem
    link = topo.link(world)
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


# ---------------------------------------------------------------- command line

WORLDS = (2, 4, 8, 16, 32, 64, 72, 144, 288, 576)
DTYPE_BYTES = {"bf16": 2, "fp16": 2}


def _err(predicted, measured):
    return f"{predicted / measured - 1:+6.1%}"


def report(topo, shape, worlds, measured):
    g, nv, net = topo.gpu, topo.nvlink, topo.network
    out = [f"== {topo.name}: {topo.description}",
           f"   kernel TFLOP/s: {g.source}",
           f"   {nv.name}: {nv.gbps:.0f} GB/s + {nv.latency_ms * 1e3:.0f} us per transfer ({nv.source})",
           f"   {net.name}: {net.gbps:.0f} GB/s + {net.latency_ms * 1e3:.0f} us per transfer ({net.source})",
           f"   HBM {g.hbm_gbps:.0f} GB/s nominal, {HBM_EFFICIENCY:.0%} reached by the ring's memory-bound passes",
           "   kernel time of a step: its FLOPs at the TFLOP/s of its own loop length (keys per query tile forward, "
           "queries per key tile backward)",
           f"   per-step overhead {topo.step_overhead_ms[0]:.3f} ms forward, {topo.step_overhead_ms[1]:.3f} ms backward "
           f"({topo.overhead_source}); not charged to the 1-GPU call: the kernel rows time whole calls",
           f"   {'causal' if shape.causal else 'full'} attention, seq {shape.seq}, heads {shape.heads}/{shape.kv_heads}, "
           f"head_dim {shape.head_dim}, {shape.elem * 8}-bit; zigzag layout",
           "      W    local  link       fwd step ms (compute | kv)   bwd step ms (compute | kv+dkv)   "
           "outside ms    ring ms   1-GPU ms  efficiency"]
    for w in worlds:
        if shape.seq % (2 * w) or shape.seq // w < 256:
            out.append(f"   W={w}: seq {shape.seq} is not a multiple of {2 * w} with >= 256 tokens per rank, not modelled")
            continue
        p = predict(topo, shape, w)
        out.append(f"   {w:4d} {p.local:8d}  {'NVLink' if w <= topo.domain else 'IB':6s}   "
                   f"{p.fwd_compute[-1]:8.3f} | {max(p.fwd_transfer):7.3f}            {p.bwd_compute[0]:8.3f} | "
                   f"{max(p.bwd_transfer):7.3f}            {p.extra_ms:7.3f}  {p.ring_ms:8.2f} {p.single_ms:9.2f}   {p.efficiency:6.3f}")
    for label, w in (("NVLink", min(topo.domain, 2) if topo.domain > 1 else None), ("IB", topo.domain + 1)):
        if w is None or w < 2:
            continue
        chunk = hiding_chunk(topo, shape, w)
        out.append(f"   smallest local chunk whose compute hides the transfers over {label}: "
                   f"{chunk if chunk else '> 64M'} tokens per rank")
    if measured:
        out.append("   measured vs predicted (ring.json rows; errors are predicted / measured - 1):")
        out.append("   backend    seq  causal  heads/kv  efficiency meas | pred (err)   ring ms meas | pred (err)   "
                   "1-GPU ms meas | pred (err)")
    for r in measured:
        p = predict(topo, _row_shape(r), r["world"])
        out.append(f"   {r['backend']:7s} {r['seq']:6d}  {'yes' if r['causal'] else 'no':6s}  {r['heads']:2d}/{r['kv_heads']:<2d}"
                   f"      {r['efficiency']:6.3f} | {p.efficiency:5.3f} ({_err(p.efficiency, r['efficiency'])})"
                   f"   {r['ringfa4_ms']:7.2f} | {p.ring_ms:7.2f} ({_err(p.ring_ms, r['ringfa4_ms'])})"
                   f"   {r['single_ms']:7.2f} | {p.single_ms:7.2f} ({_err(p.single_ms, r['single_ms'])})")
    return "\n".join(out)


def main(argv=None):
    names = sorted(presets())
    p = argparse.ArgumentParser(prog="python -m ringfa4.plan", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="all", help=f"one of {names} or 'all'")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--seq", type=int, default=9 << 17,
                   help="total sequence length over the ring (default 1179648 = 9 x 128k: splits into 2 x 576 chunks)")
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--dtype", default="bf16", help=f"one of {sorted(DTYPE_BYTES)}")
    p.add_argument("--backend", default="fa4", choices=("fa4", "cute"), help="whose kernel TFLOP/s to read from bench/results")
    p.add_argument("--worlds", default=",".join(map(str, WORLDS)))
    p.add_argument("--results", default=default_results_dir(), help="folder of bench JSON rows used for calibration")
    p.add_argument("--tflops-scale", type=float, default=None, help="multiply the kernel curves (e.g. for other GPUs)")
    args = p.parse_args(argv)
    if args.dtype not in DTYPE_BYTES:
        p.error(f"--dtype must be one of {sorted(DTYPE_BYTES)}, got {args.dtype!r}")
    for name in ("heads", "kv_heads", "head_dim", "seq"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.heads % args.kv_heads:
        p.error(f"--heads ({args.heads}) must be a multiple of --kv-heads ({args.kv_heads})")
    chosen = names if args.preset == "all" else [args.preset]
    if any(n not in names for n in chosen):
        p.error(f"--preset must be one of {names} or 'all', got {args.preset!r}")
    worlds = [int(w) for w in args.worlds.split(",")]
    if any(w < 2 for w in worlds):
        p.error(f"--worlds must all be >= 2, got {args.worlds}")
    shape = Shape(args.heads, args.kv_heads, args.head_dim, args.seq, args.causal, DTYPE_BYTES[args.dtype])
    rows = _rows(args.results) if os.path.isdir(args.results) else []
    topos = {name: calibrate(topo, rows, args.backend, args.head_dim) for name, topo in presets().items()}
    # The per-step overhead is launch, allocation and host time of our ring code, so where only
    # another GPU's timeline was measured, its value is the best guess there is.
    fitted = next((t for t in topos.values() if t.overhead_source != NO_OVERHEAD), None)
    for name in chosen:
        topo = topos[name]
        if fitted and topo.overhead_source == NO_OVERHEAD:
            topo = replace(topo, step_overhead_ms=fitted.step_overhead_ms,
                           overhead_source=f"assumed as on {fitted.gpu.name}: {fitted.overhead_source}")
        if args.tflops_scale:
            topo = replace(topo, gpu=replace(topo.gpu, tflops={k: tuple((s, t * args.tflops_scale) for s, t in v)
                                                                   for k, v in topo.gpu.tflops.items()},
                                             source=f"{topo.gpu.source} x {args.tflops_scale}"))
        measured = [r for r in rows if r.get("_file") == "ring.json" and topo.gpu.match in str(r.get("device", ""))
                    and r.get("world", 0) <= max(topo.domain, 2) and r.get("backend") == args.backend
                    and r.get("efficiency")]
        print(report(topo, shape, worlds, measured))
        print()


if __name__ == "__main__":
    main()
