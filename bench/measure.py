"""The measurement layer of the bench scripts: the timer, the comparators, run metadata and where
rows go. FLOP counts come from ringfa4.flops.

    timer = measure.Timer(device, rounds=2, turn_ms=100, reduce="min")
    ours_ms, fa4_ms = timer(ours, fa4)          # the fns take turns; best of the rounds

Results: a run writes its rows to a new temporary directory (and says where) unless it is given
``--out-dir DIR``, or ``--record`` for the recorded files in bench/results/; a smoke run can never
record, so trying a script never replaces measured rows.
"""
import argparse
import contextlib
import datetime
import functools
import json
import math
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

RESULTS = Path(__file__).resolve().parent / "results"
REDUCTIONS = {"min": min, "median": statistics.median}


class Timer:
    """Milliseconds per call of each of several fns, which take turns.

    Warm-up: ``warmup`` calls of each fn in turn, so that the allocator's cache holds what each fn
    needs after the others ran; then, where a turn is more than one call, one untimed round of
    whole turns, so that the timed rounds start at the clocks the device holds under sustained
    load. (Without it, the first timed turn after the short warm-up calls read 4-6% faster than
    every later one on an H100, and with "min" the fn listed first always had it: three copies of
    one backward call read 1.000 / 0.956 / 0.952; bench/RESULTS.md, 2026-11-27.) Then ``rounds``
    rounds; in each, every fn in turn makes ``iters`` back-to-back calls between two CUDA events
    (perf_counter on CPU), in the orders of turn_orders: no fn keeps a place (a fn timed first
    in every round read up to 8% off the same fn timed third, bench/RESULTS.md, 2026-11-26 night
    II) nor the fn before it (under a power cap a turn starts at the clocks the previous turn
    left: bench/RESULTS.md, 2026-11-29 III). Each fn's rounds reduce to
    their "min" (best) or "median": a drift of the clocks over a row (power, heat) reaches every
    contender alike instead of whichever ran during it. With ``turn_ms``, a fn makes as many calls
    per turn as fill that time by its last warm-up call (at least ``iters``), so short kernels are
    timed over many launches and long ones once.

    With a process ``group``, every turn starts on all its ranks at once (a rank that finished the
    previous fn sooner would otherwise start its clock early and count, in a ring's first call, the
    wait for the slower rank) and each round's time is the slowest rank's; ``turn_ms`` is refused
    there, as ranks must make the same calls.
    """

    def __init__(self, device, rounds=3, warmup=1, iters=1, turn_ms=None, reduce="median", group=None):
        if reduce not in REDUCTIONS:
            raise ValueError(f"reduce must be one of {sorted(REDUCTIONS)}, got {reduce!r}")
        for name, n, least in (("rounds", rounds, 1), ("warmup", warmup, 0), ("iters", iters, 1)):
            if not isinstance(n, int) or n < least:
                raise ValueError(f"{name} must be an int >= {least}, got {n!r}")
        if turn_ms is not None and (group is not None or warmup < 1):
            raise ValueError("turn_ms needs warmup >= 1 and no process group (ranks must make the same calls)")
        self.device, self.rounds, self.warmup, self.iters = torch.device(device), rounds, warmup, iters
        self.turn_ms, self.reduce, self.group = turn_ms, reduce, group
        self.calls = []  # per fn of the last call: calls per timed turn
        self.mallocs = []  # per fn of the last call: cudaMalloc calls in its timed turns (warm-up excluded)
        self.round_ms = []  # of the last call: per round, each fn's ms per call (before reduction)

    def __call__(self, *fns):
        """(ms per call of each fn, in order)."""
        last = [math.inf] * len(fns)
        for _ in range(self.warmup):
            last = [self._turn(fn, 1) for fn in fns]
        self.calls = [self.iters if self.turn_ms is None else max(self.iters, math.ceil(self.turn_ms / max(ms, 1e-3)))
                      for ms in last]
        if any(calls > 1 for calls in self.calls):  # else the warm-up calls were whole turns already
            for fn, calls in zip(fns, self.calls):
                self._turn(fn, calls)
        self.mallocs = [0] * len(fns)
        ms = [[math.nan] * len(fns) for _ in range(self.rounds)]
        for r, order in enumerate(turn_orders(len(fns), self.rounds)):
            for i in order:
                ms[r][i] = self._turn(fns[i], self.calls[i], i)
        if self.group is not None:
            worst = torch.tensor(ms, dtype=torch.float64, device=self.device)
            dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=self.group)
            ms = worst.tolist()
        self.round_ms = ms
        return tuple(REDUCTIONS[self.reduce](column) for column in zip(*ms))

    def _turn(self, fn, calls, index=None):
        self._start_together()
        if self.device.type != "cuda":
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            return (time.perf_counter() - t0) * 1e3 / calls
        mallocs = device_mallocs(self.device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        if index is not None:
            self.mallocs[index] += device_mallocs(self.device) - mallocs
        return start.elapsed_time(end) / calls

    def _start_together(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if self.group is not None:
            dist.barrier(group=self.group)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)


def turn_orders(n, rounds):
    """The order of n fns' turns in each of ``rounds`` rounds: a Williams design (rounds beyond it
    repeat it). Over its n rounds (2n where n is odd, the second n mirrored) every fn takes every
    place equally often and follows every other fn equally often, so that with the best of those
    rounds no fn is timed only after the same, perhaps heaviest, neighbour, as a rotation by one
    place per round times it."""
    base = [0]
    for j in range(1, n):
        base.append((j + 1) // 2 if j % 2 else n - j // 2)
    design = [[(x + r) % n for x in base] for r in range(n)]
    if n % 2:
        design += [row[::-1] for row in design]
    return [design[r % len(design)] for r in range(rounds)]


def device_mallocs(device):
    """cudaMalloc calls the caching allocator has made so far on a CUDA device (each may wait for
    the device): a timed call that needs new ones pays for them."""
    return torch.cuda.memory_stats(device).get("num_device_alloc", 0)


# ---------------------------------------------------------------- comparators


def sdpa(q, k, v, causal):
    """PyTorch's attention on (batch, heads, seq, head_dim) tensors of equal head counts: cuDNN's
    kernel on CUDA (the fastest SDPA kernel on Hopper), PyTorch's default on CPU (smoke runs)."""
    if not q.is_cuda:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


@contextlib.contextmanager
def torch_context_parallel(mesh, buffers, seq_dims, load_balance):
    """PyTorch's context_parallel over ``mesh``, sharding ``buffers`` in place along ``seq_dims``
    (SDPA inside the block is its ring), with its load balancer switched to ``load_balance`` for
    the block; yields its options (rotate_method says how KV travels)."""
    from torch.distributed.tensor.experimental import _attention, context_parallel

    options = _attention._cp_options  # private: where PyTorch keeps the load balancer switch
    old = options.enable_load_balance
    options.enable_load_balance = load_balance
    try:
        with context_parallel(mesh, buffers=buffers, buffer_seq_dims=seq_dims, no_restore_buffers=set(buffers)):
            yield options
    finally:
        options.enable_load_balance = old


def sdpa_layout(q, k, v):
    """(b, s, h, d) q, k, v -> (b, h, s, d) views for ``sdpa`` (cuDNN reads the strided layout as it
    is), k/v heads repeated to q's where fewer (cuDNN's SDPA path takes no grouped-query attention
    here; torchtitan repeats them the same way)."""
    group = q.shape[2] // k.shape[2]
    if group > 1:
        k, v = (t.repeat_interleave(group, 2) for t in (k, v))
    return [t.transpose(1, 2) for t in (q, k, v)]


def fa4_attention(q, k, v, causal):
    """Upstream FA4's public autograd function (flash_attn.cute.flash_attn_func): its out."""
    from flash_attn.cute import flash_attn_func

    return flash_attn_func(q, k, v, causal=causal)[0]


# ---------------------------------------------------------------- metadata and results


@functools.cache
def git_commit():
    """Short commit of the checkout the bench scripts run from, or "unknown" outside git."""
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).resolve().parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def metadata(device, commit=None, **extra):
    """What every row records: device name, commit of the measured tree, UTC time, torch version."""
    device = torch.device(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return dict(device=name, commit=commit or git_commit(),
                date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                torch=torch.__version__, **extra)


def add_output_args(parser):
    parser.add_argument("--out-dir", default=None,
                        help="directory for the JSON rows (default: a new temporary directory)")
    parser.add_argument("--record", action="store_true",
                        help=f"write the recorded rows in {RESULTS} (not with a smoke run)")


def check_output_args(parser, args, smoke):
    """Refuses --record where it would record what is not a full run (every rank calls this)."""
    if args.record and (smoke or args.out_dir):
        parser.error("--record writes the recorded rows of a full run: not with --out-dir or a smoke run")


def output_dir(args):
    """Where this run's rows go (see the module docstring); says so on stdout."""
    if args.record:
        out = RESULTS
    elif args.out_dir:
        out = Path(args.out_dir)
    else:
        out = Path(tempfile.mkdtemp(prefix="ringfa4-bench-"))
    out.mkdir(parents=True, exist_ok=True)
    print(f"rows go to {out}{'' if args.record else ' (not recorded; --record writes bench/results)'}", flush=True)
    return out


class Rows(list):
    """Result rows of one JSON file, printed and the file rewritten whole after every added row, so
    that a run cut short still leaves what it measured. Without a path (ranks other than 0) the
    rows are only kept."""

    def __init__(self, path):
        super().__init__()
        self.path = None if path is None else Path(path)

    def add(self, row):
        self.append(row)
        if self.path is None:
            return
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self, indent=1) + "\n")
        os.replace(tmp, self.path)
        print(json.dumps(row), flush=True)


def graphed(fn):
    """``fn`` captured in a CUDA graph after one more eager call (its warm-up): (replay, None), or
    (None, the capture's error) where something in it cannot be captured, to report, never hide."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
    except RuntimeError as e:
        return None, f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    return graph.replay, None


def parser(description):
    """An argument parser with the options every bench script shares."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--commit", default=None, help="commit of the measured tree (default: git rev-parse)")
    add_output_args(p)
    return p
