"""Compile every shipped kernel variant (ringfa4.backends.cute.configs.VARIANTS), no GPU needed:

    python -m ringfa4.kernels --arch sm_90a --dump DIR [--only REGEX] [--sass [--compare OLD_DIR]]

writes DIR/<variant>.ptx and prints one line per variant: name, compile seconds, how many wgmma
/ TMA instructions its PTX holds and, with ptxas on PATH, the spill bytes ptxas reports for it
(a warp-specialized kernel spills where a role outgrows its setmaxnreg budget: a few bytes cost
the deterministic backward 3-7% at head dim 128, bench/RESULTS.md, "Rotation in groups"). With
--sass (nvdisasm on PATH, from the CUDA toolkit) it also writes DIR/<variant>.sass, the
disassembly of the cubin the DSL built, and prints the length of its main loop
(ringfa4.kernels.sass); with --compare, how many of the loop's instructions moved against
OLD_DIR's .sass of the same variant: dump the tree before a kernel change, then after, and time
only what ptxas did not reschedule by accident.
"""
import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile

from ringfa4.kernels import sass


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m ringfa4.kernels", description=__doc__.split("\n")[0])
    parser.add_argument("--arch", default="sm_90a", choices=["sm_90a"], help="target architecture")
    parser.add_argument("--dump", required=True, metavar="DIR", help="folder for one .ptx per variant")
    parser.add_argument("--only", default="", metavar="REGEX",
                        help="compile only variants whose name matches this (re.search)")
    parser.add_argument("--sass", action="store_true", help="also write and summarize each variant's SASS")
    parser.add_argument("--compare", metavar="OLD_DIR", help="with --sass: main loops against OLD_DIR's")
    args = parser.parse_args(argv)
    if args.compare and not args.sass:
        parser.error("--compare needs --sass")
    nvdisasm, ptxas = shutil.which("nvdisasm"), shutil.which("ptxas")
    if args.sass and nvdisasm is None:
        parser.error("--sass needs nvdisasm (CUDA toolkit) on PATH")
    # Must be set before cutlass is imported: without a GPU the DSL would target sm_100a.
    os.environ["CUTE_DSL_ARCH"] = args.arch

    from ringfa4.backends.cute import compile as kc
    from ringfa4.backends.cute.configs import VARIANTS

    os.makedirs(args.dump, exist_ok=True)
    variants = [v for v in VARIANTS if re.search(args.only, v.name)]
    if not variants:
        parser.error(f"no shipped variant matches --only {args.only!r}")
    with tempfile.TemporaryDirectory() as scratch:
        options = f"--keep-ptx {'--keep-cubin ' if args.sass else ''}--dump-dir {scratch}"
        for v in variants:
            fn = kc.compile_variant(v, options=options)
            ptx = fn.__ptx__
            path = os.path.join(args.dump, v.name + ".ptx")
            with open(path, "w") as f:
                f.write(ptx)
            secs = kc.compile_seconds[(v, kc.ARCH, options)]
            line = (f"{v.name}  {secs:6.1f} s  wgmma={ptx.count('wgmma.mma_async')} "
                    f"tma={ptx.count('cp.async.bulk.tensor')}  -> {path}")
            if ptxas:
                line += "  " + _spills(ptxas, args.arch, path)
            if args.sass:
                line += "  " + _sass(nvdisasm, fn.__cubin__, os.path.join(args.dump, v.name + ".sass"),
                                     args.compare and os.path.join(args.compare, v.name + ".sass"))
            print(line, flush=True)
    return 0


def _spills(ptxas, arch, ptx_path):
    """Spill stores / loads in bytes that ptxas reports for the PTX at ptx_path."""
    with tempfile.TemporaryDirectory() as scratch:
        report = subprocess.run([ptxas, f"-arch={arch}", "-v", "-o", os.path.join(scratch, "k.cubin"), ptx_path],
                                capture_output=True, text=True, check=True).stderr
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    return f"spills={sum(int(s) for s, _ in spills)}/{sum(int(l) for _, l in spills)} B"


def _sass(nvdisasm, cubin, path, old_path):
    """Disassemble ``cubin`` (the DSL gives its bytes or the path it kept it at) into ``path``;
    the main loop's length, and its moves against old_path."""
    if isinstance(cubin, bytes):
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(cubin)
            f.flush()
            return _sass(nvdisasm, f.name, path, old_path)
    text = subprocess.run([nvdisasm, "-c", cubin], capture_output=True, text=True, check=True).stdout
    with open(path, "w") as f:
        f.write(text)
    loop = sass.main_loop(text)
    summary = f"loop={len(loop)}"
    if old_path:
        if not os.path.exists(old_path):
            return summary + " (no old SASS)"
        with open(old_path) as f:
            old = sass.main_loop(f.read())
        summary += f" moved={sass.moved(old, loop)}"
    return summary


if __name__ == "__main__":
    sys.exit(main())
