"""Inline-PTX helpers for every CuTe DSL kernel: exact fp32 ops, bf16 / e4m3 packing, MMA, raw and async copies."""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint32
from cutlass._mlir import ir
from cutlass._mlir.dialects import llvm
from cutlass._mlir.dialects import vector as mlir_vector
from cutlass.cutlass_dsl import T, dsl_user_op

LOG2E = 1.4426950408889634


def inline_asm(result_type, operands, asm: str, constraints: str, *, side_effects: bool, loc=None, ip=None):
    """One llvm inline-asm op; pure ones are free for the compiler to schedule or drop."""
    return llvm.inline_asm(
        result_type,
        operands,
        asm,
        constraints,
        has_side_effects=side_effects,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc,
        ip=ip,
    )


def _f32(x, loc, ip):
    return Float32(x).ir_value(loc=loc, ip=ip)


def _f32_op(asm: str, *operands: Float32, loc, ip) -> Float32:
    """One side-effect-free instruction `asm` of f32 operands ($1, $2, ...) into an f32 result ($0)."""
    constraints = ",".join(["=f"] + ["f"] * len(operands))
    operands = [_f32(x, loc, ip) for x in operands]
    return Float32(inline_asm(T.f32(), operands, asm, constraints, side_effects=False, loc=loc, ip=ip))


@dsl_user_op
def mul_rn(a: Float32, b: Float32, *, loc=None, ip=None) -> Float32:
    """a * b rounded once, never fused into an FMA (matches torch's separate multiply)."""
    return _f32_op("mul.rn.f32 $0, $1, $2;", a, b, loc=loc, ip=ip)


@dsl_user_op
def add_rn(a: Float32, b: Float32, *, loc=None, ip=None) -> Float32:
    """a + b rounded once, never fused into an FMA (matches torch's separate add)."""
    return _f32_op("add.rn.f32 $0, $1, $2;", a, b, loc=loc, ip=ip)


@dsl_user_op
def mul_add_rn(a: Float32, b: Float32, c: Float32, *, loc=None, ip=None) -> Float32:
    """c + a * b with the product rounded before the add (two roundings, as torch computes it)."""
    return add_rn(c, mul_rn(a, b, loc=loc, ip=ip), loc=loc, ip=ip)


@dsl_user_op
def div_rn(a: Float32, b: Float32, *, loc=None, ip=None) -> Float32:
    """a / b, IEEE round-to-nearest-even, subnormals kept."""
    return _f32_op("div.rn.f32 $0, $1, $2;", a, b, loc=loc, ip=ip)


@dsl_user_op
def fma_rn(a: Float32, b: Float32, c: Float32, *, loc=None, ip=None) -> Float32:
    """a * b + c rounded once (a fused multiply-add)."""
    return _f32_op("fma.rn.f32 $0, $1, $2, $3;", a, b, c, loc=loc, ip=ip)


@dsl_user_op
def rcp_rn(x: Float32, *, loc=None, ip=None) -> Float32:
    """1 / x, IEEE round-to-nearest-even (the bits of div_rn(1, x)), subnormals kept."""
    return _f32_op("rcp.rn.f32 $0, $1;", x, loc=loc, ip=ip)


@dsl_user_op
def rsqrt_approx(x: Float32, *, loc=None, ip=None) -> Float32:
    """1/sqrt(x) by the MUFU unit (what CUDA's rsqrtf and torch.rsqrt use), subnormals kept."""
    return _f32_op("rsqrt.approx.f32 $0, $1;", x, loc=loc, ip=ip)


@dsl_user_op
def rcp_approx(x: Float32, *, loc=None, ip=None) -> Float32:
    """1/x by the MUFU unit (about 1 ulp), subnormals flushed."""
    return _f32_op("rcp.approx.ftz.f32 $0, $1;", x, loc=loc, ip=ip)


@dsl_user_op
def exp2_approx(x: Float32, *, loc=None, ip=None) -> Float32:
    """2^x by the MUFU unit, subnormals flushed."""
    return _f32_op("ex2.approx.ftz.f32 $0, $1;", x, loc=loc, ip=ip)


@dsl_user_op
def cvt_bf16x2(lo: Float32, hi: Float32, *, loc=None, ip=None) -> Uint32:
    """Two fp32 -> two bf16 (RNE; Inf kept, NaN stays NaN) packed in a word, `lo` in the low half."""
    # cvt.bf16x2 puts its first source in the upper half, hence the swapped operands.
    res = inline_asm(
        T.i32(),
        [_f32(lo, loc, ip), _f32(hi, loc, ip)],
        "cvt.rn.bf16x2.f32 $0, $2, $1;",
        "=r,f,f",
        side_effects=False,
        loc=loc,
        ip=ip,
    )
    return Uint32(res)


