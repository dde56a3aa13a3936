"""Attention side by side in one process on one GPU: ringfa4 vs upstream FA4 (flash_attn.cute)
vs cuDNN SDPA, the implementations taking turns (bench/measure.py Timer), FLOPs from
ringfa4.flops (4*b*sq*sk*h*d, halved for causal; backward 2.5x forward). Rows go to a temporary
directory, --out-dir DIR, or with --record bench/results/; markdown tables are printed last.
Nothing wrong is timed: each ringfa4 result is first checked against FA4's (or SDPA's on CPU).

Kernel mode (default): the backends' entry points (``cute`` vs FA4's private forward/backward),
bf16, 16 heads, 32k tokens per batch (batch = 32768 // seq), hdim 128 and 64. Forward rows also
time a candidate configuration (CANDIDATE) and, at seq 8k, the techniques switched off one at a
time (kernels_techniques.json); backward rows (direction "bwd", hdim 128) time the three backward
passes from one (out, lse), plus ringfa4 and FA4 deterministic. 5 warm-up calls, then 2 rounds
in which each makes back-to-back calls filling ~100 ms between CUDA events; best round kept.
Rows: kernels.json.

    python bench/kernels.py --commit $(git rev-parse --short HEAD) [--quick] [--sass DIR] [--record]

User mode: what a user calls. ``ringfa4.attention(q, k, v, causal, backend="cute")`` vs
``flash_attn.cute.flash_attn_func`` vs SDPA on cuDNN (k/v heads repeated before timing), forward
(under no_grad) and forward + backward (autograd, torch.autograd.grad with a random dout), plus
ringfa4's backward alone, default and deterministic, from one (out, lse) (det/default = default
time / deterministic time). Fresh random bf16 inputs per shape. Shapes: seq 1k..32k at 32k tokens
per batch, causal and not, hdim 128 and 64, heads 16/16 and 32/8; ring-step shapes at batch 1,
32/8 heads, hdim 128 (RING_STEPS). 2 warm-up calls, then 8 rounds of turns filling ~25 ms each
(the 8 contenders' Williams design, measure.turn_orders: each follows every other once), best
round kept. Rows: kernels_user.json; ``--smoke`` runs it on CPU (torch backend, float32,
tiny shapes) to prove the script, not to measure.

    python bench/kernels.py --mode user --commit $(git rev-parse --short HEAD) [--out-dir DIR]
"""
import math
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import ringfa4  # noqa: E402
import ringfa4.backends.cute as cute_backend  # noqa: E402
import ringfa4.backends.fa4 as fa4_backend  # noqa: E402
from bench import measure  # noqa: E402
from ringfa4 import backends, flops  # noqa: E402
from ringfa4.backends.cute import compile as kc  # noqa: E402
from ringfa4.backends.cute import configs  # noqa: E402
from ringfa4.backends.cute.interface import forward_config  # noqa: E402

HEADS = 16
TOKENS = 32768
SEQS = (1024, 2048, 4096, 8192, 16384, 32768)


def tflops(b, s, h, d, causal, ms, direction="fwd"):
    return flops.tflops(flops.attention(b, s, s, h, d, causal, direction), ms)


