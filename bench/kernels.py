"""Forward attention kernels side by side in one process on one GPU: ringfa4 (backend "cute")
vs upstream FA4 (flash_attn.cute) vs cuDNN SDPA, plus the on/off table of our techniques.
Backward rows (direction "bwd", hdim 128, FLOPs 2.5x forward) time the same three backward
passes from the same (out, lse), plus ringfa4 and FA4 in deterministic mode.

    python bench/kernels.py --commit $(git rev-parse --short HEAD) [--quick] [--sass DIR] [--record]

bf16, 16 heads, 32k tokens per batch (batch = 32768 // seq), FLOPs from ringfa4.flops
(4*b*s*s*h*d, halved for causal; backward 2.5x). The implementations of a row take turns
(bench/measure.py Timer): 5 warm-up calls, then 2 rounds in which each makes back-to-back calls
filling ~100 ms between CUDA events; each keeps its best round. Forward rows also time a
candidate configuration (CANDIDATE). Rows go to kernels.json (and kernels_techniques.json) in a
temporary directory, --out-dir DIR, or with --record bench/results/; markdown tables are printed
last. Each ringfa4 timing is preceded by a check that its output matches FA4's, so nothing wrong
is timed.
"""
import os
import re
import shutil
import subprocess
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import ringfa4.backends.cute as cute_backend  # noqa: E402
import ringfa4.backends.fa4 as fa4_backend  # noqa: E402
from bench import measure  # noqa: E402
from ringfa4 import flops  # noqa: E402
from ringfa4.kernels import compile as kc  # noqa: E402

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
            cand = kc.fwd_variant("bf16", d, causal, **CANDIDATE[(d, causal)])
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
                    config=kc.fwd_defaults("bf16", d, causal).name,
                    candidate_tflops=tf.get("cand"), candidate_config=cand.name,
                    max_abs_diff_vs_fa4=diff,
                )
                rows.add(row)
                del q, k, v, out, lse, fns


def check_bwd_against_fa4(ours, ref):
    diff = max((a.float() - r.float()).abs().max().item() for a, r in zip(ours, ref))
    scale = max(r.float().abs().max().item() for r in ref)
    # Two bf16 kernels on the same inputs: differences stay at bf16 rounding of the gradients.
    if not diff <= 2e-2 * scale:
        raise RuntimeError(f"ringfa4 backward disagrees with FA4: max |diff|={diff:.3e}, "
                           f"max |grad|={scale:.3e}")
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
            diff = max(check_bwd_against_fa4(ours(det), ref) for det in (False, True))
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
            cfg = kc.fwd_variant("bf16", d, causal, **flags)
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
    for v in kc.VARIANTS:
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


def main():
    p = measure.parser(__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="seq 1k..4k only")
    p.add_argument("--no-techniques", action="store_true")
    p.add_argument("--sass", metavar="DIR", help="also report registers/spills and SASS HGMMA")
    p.add_argument("--direction", choices=("fwd", "bwd", "both"), default="both")
    args = p.parse_args()
    measure.check_output_args(p, args, smoke=False)
    reason = fa4_backend.unsupported_reason(*inputs(128, 128)[:3], False, False)
    if reason:
        sys.exit(f"FA4 anchor unavailable: {reason}")
    meta = measure.metadata("cuda", args.commit)
    out_dir = measure.output_dir(args)
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
