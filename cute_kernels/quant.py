"""MXFP8 quantisation of a register vector (CONTRACT §4): e4m3 data, E8M0 scales in the swizzled 128x4 layout.

One 8-element bf16 vector per lane; 4 adjacent lanes hold a 32-element block (amax by shuffles), and
the first lane of each 16 writes the 4 scale bytes of its 128 columns as one word.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint32, const_expr

from cute_kernels import MXFP8_BLOCK, SCALE_WORD_COLS, ptx

E4M3_NAN_WORD = 0x7F7F7F7F


def mxfp8_scale_bytes(rows: int, H: int) -> int:
    """Bytes of the swizzled 128x4 scale buffer for [rows, H] (H a multiple of 128)."""
    return -(-rows // 128) * 128 * (H // MXFP8_BLOCK)


class Mxfp8Writer:
    """Writes the MXFP8 form of rows of H columns, of which a CTA of `threads` threads owns `chunk`."""

    def __init__(self, H: int, chunk: int, threads: int) -> None:
        self.H = H
        self.chunk = chunk
        self.threads = threads
        self.scale_cols = H // MXFP8_BLOCK  # Kp: H is a multiple of 128, so no padded columns

    @cute.jit
    def quantize_vector(
        self, words: list, mQ: cute.Tensor, mScale: cute.Tensor, row: Int32, vcol: Int32, valid: cutlass.Boolean | None
    ):
        """MXFP8 of one 8-element vector (4 packed bf16 words) of column vector `vcol` of `row`.

        Idle tail lanes come in whole groups of 16 (a chunk is a multiple of 128 columns), so they
        never mix into a real block; they only skip the stores.
        """
        # amax over bf16 bit patterns: |x| orders like its bits, and NaN sorts above Inf.
        amax = Uint32(0)
        for i in cutlass.range_constexpr(4):
            amax = cutlass.max(amax, words[i] & Uint32(0x7FFF), (words[i] >> 16) & Uint32(0x7FFF))
        for off in cutlass.range_constexpr(2):
            amax = cutlass.max(amax, cute.arch.shuffle_sync_bfly(amax, offset=1 << off))
        abits = amax << 16
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
        q = []
        for i in cutlass.range_constexpr(8):
            x = ptx.bf16_lo(words[i // 2]) if i % 2 == 0 else ptx.bf16_hi(words[i // 2])
            x = x * m1 * m2
            q.append(cute.arch.fmax(cute.arch.fmin(x, Float32(448.0)), Float32(-448.0)))
        q_lo = ptx.cvt_e4m3x4(q[0], q[1], q[2], q[3])
        q_hi = ptx.cvt_e4m3x4(q[4], q[5], q[6], q[7])
        nan_block = e == 255
        q_lo = Uint32(cutlass.select_(nan_block, Uint32(E4M3_NAN_WORD), q_lo))
        q_hi = Uint32(cutlass.select_(nan_block, Uint32(E4M3_NAN_WORD), q_hi))
        q_addr = mQ.iterator.toint() + (Int64(row) * self.H + Int64(vcol * 8))
        # The 4 scale bytes of 128 columns form one word: gather them from lanes +0, +4, +8, +12.
        lane = cute.arch.lane_idx()
        word = Uint32(e) << Uint32(8 * ((lane >> 2) & 3))
        word = word | cute.arch.shuffle_sync_bfly(word, offset=4)
        word = word | cute.arch.shuffle_sync_bfly(word, offset=8)
        scale_addr = mScale.iterator.toint() + self.scale_offset(row, vcol * 8 // MXFP8_BLOCK)
        if const_expr(valid is None):
            self.store_quantized(q_addr, q_lo, q_hi, scale_addr, word, lane)
        else:
            if valid:
                self.store_quantized(q_addr, q_lo, q_hi, scale_addr, word, lane)

    @cute.jit
    def store_quantized(self, q_addr: Int64, q_lo: Uint32, q_hi: Uint32, scale_addr: Int64, word: Uint32, lane: Int32):
        """The 8 e4m3 bytes of a vector, and the scale word from the first lane of each 16."""
        ptx.st_global_v2_b32(q_addr, q_lo, q_hi)
        if lane % 16 == 0:
            ptx.st_global_b32(scale_addr, word)

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