@dsl_user_op
def bf16_lo(word: Uint32, *, loc=None, ip=None) -> Float32:
    """The fp32 value of the bf16 in the low half of a word (exact)."""
    return (Uint32(word) << 16).bitcast(Float32, loc=loc, ip=ip)


@dsl_user_op
def bf16_hi(word: Uint32, *, loc=None, ip=None) -> Float32:
    """The fp32 value of the bf16 in the high half of a word (exact)."""
    return (Uint32(word) & Uint32(0xFFFF0000)).bitcast(Float32, loc=loc, ip=ip)


@dsl_user_op
def cvt_e4m3x4(a: Float32, b: Float32, c: Float32, d: Float32, *, loc=None, ip=None) -> Uint32:
    """Four fp32 -> four e4m3 bytes (RNE, satfinite), `a` in the lowest byte."""
    # cvt.e4m3x2 puts its first source in the upper byte, hence the swapped operands.
    res = inline_asm(
        T.i32(),
        [_f32(v, loc, ip) for v in (a, b, c, d)],
        "{\n\t.reg .b16 lo, hi;\n\t"
        "cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1;\n\t"
        "cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3;\n\t"
        "mov.b32 $0, {lo, hi};\n\t}",
        "=r,f,f,f,f",
        side_effects=False,
        loc=loc,
        ip=ip,
    )
    return Uint32(res)


@dsl_user_op
def f32_bits(x: Float32, *, loc=None, ip=None) -> Uint32:
    """The bit pattern of an fp32 value."""
    return Float32(x).bitcast(Uint32, loc=loc, ip=ip)


@dsl_user_op
def f32_from_bits(u: Uint32, *, loc=None, ip=None) -> Float32:
    """The fp32 value of a bit pattern."""
    return Uint32(u).bitcast(Float32, loc=loc, ip=ip)


@dsl_user_op
def dsmem_addr(smem_ptr: cute.Pointer, peer: Int32, *, loc=None, ip=None) -> Int32:
    """The shared::cluster address of `smem_ptr` in CTA `peer` of this cluster (mapa)."""
    remote = cute.arch.map_dsmem_ptr(smem_ptr, peer, loc=loc, ip=ip)
    return Int32(remote.toint(loc=loc, ip=ip))


@dsl_user_op
def st_async_remote_f32(
    val: Float32, smem_ptr: cute.Pointer, mbar_ptr: cute.Pointer, peer: Int32, *, loc=None, ip=None
) -> None:
    """Store one fp32 into CTA `peer`'s shared memory, completing 4 bytes on its mbarrier."""
    remote_val = dsmem_addr(smem_ptr, peer, loc=loc, ip=ip)
    remote_mbar = dsmem_addr(mbar_ptr, peer, loc=loc, ip=ip)
    cute.arch.inline_ptx(
        "st.async.shared::cluster.mbarrier::complete_tx::bytes.f32 [{$r0}], {$r1}, [{$r2}];",
        read_only_args=[remote_val, Float32(val), remote_mbar],
        loc=loc,
        ip=ip,
    )


def _ld_v4_pred(op: str, addr: Int64, pred: cutlass.Boolean, loc, ip) -> tuple[Uint32, ...]:
    """`op` (a 16-byte load) of 4 words when `pred`, else zeros without touching memory."""
    # Marked side-effecting so LLVM keeps it after griddepcontrol.wait (and in a poll loop); ptxas still
    # schedules it freely.
    res = inline_asm(
        llvm.StructType.get_literal([T.i32()] * 4),
        [Int64(addr).ir_value(loc=loc, ip=ip), Int32(cutlass.Boolean(pred)).ir_value(loc=loc, ip=ip)],
        "{\n\t.reg .pred p;\n\t"
        "setp.ne.b32 p, $5, 0;\n\t"
        "mov.b32 $0, 0;\n\tmov.b32 $1, 0;\n\tmov.b32 $2, 0;\n\tmov.b32 $3, 0;\n\t"
        f"@p {op} {{$0, $1, $2, $3}}, [$4];\n\t}}",
        "=r,=r,=r,=r,l,r",
        side_effects=True,
        loc=loc,
        ip=ip,
    )
    return tuple(Uint32(llvm.extractvalue(T.i32(), res, [i], loc=loc, ip=ip)) for i in range(4))


