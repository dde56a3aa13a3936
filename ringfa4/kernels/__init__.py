"""Our CuTe DSL attention kernels for Hopper (sm_90a).

The DSL reads its target architecture once, when cutlass is first used, and without a GPU it
would silently target sm_100a; these kernels are built for sm_90a only, so that is pinned here
(before any submodule imports cutlass: the DSL reads it on import) unless the caller chose one.
ringfa4.backends.cute reaches this package only through its launch module, on the first launch,
after checking the GPU is sm_90; the compile CLI is `python -m ringfa4.kernels`.
"""
import os

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
