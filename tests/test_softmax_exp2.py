"""The exp2 emulation of the softmax (Cody-Waite split + degree-3 polynomial, run on the FMA
pipe in the kernel) stays within 1e-4 relative error: the same fp32 steps replayed in numpy.
tests/gpu/test_fwd_kernel.py measures the compiled instruction sequence on the device."""
import numpy as np

from ringfa4.kernels.softmax import EX2_POLY


def _ex2_fp32_steps(x):
    x = np.maximum(x.astype(np.float32), np.float32(-127.0))
    j = np.floor(x)  # what the add.rm with 1.5*2**23 leaves in the low mantissa bits
    f = (x - j).astype(np.float32)  # exact in fp32
    c1, c2, c3 = (np.float64(np.float32(c)) for c in EX2_POLY)
    p = np.float32(f * c3 + c2)  # each fma rounds once, to fp32
    p = np.float32(p.astype(np.float64) * f + c1)
    p = np.float32(p.astype(np.float64) * f + 1.0)
    return np.ldexp(p.astype(np.float64), j.astype(np.int64))  # exponent add: exact


def test_emulated_exp2_relative_error_is_below_1e4():
    x = np.concatenate([np.linspace(-126.0, 8.0, 2_000_001), -np.random.rand(1_000_000) * 30])
    x = x.astype(np.float32)
    rel = np.abs(_ex2_fp32_steps(x) / np.exp2(x.astype(np.float64)) - 1.0).max()
    assert rel <= 1e-4, rel
    assert rel > 1e-6  # a degree-3 polynomial cannot be exact: the check is live