@dsl_user_op
def ld_global_v4_pred(addr: Int64, pred: cutlass.Boolean, *, loc=None, ip=None) -> tuple[Uint32, ...]:
    """16 bytes (4 words) from a global address when `pred`, else zeros without touching memory."""
    return _ld_v4_pred("ld.global.v4.b32", addr, pred, loc, ip)


@dsl_user_op
def st_global_b32(addr: Int64, val: Uint32, pred: cutlass.Boolean | None = None, *, loc=None, ip=None) -> None:
    """Store one 32-bit word to a global address when `pred` (None: always)."""
    cute.arch.inline_ptx(
        "st.global.b32 [{$r0}], {$r1};",
        read_only_args=[Int64(addr), Uint32(val)],
        predicate=None if pred is None else cutlass.Boolean(pred),
        loc=loc,
        ip=ip,
    )


@dsl_user_op
def prefetch_l2(addr: Int64, *, loc=None, ip=None) -> None:
    """Bring the 128-byte line of a global address into L2 (no register, no wait)."""
    cute.arch.inline_ptx("prefetch.global.L2 [{$r0}];", read_only_args=[Int64(addr)], loc=loc, ip=ip)


@dsl_user_op
def st_global_v2_b32(
    addr: Int64, lo: Uint32, hi: Uint32, pred: cutlass.Boolean | None = None, *, loc=None, ip=None
) -> None:
    """Store two 32-bit words (8 bytes, 8-byte aligned) to a global address when `pred` (None: always)."""
    cute.arch.inline_ptx(
        "st.global.v2.b32 [{$r0}], {{$r1}, {$r2}};",
        read_only_args=[Int64(addr), Uint32(lo), Uint32(hi)],
        predicate=None if pred is None else cutlass.Boolean(pred),
        loc=loc,
        ip=ip,
    )


@dsl_user_op
def l2_evict_first_policy(*, loc=None, ip=None) -> Int64:
    """An L2 cache policy (createpolicy) that makes every line it touches evict-first."""
    res = inline_asm(
        T.i64(), [], "createpolicy.fractional.L2::evict_first.b64 $0, 1.0;", "=l", side_effects=False, loc=loc, ip=ip
    )
    return Int64(res)


@dsl_user_op
def ld_global_v4_stream(addr: Int64, policy: Int64, *, loc=None, ip=None) -> tuple[Uint32, ...]:
    """16 bytes read once: no L1 allocation, and the L2 lines evict-first under `policy`."""
    # Side-effecting, like ld_global_v4_pred, so that LLVM keeps it after griddepcontrol.wait.
    res = inline_asm(
        llvm.StructType.get_literal([T.i32()] * 4),
        [Int64(addr).ir_value(loc=loc, ip=ip), Int64(policy).ir_value(loc=loc, ip=ip)],
        "ld.global.L1::no_allocate.L2::cache_hint.v4.b32 {$0, $1, $2, $3}, [$4], $5;",
        "=r,=r,=r,=r,l,l",
        side_effects=True,
        loc=loc,
        ip=ip,
    )
    return tuple(Uint32(llvm.extractvalue(T.i32(), res, [i], loc=loc, ip=ip)) for i in range(4))


def _ld_b32_pred(op: str, addr: Int64, pred: cutlass.Boolean, loc, ip) -> Uint32:
    """`op` (a 32-bit load) when `pred`, else 0 without touching memory; no branch (it would end ptxas's block)."""
    res = inline_asm(
        T.i32(),
        [Int64(addr).ir_value(loc=loc, ip=ip), Int32(cutlass.Boolean(pred)).ir_value(loc=loc, ip=ip)],
        f"{{\n\t.reg .pred p;\n\tsetp.ne.b32 p, $2, 0;\n\tmov.b32 $0, 0;\n\t@p {op} $0, [$1];\n\t}}",
        "=r,l,r",
        side_effects=True,
        loc=loc,
        ip=ip,
    )
    return Uint32(res)


@dsl_user_op
def ld_global_b32_pred(addr: Int64, pred: cutlass.Boolean, *, loc=None, ip=None) -> Uint32:
    """One 32-bit word from a global address when `pred`, else 0 without touching memory."""
    return _ld_b32_pred("ld.global.b32", addr, pred, loc, ip)


@dsl_user_op
def ld_relaxed_gpu_b32_pred(addr: Int64, pred: cutlass.Boolean, *, loc=None, ip=None) -> Uint32:
    """One 32-bit word other CTAs of this GPU update (ld.relaxed.gpu: never a stale L1 line) when `pred`, else 0."""
    return _ld_b32_pred("ld.relaxed.gpu.global.b32", addr, pred, loc, ip)


