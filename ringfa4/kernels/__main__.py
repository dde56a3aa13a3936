"""Compile every shipped kernel variant (ringfa4.backends.cute.configs.VARIANTS), no GPU needed:

    python -m ringfa4.kernels --arch sm_90a --dump DIR [--only REGEX]

writes DIR/<variant>.ptx and prints one line per variant: name, compile seconds, and how many
wgmma / TMA instructions its PTX holds.
"""
import argparse
import os
import re
import sys
import tempfile


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m ringfa4.kernels", description=__doc__.split("\n")[0])
    parser.add_argument("--arch", default="sm_90a", choices=["sm_90a"], help="target architecture")
    parser.add_argument("--dump", required=True, metavar="DIR", help="folder for one .ptx per variant")
    parser.add_argument("--only", default="", metavar="REGEX",
                        help="compile only variants whose name matches this (re.search)")
    args = parser.parse_args(argv)
    # Must be set before cutlass is imported: without a GPU the DSL would target sm_100a.
    os.environ["CUTE_DSL_ARCH"] = args.arch

    from ringfa4.backends.cute import compile as kc
    from ringfa4.backends.cute.configs import VARIANTS

    os.makedirs(args.dump, exist_ok=True)
    variants = [v for v in VARIANTS if re.search(args.only, v.name)]
    if not variants:
        parser.error(f"no shipped variant matches --only {args.only!r}")
    with tempfile.TemporaryDirectory() as scratch:
        for v in variants:
            fn = kc.compile_variant(v, options=f"--keep-ptx --dump-dir {scratch}")
            ptx = fn.__ptx__
            path = os.path.join(args.dump, v.name + ".ptx")
            with open(path, "w") as f:
                f.write(ptx)
            secs = kc.compile_seconds[(v, kc.ARCH, f"--keep-ptx --dump-dir {scratch}")]
            print(f"{v.name}  {secs:6.1f} s  wgmma={ptx.count('wgmma.mma_async')} "
                  f"tma={ptx.count('cp.async.bulk.tensor')}  -> {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
