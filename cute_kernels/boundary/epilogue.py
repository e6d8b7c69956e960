"""The boundary's epilogue role (CONTRACT §2 steps 2-6) on a row's y in registers: the new streams
R'[j] = bf16(post[j]*y + sum_k comb[k, j]*R[k]) (and aux, their mean), the collapse c = bf16(sum_j pre[j]*R'[j])
of the rounded R', the RMS of the rounded c over the row's cluster, then out = bf16(c * inv * w) and its MXFP8 and
FP8 1x128 forms."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Uint32, const_expr

from cute_kernels import HC, VEC, ptx, reduce
from cute_kernels.boundary.loads import Ctx, row_major
from cute_kernels.quant import Fp8GroupWriter, Mxfp8Writer


class Epilogue:
    """Post, collapse, aux and RMSNorm of rows whose columns are split over a cluster of `cluster_n` CTAs."""

    def __init__(
        self,
        H: int,
        cluster_n: int,
        threads: int,
        vpt: int,
        *,
        pre: bool,
        mxfp8: bool,
        aux: bool,
        fp8: str | None = None,
        spin: bool = False,
    ) -> None:
        self.H = H
        self.cluster_n = cluster_n
        self.threads = threads
        self.vpt = vpt
        self.pre = pre
        self.mxfp8 = mxfp8
        self.aux = aux
        self.warps = threads // 32
        self.slots = self.warps * cluster_n  # RMS partials per row
        # Only the RMS needs cross-CTA traffic: the residual-only kernel launches no cluster.
        self.use_cluster = pre and cluster_n > 1
        self.stages = 2  # exchange buffers, by row parity
        # The cluster sum's mbarrier wait as a try_wait loop with no suspend hint (`spin`) instead of
        # cute.arch.mbarrier_wait, whose retry suspends the warp with a 10 ms hint; the CTA's warps enter it together.
        self.spin = spin
        self.quant = Mxfp8Writer(H, H // cluster_n, threads) if mxfp8 else None
        # FP8 1x128 (`fp8`: "fp8_1x128", or "fp8_1x128_ue8m0" with power-of-two scales).
        self.fp8 = None if fp8 is None else Fp8GroupWriter(H, ue8m0=fp8 == "fp8_1x128_ue8m0")

    @cute.jit
    def premix(self, ctx: Ctx, rR: cute.Tensor, comb: list):
        """sum_k comb[k, j] * R[k] of a row's streams, k in order: the part of R'[j] that needs no y, so that a peer
        kernel computes it while it waits for the other ranks. It goes to this thread's cells of `ctx.sMix` (fp32,
        mix_layout), not registers: beside the polls' registers it would spill."""
        vpt = const_expr(self.vpt)
        copy16 = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=128)
        quad = cute.make_rmem_tensor((4,), Float32)
        for v in cutlass.range_constexpr(vpt):
            rf = [rR[v, k, None].load().to(Float32) for k in range(HC)]
            for j in cutlass.range_constexpr(HC):
                for q in cutlass.range_constexpr(VEC // 4):
                    for i in cutlass.range_constexpr(4):
                        e = q * 4 + i
                        acc = ptx.mul_rn(comb[0][j], rf[0][e])
                        for k in cutlass.range_constexpr(1, HC):
                            acc = ptx.mul_add_rn(comb[k][j], rf[k][e], acc)
                        quad[i] = acc
                    cute.copy(copy16, quad, self.mix_cell(ctx, v, j, q))

    def mix_layout(self) -> cute.Layout:
        """The premix's shared-memory cells: [vector, stream, quad][thread, 4] fp32, each thread's four values of a
        quad contiguous and the threads' quads side by side (16-byte accesses without bank conflicts)."""
        return cute.make_layout((self.vpt * HC * (VEC // 4), self.threads * 4), stride=(self.threads * 4, 1))

    def mix_cell(self, ctx: Ctx, v: int, j: int, q: int) -> cute.Tensor:
        """This thread's quad q (elements 4q..4q+3) of stream j of its vector v in `ctx.sMix`."""
        return cute.local_tile(ctx.sMix[(v * HC + j) * (VEC // 4) + q, None], (4,), (ctx.tidx,))

    @cute.jit
    def compute_row(
        self,
        ctx: Ctx,
        rR: cute.Tensor,
        y: cute.Tensor,
        post: list,
        comb: list,
        pre: list | None,
        row: Int32,
        kept: list | None = None,
    ) -> tuple[cute.Tensor | None, Float32]:
        """Store the new streams (and aux) of a row; return its collapse (fp32 of bf16) and sum of squares. With the
        premix cells (`ctx.sMix`, a peer kernel: premix) the row's mix is read from them and `comb` is not used.
        With `kept` (the own pre, not known yet) the rounded new streams go there instead, per vector and stream as 4
        packed bf16 words, for the own-pre role and then `collapse`."""
        vpt = const_expr(self.vpt)
        valid = ctx.valid
        mixed = ctx.sMix is not None
        copy16 = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=128)
        rC = cute.make_rmem_tensor(row_major((vpt, VEC)), Float32) if const_expr(self.pre and kept is None) else None
        sumsq = Float32(0.0)
        for v in cutlass.range_constexpr(vpt):
            rf = None if const_expr(mixed) else [rR[v, k, None].load().to(Float32) for k in range(HC)]
            new_streams = []
            for j in cutlass.range_constexpr(HC):
                mix = None
                if const_expr(mixed):
                    mix = cute.make_rmem_tensor((VEC,), Float32)
                    for q in cutlass.range_constexpr(VEC // 4):
                        cute.copy(copy16, self.mix_cell(ctx, v, j, q), cute.local_tile(mix, (4,), (q,)))
                words = []
                for e in cutlass.range_constexpr(0, VEC, 2):
                    pair = []
                    for h in cutlass.range_constexpr(2):
                        if const_expr(mixed):
                            # post*y added to the premix in one rounding: within the contract's reassociation bound.
                            acc = ptx.mul_add_rn(post[j], y[v, e + h], mix[e + h])
                        else:
                            # Same operation order and roundings as the reference: post*y, then + comb[k,j]*R[k].
                            acc = ptx.mul_rn(post[j], y[v, e + h])
                            for k in cutlass.range_constexpr(HC):
                                acc = ptx.mul_add_rn(comb[k][j], rf[k][e + h], acc)
                        pair.append(acc)
                    words.append(ptx.cvt_bf16x2(pair[0], pair[1]))
                new_streams.append(words)
                self.store_words(words, cute.local_tile(ctx.mNewR[row, j, None], (VEC,), (ctx.vcols[v],)), valid[v])
            # The rounded new streams, back in fp32.
            rp = [[unpack(words, e) for e in range(VEC)] for words in new_streams]
            if const_expr(self.aux):
                words = []
                for e in cutlass.range_constexpr(0, VEC, 2):
                    pair = []
                    for h in cutlass.range_constexpr(2):
                        s = ptx.add_rn(ptx.add_rn(ptx.add_rn(rp[0][e + h], rp[1][e + h]), rp[2][e + h]), rp[3][e + h])
                        pair.append(ptx.mul_rn(s, Float32(1.0 / HC)))
                    words.append(ptx.cvt_bf16x2(pair[0], pair[1]))
                self.store_words(words, cute.local_tile(ctx.mAux[row, None], (VEC,), (ctx.vcols[v],)), valid[v])
            if const_expr(kept is not None):
                kept.append(new_streams)  # packed: half the registers of rp while the pre is computed
            elif const_expr(self.pre):
                sumsq = self.collapse_vector(rC, v, rp, pre, valid[v], sumsq)
        return rC, sumsq

    @cute.jit
    def collapse_vector(
        self, rC: cute.Tensor, v: int, rp: list, pre: list, valid: cutlass.Boolean | None, sumsq: Float32
    ) -> Float32:
        """rC[v] = bf16(sum_j pre[j] * R'[j]) (in fp32) of vector v's rounded new streams `rp`; `sumsq` plus its
        squares (nothing for a clamped duplicate)."""
        for e in cutlass.range_constexpr(0, VEC, 2):
            pair = []
            for h in cutlass.range_constexpr(2):
                acc = ptx.mul_rn(pre[0], rp[0][e + h])
                for j in cutlass.range_constexpr(1, HC):
                    acc = ptx.mul_add_rn(pre[j], rp[j][e + h], acc)
                pair.append(acc)
            word = ptx.cvt_bf16x2(pair[0], pair[1])
            c0, c1 = ptx.bf16_lo(word), ptx.bf16_hi(word)
            rC[v, e], rC[v, e + 1] = c0, c1
            if const_expr(valid is None):
                sumsq = sumsq + c0 * c0 + c1 * c1
            else:
                sumsq = sumsq + Float32(cutlass.select_(valid, c0 * c0 + c1 * c1, Float32(0.0)))
        return sumsq

    @cute.jit
    def collapse(self, ctx: Ctx, kept: list, pre: list) -> tuple[cute.Tensor, Float32]:
        """The collapse and sum of squares of a row whose rounded new streams were `kept` (compute_row), with `pre`."""
        rC = cute.make_rmem_tensor(row_major((self.vpt, VEC)), Float32)
        sumsq = Float32(0.0)
        for v in cutlass.range_constexpr(self.vpt):
            rp = [[unpack(words, e) for e in range(VEC)] for words in kept[v]]
            sumsq = self.collapse_vector(rC, v, rp, pre, ctx.valid[v], sumsq)
        return rC, sumsq

    @cute.jit
    def finish_row(self, ctx: Ctx, row: Int32, rC: cute.Tensor, sumsq: Float32, stage: int, phase: Int32):
        """The row's RMS over the cluster (the sum of squares of every thread of the row's CTAs, in a fixed order, on
        every thread), then out (and its MXFP8 and FP8 1x128 forms).

        Rows alternate two exchange stages by parity. A peer can only write a stage again two rows
        later, after this CTA's every warp has sent the row in between, which each warp does after
        reading the stage.
        """
        vpt = const_expr(self.vpt)
        self.send_warp_sum(sumsq, ctx.sRed, ctx.mbar, ctx.cta, stage)
        # Where the quantized forms go, while the sums cross the cluster (docs/PERF.md decisions: Fp8GroupWriter.place).
        mx_places, fp8_places = [], []
        for v in cutlass.range_constexpr(vpt):
            if const_expr(self.mxfp8):
                mx_places.append(self.quant.place(ctx.mQ, ctx.mScale, row, ctx.vcols[v]))
            if const_expr(self.fp8 is not None):
                fp8_places.append(self.fp8.place(ctx.mQ8, ctx.mScale8, row, ctx.rows, ctx.vcols[v]))
        total = self.gather_sum(ctx.sRed, ctx.mbar, stage, phase)
        inv = ptx.rsqrt_approx(ptx.div_rn(total, Float32(self.H)) + ctx.eps)
        for v in cutlass.range_constexpr(vpt):
            # Unpacked per row: fp32 copies hoisted out of the row loop would hold twice the registers.
            rw = cute.recast_tensor(ctx.rW[v, None], Uint32)
            packed = [ptx.opaque_u32(rw[i]) for i in range(VEC // 2)]
            wf = [unpack(packed, e) for e in range(VEC)]
            words = [ptx.cvt_bf16x2(rC[v, e] * inv * wf[e], rC[v, e + 1] * inv * wf[e + 1]) for e in range(0, VEC, 2)]
            self.store_words(words, cute.local_tile(ctx.mOut[row, None], (VEC,), (ctx.vcols[v],)), ctx.valid[v])
            if const_expr(self.mxfp8):
                self.quant.quantize_vector(words, mx_places[v], ctx.valid[v])
            if const_expr(self.fp8 is not None):
                self.fp8.quantize_vector(words, fp8_places[v], ctx.valid[v])

    @cute.jit
    def send_warp_sum(self, val: Float32, sRed: cute.Tensor, mbar: cute.Pointer | None, cta: Int32, stage: int):
        """This warp's sum of `val` into its slot of stage `stage` of every CTA of the row's cluster (one CTA:
        of this CTA, then a barrier)."""
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        val = reduce.warp_sum(val)
        base = const_expr(stage * self.slots)
        slot = cta * self.warps + warp
        if const_expr(self.use_cluster):
            if warp == 0:
                reduce.expect_bytes(mbar + stage, self.slots * 4)
            if lane < self.cluster_n:
                reduce.push(sRed.iterator + base + slot, val, mbar + stage, lane)
        else:
            if lane == 0:
                sRed[base + slot] = val
            cute.arch.barrier()

    @cute.jit
    def gather_sum(self, sRed: cute.Tensor, mbar: cute.Pointer | None, stage: int, phase: Int32) -> Float32:
        """Once every warp of the cluster has sent its sum to stage `stage`: their total, in slot order."""
        lane = cute.arch.lane_idx()
        base = const_expr(stage * self.slots)
        if const_expr(self.use_cluster):
            reduce.wait_pushes(mbar + stage, phase, self.spin)
        slots = const_expr(self.slots)
        part = Float32(0.0)
        for i in cutlass.range_constexpr(cute.ceil_div(slots, 32)):
            if lane + i * 32 < slots:
                part = part + sRed[base + lane + i * 32]
        if const_expr(self.use_cluster):
            # The peers' next writes to this stage come through the async proxy: order our reads first.
            cute.arch.fence_view_async_shared()
        return reduce.warp_sum(part)

    @cute.jit
    def store_words(self, words: list, gDst: cute.Tensor, valid: cutlass.Boolean | None):
        """Store 4 packed bf16 words as one 16-byte vector, unless `valid` is False."""
        copy16 = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BFloat16, num_bits_per_copy=128)
        rStore = cute.make_rmem_tensor((VEC,), BFloat16)
        rw = cute.recast_tensor(rStore, Uint32)
        for i in cutlass.range_constexpr(4):
            rw[i] = words[i]
        if const_expr(valid is None):
            cute.copy(copy16, rStore, gDst)
        else:
            if valid:
                cute.copy(copy16, rStore, gDst)


def unpack(words: list, e: int) -> Float32:
    """The fp32 value of bf16 element e of a vector held as 4 packed words."""
    return ptx.bf16_lo(words[e // 2]) if e % 2 == 0 else ptx.bf16_hi(words[e // 2])