@dsl_user_op
def st_global_v4_b32(
    addr: Int64, w0: Uint32, w1: Uint32, w2: Uint32, w3: Uint32, *, streaming: bool = False, loc=None, ip=None
) -> None:
    """Store four 32-bit words (16 bytes, 16-byte aligned); `streaming` marks them evict-first (st.global.cs)."""
    op = "st.global.cs.v4.b32" if streaming else "st.global.v4.b32"
    cute.arch.inline_ptx(
        op + " [{$r0}], {{$r1}, {$r2}, {$r3}, {$r4}};",
        read_only_args=[Int64(addr), Uint32(w0), Uint32(w1), Uint32(w2), Uint32(w3)],
        loc=loc,
        ip=ip,
    )


@dsl_user_op
def opaque_i32(x: Int32, *, loc=None, ip=None) -> Int32:
    """x, through a move the compiler cannot see into (so nothing derived from it is strength-reduced or hoisted)."""
    res = inline_asm(
        T.i32(), [Int32(x).ir_value(loc=loc, ip=ip)], "mov.b32 $0, $1;", "=r,r", side_effects=True, loc=loc, ip=ip
    )
    return Int32(res)


@dsl_user_op
def opaque_u32(x: Uint32, *, loc=None, ip=None) -> Uint32:
    """x, through a move the compiler cannot see into (so nothing derived from it is hoisted out of a loop)."""
    res = inline_asm(
        T.i32(), [Uint32(x).ir_value(loc=loc, ip=ip)], "mov.b32 $0, $1;", "=r,r", side_effects=True, loc=loc, ip=ip
    )
    return Uint32(res)


@dsl_user_op
def globaltimer(*, loc=None, ip=None) -> Int64:
    """The GPU's global nanosecond timer (comparable across SMs)."""
    return Int64(inline_asm(T.i64(), [], "mov.u64 $0, %globaltimer;", "=l", side_effects=True, loc=loc, ip=ip))


@dsl_user_op
def clock64(*, loc=None, ip=None) -> Int64:
    """This SM's cycle counter (durations within one CTA)."""
    return Int64(inline_asm(T.i64(), [], "mov.u64 $0, %clock64;", "=l", side_effects=True, loc=loc, ip=ip))


@dsl_user_op
def smid(*, loc=None, ip=None) -> Int32:
    """The SM this thread runs on."""
    return Int32(inline_asm(T.i32(), [], "mov.u32 $0, %smid;", "=r", side_effects=True, loc=loc, ip=ip))


def unpack_struct(struct, n: int, ty, wrap, *, loc=None, ip=None) -> tuple:
    """The n fields of an llvm struct (a multi-output inline asm), each wrapped as a DSL value."""
    return tuple(wrap(llvm.extractvalue(ty, struct, [i], loc=loc, ip=ip)) for i in range(n))


@dsl_user_op
def mma_bf16(a: tuple, b: tuple, c: tuple, *, loc=None, ip=None) -> tuple:
    """D = A @ B + C for one m16n8k16 bf16 tile with fp32 accumulators (4 + 2 + 4 registers)."""
    ops = [Int32(v).ir_value(loc=loc, ip=ip) for v in (*a, *b)] + [Float32(v).ir_value(loc=loc, ip=ip) for v in c]
    res = inline_asm(
        llvm.StructType.get_literal([T.f32()] * 4),
        ops,
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};",
        "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f",
        side_effects=False,
        loc=loc,
        ip=ip,
    )
    return unpack_struct(res, 4, T.f32(), Float32, loc=loc, ip=ip)


@dsl_user_op
def split_bf16x2(f0: Float32, f1: Float32, *, loc=None, ip=None) -> tuple:
    """(hi, lo) words: hi = bf16x2(f0, f1), lo = bf16x2 of the remainders; f0 in the low halves."""
    res = inline_asm(
        llvm.StructType.get_literal([T.i32()] * 2),
        [Float32(f0).ir_value(loc=loc, ip=ip), Float32(f1).ir_value(loc=loc, ip=ip)],
        "{\n\t.reg .b32 h, a, b;\n\t.reg .f32 x, y;\n\t"
        "cvt.rn.bf16x2.f32 h, $3, $2;\n\t"
        "shl.b32 a, h, 16;\n\t"
        "and.b32 b, h, 0xFFFF0000;\n\t"
        "mov.b32 x, a;\n\tmov.b32 y, b;\n\t"
        "sub.rn.f32 x, $2, x;\n\tsub.rn.f32 y, $3, y;\n\t"
        "cvt.rn.bf16x2.f32 $1, y, x;\n\t"
        "mov.b32 $0, h;\n\t}",
        "=r,=r,f,f",
        side_effects=False,
        loc=loc,
        ip=ip,
    )
    return unpack_struct(res, 2, T.i32(), Int32, loc=loc, ip=ip)


