"""Inline PTX for the instructions the DSL does not expose, through one wrapper."""
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op


def inline_asm(result_type, operands, asm: str, constraints: str, side_effects: bool = False):
    """One inline PTX statement (AT&T operand syntax). Without side effects ptxas may schedule,
    merge or drop it like any arithmetic instruction."""
    return llvm.inline_asm(
        result_type, operands, asm, constraints,
        has_side_effects=side_effects, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
    )


@dsl_user_op
def cvt_pair(a: Float32, b: Float32, to_bf16: bool, *, loc=None, ip=None) -> Int32:
    """Two fp32 values rounded to one packed bf16x2/f16x2 register (a in the low half)."""
    return Int32(inline_asm(
        T.i32(), [Float32(a).ir_value(loc=loc, ip=ip), Float32(b).ir_value(loc=loc, ip=ip)],
        f"cvt.rn.{'bf16x2' if to_bf16 else 'f16x2'}.f32 $0, $2, $1;", "=r,f,f",
    ))


@cute.jit
def convert_to(src: cute.Tensor, dst: cute.Tensor):
    """fp32 register tensor -> bf16/fp16 register tensor, two elements per instruction. One
    opaque conversion per pair: a value with several readers is converted once (with .to() the
    compiler may repeat the conversion for a reader past a wgmma fence)."""
    dst_i32 = cute.recast_tensor(dst, Int32)
    to_bf16 = const_expr(dst.element_type is cutlass.BFloat16)
    for i in cutlass.range_constexpr(cute.size(dst_i32)):
        dst_i32[i] = cvt_pair(src[2 * i], src[2 * i + 1], to_bf16)


def _bulk_to_global(instruction: str, gmem_ptr: cute.Pointer, smem_ptr: cute.Pointer, num_bytes: int,
                    loc, ip):
    """One asynchronous bulk copy ``instruction`` from shared memory to global memory, issued
    by the calling thread into its bulk group."""
    inline_asm(
        None,
        [gmem_ptr.toint(loc=loc, ip=ip).ir_value(), smem_ptr.toint(loc=loc, ip=ip).ir_value(),
         Int32(num_bytes).ir_value(loc=loc, ip=ip)],
        f"{instruction} [$0], [$1], $2;", "l,r,r",
        side_effects=True,
    )


@dsl_user_op
def bulk_reduce_add_f32(gmem_ptr: cute.Pointer, smem_ptr: cute.Pointer, num_bytes: int, *,
                        loc=None, ip=None):
    """global[0:n] += shared[0:n] (fp32) as one asynchronous bulk copy of the issuing thread;
    completes with cp.async.bulk.commit_group / wait_group."""
    _bulk_to_global("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32", gmem_ptr, smem_ptr,
                    num_bytes, loc, ip)


@dsl_user_op
def bulk_store(gmem_ptr: cute.Pointer, smem_ptr: cute.Pointer, num_bytes: int, *, loc=None, ip=None):
    """global[0:n] = shared[0:n] as one asynchronous bulk copy of the issuing thread; completes
    like bulk_reduce_add_f32."""
    _bulk_to_global("cp.async.bulk.global.shared::cta.bulk_group", gmem_ptr, smem_ptr, num_bytes, loc, ip)
