"""The kernels' element types by the short names their configurations use."""
import cutlass
from cutlass import Float32

CUTLASS_DTYPES = {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16, "fp32": Float32}