@dsl_user_op
def exp_approx(x: Float32, *, loc=None, ip=None) -> Float32:
    """e^x as 2^(x*log2 e) by the MUFU unit."""
    return exp2_approx(Float32(x) * Float32(LOG2E), loc=loc, ip=ip)


@dsl_user_op
def ld_v4_i32(ptr: cute.Pointer, *, loc=None, ip=None) -> tuple:
    """16 bytes from global (or shared) memory as 4 words (the address must be 16-byte aligned)."""
    vec = cute.arch.load(ptr, ir.VectorType.get([4], Int32.mlir_type), loc=loc, ip=ip)
    return tuple(Int32(mlir_vector.extract(vec, [], [i], loc=loc, ip=ip)) for i in range(4))


@dsl_user_op
def ld_v4_f32(ptr: cute.Pointer, *, loc=None, ip=None) -> tuple:
    """16 bytes from global (or shared) memory as 4 fp32 (the address must be 16-byte aligned)."""
    vec = cute.arch.load(ptr, ir.VectorType.get([4], Float32.mlir_type), loc=loc, ip=ip)
    return tuple(Float32(mlir_vector.extract(vec, [], [i], loc=loc, ip=ip)) for i in range(4))


@dsl_user_op
def cp_async_16(dst: cute.Pointer, src: cute.Pointer, *, loc=None, ip=None) -> None:
    """Copy 16 bytes (16-byte aligned) from global to shared memory without registers, through L2
    only (cp.async.cg); this thread sees them after cp.async.wait_group."""
    cute.arch.inline_ptx(
        "cp.async.cg.shared.global [{$r0}], [{$r1}], 16;",
        read_only_args=[dst.toint(loc=loc, ip=ip), src.toint(loc=loc, ip=ip)],
        loc=loc,
        ip=ip,
    )


@dsl_user_op
def st_v4_i32(ptr: cute.Pointer, words: tuple, *, loc=None, ip=None) -> None:
    """Store 4 words (16 bytes, 16-byte aligned) to global memory."""
    vec = mlir_vector.from_elements(
        ir.VectorType.get([4], Int32.mlir_type), [Int32(w).ir_value(loc=loc, ip=ip) for w in words], loc=loc, ip=ip
    )
    cute.arch.store(ptr, vec, loc=loc, ip=ip)


# Peer exchange (the all-reduce): every 32-bit word of a slot is its own arrival flag, so no fence is
# needed between the words a poll sees; `.sys` scope because the writer may be another GPU.


@dsl_user_op
def ld_sys_v4_pred(addr: Int64, pred: cutlass.Boolean, *, loc=None, ip=None) -> tuple[Uint32, ...]:
    """16 bytes a peer may be writing (ld.relaxed.sys: never a stale L1 line) when `pred`, else zeros."""
    return _ld_v4_pred("ld.relaxed.sys.global.v4.b32", addr, pred, loc, ip)


@dsl_user_op
def st_sys_v4_pred(
    addr: Int64, w0: Uint32, w1: Uint32, w2: Uint32, w3: Uint32, pred: cutlass.Boolean | None, *, loc=None, ip=None
) -> None:
    """Store 16 bytes (16-byte aligned) that a peer polls for (st.relaxed.sys), when `pred` (None: always)."""
    cute.arch.inline_ptx(
        "st.relaxed.sys.global.v4.b32 [{$r0}], {{$r1}, {$r2}, {$r3}, {$r4}};",
        read_only_args=[Int64(addr), Uint32(w0), Uint32(w1), Uint32(w2), Uint32(w3)],
        predicate=None if pred is None else cutlass.Boolean(pred),
        loc=loc,
        ip=ip,
    )


@dsl_user_op
def st_global_v4_pred(
    addr: Int64, w0: Uint32, w1: Uint32, w2: Uint32, w3: Uint32, pred: cutlass.Boolean | None, *, loc=None, ip=None
) -> None:
    """Store 16 bytes (16-byte aligned, a plain store) when `pred` (None: always)."""
    cute.arch.inline_ptx(
        "st.global.v4.b32 [{$r0}], {{$r1}, {$r2}, {$r3}, {$r4}};",
        read_only_args=[Int64(addr), Uint32(w0), Uint32(w1), Uint32(w2), Uint32(w3)],
        predicate=None if pred is None else cutlass.Boolean(pred),
        loc=loc,
        ip=ip,
    )