def inputs(seq, d, dtype=torch.bfloat16):
    b = max(1, TOKENS // seq)
    return [torch.randn(b, seq, HEADS, d, device="cuda", dtype=dtype) for _ in range(3)]


def best_of_rounds(fns):
    """{name: ms}: the implementations timed in turns, each keeping its best round."""
    timer = measure.Timer("cuda", rounds=2, warmup=5, turn_ms=100, reduce="min")
    return dict(zip(fns, timer(*fns.values())))


# A configuration measured next to the shipped one in every row, to decide the next default.
# (At hdim 64, 192x160 and 192x192 tiles spill registers with three consumer warpgroups.)
CANDIDATE = {
    (128, False): dict(tile_n=128, persistent=True),
    (128, True): dict(lpt=False),
    (64, False): dict(persistent=False),
    (64, True): dict(persistent=True),
}


def check_against_fa4(q, k, v, causal, out, lse):
    ref_out, ref_lse = fa4_backend.forward(q, k, v, causal, None)
    d_out = (out.float() - ref_out.float()).abs().max().item()
    d_lse = (lse - ref_lse).abs().max().item()
    # Two bf16 kernels on the same inputs: differences stay at bf16 rounding of O (|O| < ~4).
    if not (d_out < 2e-2 and d_lse < 1e-3):
        raise RuntimeError(f"ringfa4 disagrees with FA4: max |dO|={d_out:.3e}, |dlse|={d_lse:.3e}")
    return d_out


def kernel_table(args, meta, rows):
    seqs = SEQS[:3] if args.quick else SEQS
    for d in (128, 64):
        for causal in (False, True):
            cand = configs.fwd_variant("bf16", d, causal, **CANDIDATE[(d, causal)])
            for seq in seqs:
                q, k, v = inputs(seq, d)
                b = q.shape[0]
                out, lse = cute_backend.forward(q, k, v, causal, None)
                diff = check_against_fa4(q, k, v, causal, out, lse)
                fns = dict(
                    ours=lambda: cute_backend.forward(q, k, v, causal, None, out=out, lse=lse),
                    fa4=lambda: fa4_backend.forward(q, k, v, causal, None),
                    cudnn=lambda: measure.sdpa(*measure.sdpa_layout(q, k, v), causal),
                )
                try:
                    o2, l2 = cute_backend.forward(q, k, v, causal, None, config=cand)
                    check_against_fa4(q, k, v, causal, o2, l2)
                    fns["cand"] = lambda: cute_backend.forward(q, k, v, causal, None, out=o2,
                                                               lse=l2, config=cand)
                except Exception as e:  # a broken candidate must not hide the shipped numbers
                    print(f"candidate {cand.name} failed: {e}", flush=True)
                ms = best_of_rounds(fns)
                tf = {name: round(tflops(b, seq, HEADS, d, causal, t), 1) for name, t in ms.items()}
                row = dict(
                    meta, direction="fwd", dtype="bf16", hdim=d, seq=seq, causal=causal,
                    ringfa4_tflops=tf["ours"], fa4_tflops=tf["fa4"], cudnn_tflops=tf["cudnn"],
                    config=forward_config(q, k, causal).name,
                    candidate_tflops=tf.get("cand"), candidate_config=cand.name,
                    max_abs_diff_vs_fa4=diff,
                )
                rows.add(row)
                del q, k, v, out, lse, fns


def check_close(what, ours, ref):
    """Max |difference| of matching tensors, after checking it is bf16 rounding of the largest value."""
    diff = max((a.float() - r.float()).abs().max().item() for a, r in zip(ours, ref, strict=True))
    scale = max(r.float().abs().max().item() for r in ref)
    # Two bf16 kernels on the same inputs: differences stay at bf16 rounding of the results.
    if not diff <= 2e-2 * scale:
        raise RuntimeError(f"{what}: max |diff|={diff:.3e}, max |ref|={scale:.3e}")
    return diff


def bwd_table(args, meta, rows, d=128):
    from flash_attn.cute.interface import _flash_attn_bwd

    seqs = SEQS[:3] if args.quick else SEQS
    for causal in (False, True):
        for seq in seqs:
            q, k, v = inputs(seq, d)
            dout = torch.randn_like(q)
            b = q.shape[0]
            out, lse = fa4_backend.forward(q, k, v, causal, None)

            def ours(det):
                return cute_backend.backward(dout, q, k, v, out, lse, causal, None,
                                             deterministic=det)

            def fa4(det):
                return _flash_attn_bwd(q, k, v, out, dout, lse, softmax_scale=d ** -0.5,
                                       causal=causal, deterministic=det)[:3]

            ref = fa4(False)
            diff = max(check_close(f"ringfa4 backward (deterministic={det}) vs FA4", ours(det), ref)
                       for det in (False, True))
            leaves = [t.detach().requires_grad_() for t in measure.sdpa_layout(q, k, v)]
            o = measure.sdpa(*leaves, causal)
            dot = dout.transpose(1, 2)
            times = best_of_rounds(dict(
                ringfa4=lambda: ours(False), ringfa4_det=lambda: ours(True),
                fa4=lambda: fa4(False), fa4_det=lambda: fa4(True),
                cudnn=lambda: torch.autograd.grad(o, leaves, dot, retain_graph=True)))
            row = dict(meta, direction="bwd", dtype="bf16", hdim=d, seq=seq, causal=causal,
                       **{f"{k_}_tflops": round(tflops(b, seq, HEADS, d, causal, ms, "bwd"), 1)
                          for k_, ms in times.items()},
                       max_abs_diff_vs_fa4=diff)
            rows.add(row)
            del q, k, v, dout, out, lse, leaves, o


def bwd_markdown(rows):
    out = ["", "Backward, bf16 (TFLOP/s, FLOPs 2.5x forward; det = deterministic mode):", "",
           "| hdim | causal | seq | ringfa4 | ringfa4 det | FA4 | FA4 det | cuDNN | ringfa4/FA4 "
           "| ringfa4/cuDNN | det/default |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(
            f"| {r['hdim']} | {r['causal']} | {r['seq']} | {r['ringfa4_tflops']} | "
            f"{r['ringfa4_det_tflops']} | {r['fa4_tflops']} | {r['fa4_det_tflops']} | "
            f"{r['cudnn_tflops']} | {r['ringfa4_tflops'] / r['fa4_tflops']:.2f} | "
            f"{r['ringfa4_tflops'] / r['cudnn_tflops']:.2f} | "
            f"{r['ringfa4_det_tflops'] / r['ringfa4_tflops']:.2f} |")
    return "\n".join(out)


TECHNIQUES = [
    ("all on (shipped)", {}),
    ("no ping-pong", dict(pingpong=False)),
    ("no intra-WG overlap", dict(intra_wg_overlap=False)),
    ("rescale always", dict(rescale_threshold=None)),
    ("exp2 on FMA 2/16", dict(ex2_fma_per16=2)),
    ("exp2 on FMA 4/16", dict(ex2_fma_per16=4)),
    ("LPT off", dict(lpt=False)),
    ("persistent", dict(persistent=True)),
    ("tile 128x176", dict(tile_n=176)),
    ("persistent, tile 128x176", dict(persistent=True, tile_n=176)),
]


def technique_table(args, meta, rows, seq=8192, d=128):
    for causal in (False, True):
        q, k, v = inputs(seq, d)
        b = q.shape[0]
        for label, flags in TECHNIQUES:
            if "lpt" in flags and not causal:
                continue
            cfg = configs.fwd_variant("bf16", d, causal, **flags)
            try:
                out, lse = cute_backend.forward(q, k, v, causal, None, config=cfg)
                check_against_fa4(q, k, v, causal, out, lse)
            except Exception as e:
                print(f"{cfg.name} failed: {e}", flush=True)
                continue
            ms = best_of_rounds(dict(
                ours=lambda: cute_backend.forward(q, k, v, causal, None, out=out, lse=lse, config=cfg),
                fa4=lambda: fa4_backend.forward(q, k, v, causal, None),
            ))
            row = dict(meta, seq=seq, hdim=d, causal=causal, variant=label, config=cfg.name,
                       tflops=round(tflops(b, seq, HEADS, d, causal, ms["ours"]), 1),
                       fa4_tflops=round(tflops(b, seq, HEADS, d, causal, ms["fa4"]), 1))
            rows.add(row)


def sass_report(out_dir):
    """Registers/spills (ptxas -v) and HGMMA count in SASS (cuobjdump) of the shipped kernels."""
    os.makedirs(out_dir, exist_ok=True)
    lines = []
    for v in configs.VARIANTS:
        if v.dtype != "bf16" or not v.name.startswith("fwd_"):
            continue
        opts = f"--keep-ptx --keep-cubin --dump-dir {out_dir}"
        fn = kc.compile_variant(v, options=opts)
        ptx_path = os.path.join(out_dir, v.name + ".ptx")
        with open(ptx_path, "w") as f:
            f.write(fn.__ptx__)
        cubin_path = os.path.join(out_dir, v.name + ".cubin")
        cubin = fn.__cubin__
        with open(cubin_path, "wb") as f:
            f.write(cubin if isinstance(cubin, bytes) else cubin.encode("latin-1"))
        ptxas = subprocess.run([shutil.which("ptxas") or "/usr/local/cuda/bin/ptxas", "-arch=sm_90a",
                                "-v", "-o", os.devnull, ptx_path], capture_output=True, text=True)
        info = " ".join(re.findall(r"(Used \d+ registers|\d+ bytes spill \w+)", ptxas.stderr))
        sass = subprocess.run(["cuobjdump", "-sass", cubin_path], capture_output=True, text=True).stdout
        hgmma = len(re.findall(r"\bHGMMA\.", sass))
        lines.append(f"{v.name}: {info}; SASS HGMMA instructions: {hgmma}")
    return lines


def markdown(rows, techniques, meta):
    out = [f"Device: {meta['device']}, date {meta['date']}, commit {meta['commit']}.", "",
           "| hdim | causal | seq | ringfa4 | FA4 | cuDNN | ringfa4/FA4 | ringfa4/cuDNN "
           "| candidate | candidate/FA4 |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cand = r.get("candidate_tflops")
        out.append(
            f"| {r['hdim']} | {r['causal']} | {r['seq']} | {r['ringfa4_tflops']} | {r['fa4_tflops']} | "
            f"{r['cudnn_tflops']} | {r['ringfa4_tflops'] / r['fa4_tflops']:.2f} | "
            f"{r['ringfa4_tflops'] / r['cudnn_tflops']:.2f} | {cand} | "
            f"{'-' if cand is None else format(cand / r['fa4_tflops'], '.2f')} |")
    if techniques:
        out += ["", "Techniques, bf16 hdim 128 seq 8k (TFLOP/s; FA4 in the same run):", "",
                "| variant | causal | TFLOP/s | vs shipped | FA4 |", "|---|---|---|---|---|"]
        base = {r["causal"]: r["tflops"] for r in techniques if r["variant"] == "all on (shipped)"}
        for r in techniques:
            out.append(f"| {r['variant']} | {r['causal']} | {r['tflops']} | "
                       f"{r['tflops'] / base[r['causal']]:.3f} | {r['fa4_tflops']} |")
    return "\n".join(out)


# ---------------------------------------------------------------- user level (--mode user)

# Ring-step shapes, batch 1, 32/8 heads, hdim 128: a rank's steps at W = 32 (2k x 4k and 4k x 2k
# blocks) and W = 8 with 128k tokens (8k x 16k, 16k x 8k), and the causal diagonal blocks.
RING_STEPS = ((2048, 4096, False), (4096, 2048, False), (8192, 16384, False), (16384, 8192, False),
              (2048, 2048, True), (4096, 4096, True))
USER_SIZES = dict(tokens=TOKENS, seqs=SEQS, heads=((16, 16), (32, 8)), steps=RING_STEPS, step_heads=(32, 8),
                  step_hdim=128)
# --smoke: the same walk at CPU sizes.
SMOKE_SIZES = dict(tokens=128, seqs=(32, 64), heads=((2, 2), (4, 2)), steps=((32, 64, False), (64, 32, False),
                   (32, 32, True)), step_heads=(4, 2), step_hdim=16)
PASSES = {"fwd": "fwd", "fwd_bwd": "fwd+bwd", "bwd": "bwd"}  # row prefix -> ringfa4.flops direction


@dataclass(frozen=True)
class Case:
    shape: str  # "grid" or "ring-step"
    batch: int
    seq_q: int
    seq_k: int
    heads: int
    kv_heads: int
    hdim: int
    causal: bool

    def flops(self, prefix):
        return flops.attention(self.batch, self.seq_q, self.seq_k, self.heads, self.hdim, self.causal,
                               PASSES[prefix])


def user_cases(sizes, shapes, hdims):
    """Ring-step shapes first, then the grid by head dim: a run cut short keeps the first ones."""
    cases = []
    if "ring-step" in shapes:
        cases += [Case("ring-step", 1, sq, sk, *sizes["step_heads"], sizes["step_hdim"], causal)
                  for sq, sk, causal in sizes["steps"]]
    if "grid" in shapes:
        cases += [Case("grid", sizes["tokens"] // seq, seq, seq, h, hk, d, causal)
                  for d in hdims for h, hk in sizes["heads"] for causal in (False, True) for seq in sizes["seqs"]]
    return cases


class Contender:
    """One attention as a user calls it: ``attn`` maps ``leaves`` to out; ``to_qkv`` maps (out,
    grads) back to ringfa4's (b, s, h, d) layout and k/v heads, for the correctness check."""

    def __init__(self, attn, leaves, dout, to_qkv=lambda out, grads: (out, *grads)):
        self.attn, self.leaves, self.dout, self.to_qkv = attn, leaves, dout, to_qkv

    def forward(self):
        with torch.no_grad():
            return self.attn(*self.leaves)

    def forward_backward(self):
        out = self.attn(*self.leaves)
        return out, torch.autograd.grad(out, self.leaves, self.dout)

    def results(self):
        return self.to_qkv(*self.forward_backward())


def sdpa_contender(q, k, v, dout, causal):
    """cuDNN SDPA on (b, h, s, d) views, k/v heads repeated before timing; its k/v gradients are
    summed back over the repeats for the check."""
    group = q.shape[2] // k.shape[2]
    leaves = [t.detach().requires_grad_() for t in measure.sdpa_layout(q, k, v)]

    def to_qkv(out, grads):
        dq, dk, dv = (g.transpose(1, 2) for g in grads)
        b, s, h, d = dk.shape
        return (out.transpose(1, 2), dq, *(g.reshape(b, s, h // group, group, d).sum(3) for g in (dk, dv)))

    return Contender(lambda *qkv: measure.sdpa(*qkv, causal), leaves, dout.transpose(1, 2), to_qkv)


def user_contenders(q, k, v, dout, causal, backend):
    """({name: Contender}, {name: why it cannot run}): ringfa4's public API, FA4's autograd
    function, cuDNN SDPA. A comparator that fails is reported in the row, never ringfa4."""
    fresh = lambda: [t.detach().clone().requires_grad_() for t in (q, k, v)]  # noqa: E731
    found = dict(ringfa4=Contender(lambda *qkv: ringfa4.attention(*qkv, causal=causal, backend=backend)[0],
                                   fresh(), dout))
    errors = {}
    reason = fa4_backend.unsupported_reason(q, k, v, causal, True)
    if reason is None:
        found["fa4"] = Contender(lambda *qkv: measure.fa4_attention(*qkv, causal), fresh(), dout)
    else:
        errors["fa4"] = reason
    found["sdpa"] = sdpa_contender(q, k, v, dout, causal)
    return found, errors


def checked_results(found, errors):
    """{name: max |diff| vs ringfa4 of out, dq, dk, dv}; drops (into ``errors``) a comparator that raises."""
    ours = found["ringfa4"].results()
    diffs = {}
    for name in [n for n in found if n != "ringfa4"]:
        try:
            theirs = found[name].results()
        except Exception as e:  # reported in the row and the table
            errors[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            del found[name]
            continue
        diffs[name] = check_close(f"ringfa4 vs {name} (out, dq, dk, dv)", ours, theirs)
    return diffs


def backward_fns(q, k, v, dout, causal, backend):
    """ringfa4's backward alone, default and deterministic, from one (out, lse), both checked."""
    module, scale = backends.get(backend), q.shape[-1] ** -0.5
    out, lse = module.forward(q, k, v, causal, scale)

    def bwd(det):
        return module.backward(dout, q, k, v, out, lse, causal, scale, deterministic=det)

    check_close("ringfa4 deterministic backward vs default", bwd(True), bwd(False))
    return {("bwd", "ringfa4"): lambda: bwd(False), ("bwd", "ringfa4_det"): lambda: bwd(True)}


def user_row(case, args, meta, timer, device, dtype, seed):
    gen = torch.Generator(device=device).manual_seed(seed)
    q, dout = (torch.randn(case.batch, case.seq_q, case.heads, case.hdim, device=device, dtype=dtype, generator=gen)
               for _ in range(2))
    k, v = (torch.randn(case.batch, case.seq_k, case.kv_heads, case.hdim, device=device, dtype=dtype, generator=gen)
            for _ in range(2))
    found, errors = user_contenders(q, k, v, dout, case.causal, args.backend)
    diffs = checked_results(found, errors)
    fns = {("fwd", n): c.forward for n, c in found.items()}
    fns |= {("fwd_bwd", n): c.forward_backward for n, c in found.items()}
    fns |= backward_fns(q, k, v, dout, case.causal, args.backend)
    row = dict(meta, mode="user", **vars(case), dtype=str(dtype).split(".")[-1], backend=args.backend)
    for (prefix, name), ms in zip(fns, timer(*fns.values())):
        row[f"{prefix}_{name}_ms"] = round(ms, 4)
        row[f"{prefix}_{name}_tflops"] = float(f"{flops.tflops(case.flops(prefix), ms):.4g}")
    row["det_vs_default"] = round(row["bwd_ringfa4_ms"] / row["bwd_ringfa4_det_ms"], 3)
    row["max_abs_diff_vs"] = {n: float(f"{d:.3g}") for n, d in diffs.items()}
    row.update({f"{n}_error": e for n, e in errors.items()})
    return row


def user_table(args, meta, rows):
    device, dtype = ("cpu", torch.float32) if args.smoke else ("cuda", torch.bfloat16)
    if args.smoke:
        torch.set_num_threads(1)  # tiny shapes: threads only contend
    timer = measure.Timer(device, rounds=args.rounds, warmup=args.warmup, turn_ms=args.turn_ms, reduce="min")
    cases = user_cases(SMOKE_SIZES if args.smoke else USER_SIZES, args.shapes.split(","),
                       [int(d) for d in args.hdims.split(",")])
    start = time.perf_counter()
    for i, case in enumerate(cases):
        print(f"[{i + 1}/{len(cases)}, {time.perf_counter() - start:.0f} s] {case}", flush=True)
        rows.add(user_row(case, args, meta, timer, device, dtype, seed=i))
        if device == "cuda":
            torch.cuda.empty_cache()


def _ratio(row, prefix, a, b):
    """Speed of a over b (same FLOPs): b's time / a's; None where b did not run."""
    x, y = row.get(f"{prefix}_{a}_ms"), row.get(f"{prefix}_{b}_ms")
    return None if x is None or y is None else y / x


def _geomean(values):
    values = [x for x in values if x is not None]
    return f"{math.exp(sum(map(math.log, values)) / len(values)):.3f} (min {min(values):.2f})" if values else "-"


def user_markdown(rows, meta):
    sdpa = "cuDNN" if meta["device"] != "cpu" else "SDPA (CPU)"
    fmt = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
    out = [f"User level ({rows[0]['backend'] if rows else '-'} via ringfa4.attention), {meta['device']}, "
           f"commit {meta['commit']}: TFLOP/s, best of rounds; fwd under no_grad, fwd+bwd through autograd; "
           "det/default = ringfa4 backward alone, default time / deterministic time.", "",
           f"| shape | batch | q x kv | heads | hdim | causal | fwd ringfa4 | fwd FA4 | fwd {sdpa} | fwd /FA4 "
           f"| fwd+bwd ringfa4 | fwd+bwd FA4 | fwd+bwd {sdpa} | fwd+bwd /FA4 | fwd+bwd /{sdpa} | det/default |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cells = [r["shape"], r["batch"], f"{r['seq_q']} x {r['seq_k']}", f"{r['heads']}/{r['kv_heads']}", r["hdim"],
                 r["causal"]]
        cells += [r.get(f"fwd_{n}_tflops", "-") for n in ("ringfa4", "fa4", "sdpa")]
        cells += [fmt(_ratio(r, "fwd", "ringfa4", "fa4"))]
        cells += [r.get(f"fwd_bwd_{n}_tflops", "-") for n in ("ringfa4", "fa4", "sdpa")]
        cells += [fmt(_ratio(r, "fwd_bwd", "ringfa4", n)) for n in ("fa4", "sdpa")] + [f"{r['det_vs_default']:.2f}"]
        out.append("| " + " | ".join(str(c) for c in cells) + " |")
    out.append("")
    for shape in ("grid", "ring-step"):
        mine = [r for r in rows if r["shape"] == shape]
        if not mine:
            continue
        out.append(f"{shape}: geometric mean ringfa4/FA4 fwd {_geomean(_ratio(r, 'fwd', 'ringfa4', 'fa4') for r in mine)}, "
                   f"fwd+bwd {_geomean(_ratio(r, 'fwd_bwd', 'ringfa4', 'fa4') for r in mine)}; ringfa4/{sdpa} fwd+bwd "
                   f"{_geomean(_ratio(r, 'fwd_bwd', 'ringfa4', 'sdpa') for r in mine)}; det/default "
                   f"{_geomean(r['det_vs_default'] for r in mine)}")
    errors = sorted({f"{k}: {v}" for r in rows for k, v in r.items() if k.endswith("_error")})
    return "\n".join(out + [f"not compared: {e}" for e in errors])


def parse_args():
    p = measure.parser(__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=("kernel", "user"), default="kernel",
                   help="kernel: the backends' entry points; user: ringfa4.attention vs flash_attn_func vs SDPA")
    p.add_argument("--quick", action="store_true", help="kernel mode: seq 1k..4k only")
    p.add_argument("--no-techniques", action="store_true", help="kernel mode: skip the technique on/off rows")
    p.add_argument("--sass", metavar="DIR", help="kernel mode: also report registers/spills and SASS HGMMA")
    p.add_argument("--direction", choices=("fwd", "bwd", "both"), default="both", help="kernel mode")
    p.add_argument("--smoke", action="store_true", help="user mode on CPU: tiny shapes, torch backend, float32")
    p.add_argument("--backend", default=None, help="user mode: ringfa4 backend (default cute, torch with --smoke)")
    p.add_argument("--shapes", default="ring-step,grid", help="user mode: which shape lists to run")
    p.add_argument("--hdims", default=None, help="user mode: head dims of the grid (default 128,64; 16 smoke)")
    p.add_argument("--rounds", type=int, default=None, help="user mode: timed rounds, best kept (default 8, 1 smoke)")
    p.add_argument("--warmup", type=int, default=None, help="user mode: warm-up calls of each (default 2, 1 smoke)")
    p.add_argument("--turn-ms", type=float, default=None,
                   help="user mode: back-to-back calls fill this per turn (default 25, 1 smoke)")
    args = p.parse_args()
    if args.smoke and args.mode != "user":
        p.error("--smoke runs the user mode only (--mode user)")
    defaults = (("backend", "cute", "torch"), ("hdims", "128,64", "16"), ("rounds", 8, 1), ("warmup", 2, 1),
                ("turn_ms", 25.0, 1.0))
    for name, full, smoke in defaults:
        if getattr(args, name) is None:
            setattr(args, name, smoke if args.smoke else full)
    if not set(args.shapes.split(",")) <= {"ring-step", "grid"}:
        p.error(f"--shapes must be a comma list of ring-step and grid, got {args.shapes!r}")
    if not all(d.isdigit() for d in args.hdims.split(",")):
        p.error(f"--hdims must be a comma list of head dims, got {args.hdims!r}")
    measure.check_output_args(p, args, args.smoke)
    return args


def main():
    args = parse_args()
    if not args.smoke:
        reason = fa4_backend.unsupported_reason(*inputs(128, 128)[:3], False, True)
        if reason:
            sys.exit(f"FA4 anchor unavailable: {reason}")
    meta = measure.metadata("cpu" if args.smoke else "cuda", args.commit)
    out_dir = measure.output_dir(args)
    if args.mode == "user":
        rows = measure.Rows(out_dir / "kernels_user.json")
        user_table(args, meta, rows)
        print(user_markdown(rows, meta))
        print(f"wrote {rows.path}")
        return
    rows, techniques = measure.Rows(out_dir / "kernels.json"), measure.Rows(out_dir / "kernels_techniques.json")
    if args.direction != "bwd":
        kernel_table(args, meta, rows)
        if not args.no_techniques:
            technique_table(args, meta, techniques)
    fwd_rows = list(rows)
    if args.direction != "fwd":
        bwd_table(args, meta, rows)
    if args.sass:
        print("\n".join(sass_report(args.sass)))
    print(markdown(fwd_rows, techniques, meta))
    if len(rows) > len(fwd_rows):
        print(bwd_markdown(rows[len(fwd_rows):]))


if __name__ == "__main__":
    main()
