"""Quantisation of a register vector for the next GEMM: MXFP8 (CONTRACT §4: e4m3 data, E8M0 scales in the swizzled
128x4 layout) and FP8 1x128 (CONTRACT §4b: e4m3 data, one fp32 scale per token and 128 columns, column-major).

One 8-element bf16 vector per lane, 16 adjacent lanes holding 128 consecutive columns. MXFP8: 4 adjacent lanes
hold a 32-element block (amax by shuffles), and the first lane of each 16 writes the 4 scale bytes of its 128
columns as one word. FP8 1x128: the 16 lanes are one group, and their first lane writes its scale.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint32, const_expr

from cute_kernels import E4M3_MAX, FP8_GROUP, MXFP8_BLOCK, SCALE_WORD_COLS, VEC, ptx

E4M3_NAN_WORD = 0x7F7F7F7F


def block_scale(abits: Uint32) -> tuple:
    """The MXFP8 block scale of a block whose amax has fp32 bits `abits`: (E, m1, m2), E the biased E8M0 exponent
    and m1 * m2 = 2^(127-E) the multiplier (CONTRACT §4)."""
    # E = smallest with 2^(E-127) >= amax/448: amax = 1.f * 2^(ea-127) needs ea-8, plus 1 when 1.f > 1.75.
    ea = Int32(abits >> 23)
    rounded_up = Int32(cutlass.select_((abits & Uint32(0x7FFFFF)) > Uint32(0x600000), Int32(1), Int32(0)))
    e = cutlass.max(ea - 8 + rounded_up, Int32(0))
    e = Int32(cutlass.select_(abits == Uint32(0x7F800000), Int32(254), e))
    e = Int32(cutlass.select_(abits > Uint32(0x7F800000), Int32(255), e))
    # Multiplier 2^(127-E) as two normal factors (2^-127 itself is subnormal): 1 for E == 0.
    m1 = ptx.f32_from_bits(Uint32(cutlass.max(254 - e, Int32(1))) << 23)
    m1 = Float32(cutlass.select_(e == 0, Float32(1.0), m1))
    m1 = Float32(cutlass.select_(e == 254, Float32(2.0**-64), m1))
    m2 = Float32(cutlass.select_(e == 254, Float32(2.0**-63), Float32(1.0)))
    return e, m1, m2


def quantize_words(words: list, e: Int32, m1: Float32, m2: Float32) -> tuple:
    """The e4m3 bytes of one 8-element vector (4 packed bf16 words) under its block's scale, as two words (a NaN
    block's all NaN)."""
    q = []
    for i in range(8):
        x = ptx.bf16_lo(words[i // 2]) if i % 2 == 0 else ptx.bf16_hi(words[i // 2])
        x = x * m1 * m2
        q.append(cute.arch.fmax(cute.arch.fmin(x, Float32(448.0)), Float32(-448.0)))
    q_lo = ptx.cvt_e4m3x4(q[0], q[1], q[2], q[3])
    q_hi = ptx.cvt_e4m3x4(q[4], q[5], q[6], q[7])
    nan_block = e == 255
    q_lo = Uint32(cutlass.select_(nan_block, Uint32(E4M3_NAN_WORD), q_lo))
    q_hi = Uint32(cutlass.select_(nan_block, Uint32(E4M3_NAN_WORD), q_hi))
    return q_lo, q_hi


class Mxfp8Writer:
    """Writes the MXFP8 form of rows of H columns, of which a CTA of `threads` threads owns `chunk`."""

    def __init__(self, H: int, chunk: int, threads: int) -> None:
        self.H = H
        self.chunk = chunk
        self.threads = threads
        self.scale_cols = H // MXFP8_BLOCK  # Kp: H is a multiple of 128, so no padded columns

    @cute.jit
    def place(self, mQ: cute.Tensor, mScale: cute.Tensor, row: Int32, vcol: Int32) -> tuple:
        """Where the MXFP8 form of column vector `vcol` of `row` goes, made before its values (the epilogue makes it
        while the RMS sums cross the cluster, docs/PERF.md decisions: Fp8GroupWriter.place): the data address, the
        scale word's address, and whether this lane stores that word (the first of each 16)."""
        q_addr = mQ.iterator.toint() + (Int64(row) * self.H + Int64(vcol * 8))
        scale_addr = mScale.iterator.toint() + self.scale_offset(row, vcol * 8 // MXFP8_BLOCK)
        return q_addr, scale_addr, cutlass.Boolean(cute.arch.lane_idx() % 16 == 0)

    @cute.jit
    def quantize_vector(self, words: list, place: tuple, valid: cutlass.Boolean | None):
        """MXFP8 of one 8-element vector (4 packed bf16 words) at `place` (Mxfp8Writer.place).

        Idle tail lanes come in whole groups of 16 (a chunk is a multiple of 128 columns), so they
        never mix into a real block; they only skip the stores.
        """
        e, m1, m2 = block_scale(self.block_amax(words) << 16)
        q_lo, q_hi = quantize_words(words, e, m1, m2)
        # The 4 scale bytes of 128 columns form one word: gather them from lanes +0, +4, +8, +12.
        lane = cute.arch.lane_idx()
        word = Uint32(e) << Uint32(8 * ((lane >> 2) & 3))
        word = word | cute.arch.shuffle_sync_bfly(word, offset=4)
        word = word | cute.arch.shuffle_sync_bfly(word, offset=8)
        if const_expr(valid is None):
            self.store(place, q_lo, q_hi, word)
        else:
            if valid:
                self.store(place, q_lo, q_hi, word)

    @cute.jit
    def block_amax(self, words: list) -> Uint32:
        """The bf16 bit pattern of the 32-element block's amax (this lane's 8 values, then its 4 lanes): |x| orders like
        its bits, and NaN sorts above Inf."""
        amax = Uint32(0)
        for i in cutlass.range_constexpr(4):
            amax = cutlass.max(amax, words[i] & Uint32(0x7FFF), (words[i] >> 16) & Uint32(0x7FFF))
        for off in cutlass.range_constexpr(2):
            amax = cutlass.max(amax, cute.arch.shuffle_sync_bfly(amax, offset=1 << off))
        return amax

    @cute.jit
    def store(self, place: tuple, q_lo: Uint32, q_hi: Uint32, word: Uint32):
        """The 8 e4m3 bytes of a vector, and the scale word from the first lane of each 16 (predicated, no branch)."""
        q_addr, scale_addr, first = place
        ptx.st_global_v2_b32(q_addr, q_lo, q_hi)
        ptx.st_global_b32(scale_addr, word, first)

    @cute.jit
    def scale_offset(self, m: Int32, k: Int32) -> Int64:
        """Byte offset of scale (m, k), k % 4 == 0, in the swizzled 128x4 layout."""
        return Int64(m // 128) * (128 * self.scale_cols) + Int64((k // 4) * 512 + (m % 32) * 16 + ((m % 128) // 32) * 4)

    @cute.jit
    def zero_padding(self, mScale: cute.Tensor, rows: Int32, cta: Int32, tidx: Int32, cluster: Int32, clusters: Int32):
        """Zero CTA `cta`'s columns of the scale padding rows T..roundup(T, 128)-1, spread over every cluster.

        16-byte segment s of a 512-byte block holds rows s, s+32, s+64, s+96 of the last 128-row
        tile: past the real rows a whole segment is padding (one 16-byte store), before them the
        padded rows of a segment are its tail (at most two stores). Issued right after the loads go
        out, these stores stay off the row's critical path.
        """
        blocks = const_expr(self.chunk // SCALE_WORD_COLS)  # 512-byte blocks of this CTA per tile
        tile = Int64((rows - 1) // 128) * (128 * self.scale_cols)
        base = mScale.iterator.toint() + tile + Int64(cta * (blocks * 512))
        start = cluster * self.threads + tidx
        in_tile = (rows - 1) % 128 + 1  # real rows in the last tile
        if in_tile < 128:
            aligned = base % 16 == 0  # the buffer need only be 4-byte aligned
            zero = Uint32(0)
            for item in cutlass.range(start, blocks * 32, clusters * self.threads):
                s = item % 32
                addr = base + Int64((item // 32) * 512 + s * 16)
                first = (in_tile - s + 31) // 32  # the first padding row s + 32*q of the segment; 4: none
                if aligned:
                    if first == 0:
                        ptx.st_global_v4_b32(addr, zero, zero, zero, zero)
                    if first == 1:
                        ptx.st_global_b32(addr + 4, zero)
                        ptx.st_global_v2_b32(addr + 8, zero, zero)
                    if first == 2:
                        ptx.st_global_v2_b32(addr + 8, zero, zero)
                    if first == 3:
                        ptx.st_global_b32(addr + 12, zero)
                else:
                    for q in cutlass.range_constexpr(4):
                        if first <= q:
                            ptx.st_global_b32(addr + 4 * q, zero)


# The floor under a group's amax (DeepGEMM's per_token_cast_to_fp8), so that an all-zero group gets a finite scale.
FP8_GROUP_AMAX_FLOOR = 1e-4
FP8_GROUP_LANES = FP8_GROUP // VEC  # adjacent lanes holding one group


def group_words(words: list, inverse: Float32) -> tuple:
    """The e4m3 bytes of one 8-element vector (4 packed bf16 words) under its FP8 1x128 group's scale: e4m3(x * (1 /
    sf)), as two words."""
    q = []
    for i in range(8):
        x = ptx.bf16_lo(words[i // 2]) if i % 2 == 0 else ptx.bf16_hi(words[i // 2])
        q.append(ptx.mul_rn(x, inverse))
    return ptx.cvt_e4m3x4(q[0], q[1], q[2], q[3]), ptx.cvt_e4m3x4(q[4], q[5], q[6], q[7])


class Fp8GroupWriter:
    """Writes the FP8 1x128 form of rows of H columns: e4m3 data [T, H] and fp32 scales [H/128, T_pad] (scale of
    token t and group g at g * T_pad + t); `ue8m0`: each scale rounded up to a power of two."""

    def __init__(self, H: int, *, ue8m0: bool) -> None:
        self.H = H
        self.ue8m0 = ue8m0

    @cute.jit
    def place(self, mQ: cute.Tensor, mScale: cute.Tensor, row: Int32, rows: Int32, vcol: Int32) -> tuple:
        """Where the FP8 1x128 form of column vector `vcol` of `row` (of `rows`) goes, made before its values (the
        epilogue makes it while the RMS sums cross the cluster: after the values, its parameter loads and integer
        steps sat on the row's tail, docs/PERF.md decisions: Fp8GroupWriter.place): the data address, the scale
        address, and the predicates of the group's first lane's scale stores. T_pad rounds T up to 4 and the buffer
        starts 16-byte aligned (the public edge checks both), so the zeros of the padding rows T..T_pad-1 follow the
        last row's scale in its 16-byte chunk of 4: that row stores its scale and the zeros in one store of 16 bytes
        where it starts the chunk (`wide`), of 8 where it is third (`pair`), of 4 and 8 where it is second (`word`,
        `pad`); every other row stores its scale alone (`word`)."""
        q_addr = mQ.iterator.toint() + (Int64(row) * self.H + Int64(vcol * VEC))
        padded = mScale.shape[1]  # T_pad
        scale_addr = mScale.iterator.toint() + (Int64(vcol // FP8_GROUP_LANES) * Int64(padded) + Int64(row)) * 4
        first = cute.arch.lane_idx() % FP8_GROUP_LANES == 0
        last = row == rows - 1
        at = row % 4
        wide = cutlass.Boolean(first & last & (at == 0))
        word = cutlass.Boolean(first & ((~last) | (at == 1) | (at == 3)))
        pad = cutlass.Boolean(first & last & (at == 1))
        pair = cutlass.Boolean(first & last & (at == 2))
        return q_addr, scale_addr, wide, word, pad, pair

    @cute.jit
    def quantize_vector(self, words: list, place: tuple, valid: cutlass.Boolean | None):
        """FP8 1x128 of one 8-element vector (4 packed bf16 words) at `place` (Fp8GroupWriter.place):
        sf = max(amax, 1e-4) / 448 (IEEE division; NaN stays NaN), q = e4m3(x * (1 / sf)). Idle tail lanes come in
        whole groups (a chunk is a multiple of 128 columns): they only skip the stores."""
        amax = self.group_amax(words)
        sf, inverse = self.scale(amax)
        q_lo, q_hi = group_words(words, inverse)
        if const_expr(valid is None):
            self.store(place, q_lo, q_hi, ptx.f32_bits(sf))
        else:
            if valid:
                self.store(place, q_lo, q_hi, ptx.f32_bits(sf))

    @cute.jit
    def group_amax(self, words: list) -> Uint32:
        """max |x| of the group as a bf16 magnitude bit pattern, on every lane of the group: |x| orders like its bits,
        and NaN sorts above Inf."""
        amax = Uint32(0)
        for i in cutlass.range_constexpr(4):
            amax = cutlass.max(amax, words[i] & Uint32(0x7FFF), (words[i] >> 16) & Uint32(0x7FFF))
        # A group is 16 aligned lanes: each half-warp's max from one full-warp redux that the other half joins with 0
        # (every magnitude pattern is >= 0, so 0 never wins over a real amax), where 4 dependent shuffles ran
        # (docs/PERF.md decisions: Fp8GroupWriter.group_amax).
        low = cute.arch.lane_idx() < FP8_GROUP_LANES
        m_lo = cute.arch.warp_redux_sync(Uint32(cutlass.select_(low, amax, Uint32(0))), "umax")
        m_hi = cute.arch.warp_redux_sync(Uint32(cutlass.select_(low, Uint32(0), amax)), "umax")
        return Uint32(cutlass.select_(low, m_lo, m_hi))

    @cute.jit
    def scale(self, amax: Uint32) -> tuple:
        """(sf, 1 / sf) of a group from its amax bits: the rule's IEEE quotient and reciprocal."""
        a = ptx.f32_from_bits(amax << 16)
        # A select, not fmax: fmax would turn a NaN amax into the floor.
        a = Float32(cutlass.select_(a < Float32(FP8_GROUP_AMAX_FLOOR), Float32(FP8_GROUP_AMAX_FLOOR), a))
        sf = amax_over_e4m3_max(a, amax >= Uint32(0x7F80))
        if const_expr(self.ue8m0):
            sf = ceil_to_ue8m0(sf)
            # A power of two 2^(e-127), e in [1, 254]: its reciprocal 2^(127-e) is exact; 0 for Inf, NaN for NaN.
            e = Int32((ptx.f32_bits(sf) >> 23) & Uint32(0xFF))
            inverse = ptx.f32_from_bits(Uint32(cutlass.max(Int32(254) - e, Int32(1))) << 23)
            inverse = Float32(cutlass.select_(e == Int32(254), Float32(2.0**-127), inverse))
            inverse = Float32(cutlass.select_(e == Int32(0xFF), ptx.rcp_rn(sf), inverse))
        else:
            # rcp.approx and one Newton step: rcp.rn's bits for every sf the rule can make (docs/PERF.md decisions:
            # Fp8GroupWriter.scale). Inf and NaN keep rcp.approx's 0 and NaN (the step would make Inf's NaN).
            y0 = ptx.rcp_approx(sf)
            e = ptx.fma_rn(-sf, y0, Float32(1.0))
            inverse = Float32(cutlass.select_(amax >= Uint32(0x7F80), y0, ptx.fma_rn(y0, e, y0)))
        return sf, inverse

    @cute.jit
    def store(self, place: tuple, q_lo: Uint32, q_hi: Uint32, sf_bits: Uint32):
        """The 8 e4m3 bytes of a vector, then the group's scale stores under their predicates (no branch)."""
        q_addr, scale_addr, wide, word, pad, pair = place
        zero = Uint32(0)
        ptx.st_global_v2_b32(q_addr, q_lo, q_hi)
        ptx.st_global_v4_pred(scale_addr, sf_bits, zero, zero, zero, wide)
        ptx.st_global_b32(scale_addr, sf_bits, word)
        ptx.st_global_v2_b32(scale_addr + 4, zero, zero, pad)
        ptx.st_global_v2_b32(scale_addr, sf_bits, zero, pair)


def amax_over_e4m3_max(a: Float32, non_finite: cutlass.Boolean) -> Float32:
    """a / 448 with IEEE rounding for a group's clamped amax `a` (a bf16 value >= 1e-4, or the fp32 floor 1e-4; Inf
    and NaN where `non_finite`): the quotient by the reciprocal and one FMA correction (Markstein), which gives the
    correctly rounded quotient for every such `a` (checked against IEEE division for all of them, docs/PERF.md
    decisions: amax_over_e4m3_max) in three instructions where div.rn takes a dozen and a branch."""
    r = Float32(1.0 / E4M3_MAX)  # RN(1/448)
    q0 = ptx.mul_rn(a, r)
    residual = ptx.fma_rn(-q0, Float32(E4M3_MAX), a)
    return Float32(cutlass.select_(non_finite, q0, ptx.fma_rn(residual, r, q0)))


def ceil_to_ue8m0(sf: Float32) -> Float32:
    """A positive fp32 scale rounded up to a power of two from its bits (exponent + 1 if the mantissa is non-zero,
    clamped to [1, 254]); NaN and Inf pass through."""
    bits = ptx.f32_bits(sf)
    exponent = Int32((bits >> 23) & Uint32(0xFF))
    e = exponent + Int32(cutlass.select_((bits & Uint32(0x7FFFFF)) != Uint32(0), Int32(1), Int32(0)))
    e = cutlass.min(cutlass.max(e, Int32(1)), Int32(254))
    rounded = ptx.f32_from_bits(Uint32(e) << 23)
    return Float32(cutlass.select_(exponent == Int32(0xFF), sf, rounded))
