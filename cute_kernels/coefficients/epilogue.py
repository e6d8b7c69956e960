"""The per-row epilogue of CONTRACT §3 (steps 1-4) on a row's 25 summed partials: the rms scale, the pre and
post sigmoids, and comb (softmax rows, then the Sinkhorn repeats), plus the partials schedule's finish
kernel, which sums a row's CTA partials in the one-launch schedule's order before running it.

Which threads run what: warp 0 comb, one lane per row (the long Sinkhorn chain), warp 1 pre and post,
one lane per row, so the two do not queue on one scheduler (a one-warp CTA runs pre and post on warp 0
after comb). The Sinkhorn repeats run as a rolled loop of SINKHORN_UNROLL repeats per iteration, not
straight-line code: one warp runs the chain on an SM whose instruction cache has not seen it, and fully
unrolled (39 normalisations) it was fetch-bound (docs/PERF.md decisions: SINKHORN_UNROLL).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from cute_kernels import ptx as prim
from cute_kernels.coefficients.config import CLUSTER, HC, MIX, NV, SINKHORN_UNROLL, WARP
from cute_kernels.coefficients.own_input import OwnInputRole


class EpilogueRole:
    """post, comb and next pre of the rows a CTA finishes, from their summed partials in shared memory; with
    `own_input` (DeepSeek-V4's own-pre layer input of hidden size H, `quant` beside bf16; `share`: rows a tile-schedule
    CTA finishes) also the rows' layer input."""

    def __init__(
        self,
        K: int,
        sinkhorn_repeat: int,
        threads: int,
        groups: int,
        *,
        own_input: int | None = None,
        share: int = 1,
        quant: str | None = None,
    ) -> None:
        self.K = K  # columns of the projection (the mean square's divisor)
        self.repeat = sinkhorn_repeat
        self.threads = threads  # of the projection CTA: a one-warp CTA runs pre and post after comb
        self.groups = groups
        # The own-pre layer input's role in a tile-schedule CTA and in a finish CTA (the same bits: its order is the
        # layer-input kernel's whatever the CTA's shape).
        self.own_tile = self.own_finish = None
        if own_input is not None:
            self.own_tile = OwnInputRole(own_input, threads, share, quant, pads=False)
            self.own_finish = OwnInputRole(own_input, self.finish_threads, 1, quant)

    @cute.jit
    def finish_rows(
        self,
        sMix: cute.Tensor,
        sParam: cute.Tensor,
        share_row0: Int32,
        share_rows: Int32,
        mPost: cute.Tensor,
        mComb: cute.Tensor,
        mPre: cute.Tensor,
        rms_eps: Float32,
        pre_eps: Float32,
        sinkhorn_eps: Float32,
        post_mult: Float32,
        own: OwnInputRole | None = None,
        own_buffers: tuple | None = None,
        own_args: tuple | None = None,
    ):
        """The epilogue of the share rows: sMix [rows][25] partials, sParam [scale (3), base (24)]; with `own` (the
        role, its shared buffers and (mX, mW, mOut, mQ, mScale, norm_eps)) also their own-pre layer input, by warps
        1.. while warp 0 runs the Sinkhorn chain."""
        tidx, _, _ = cute.arch.thread_idx()
        if tidx < WARP:
            self.row_comb(sMix, sParam, share_row0, share_rows, mComb, rms_eps, sinkhorn_eps)
        pre_post_lane = tidx
        if const_expr(own is not None or self.threads >= 2 * WARP):
            pre_post_lane = tidx - WARP
        sPre = own_buffers[0] if const_expr(own is not None) else None
        if pre_post_lane >= 0 and pre_post_lane < share_rows:
            mixes = self.row_mixes(sMix, pre_post_lane, rms_eps, 2 * HC)
            self.row_pre_post(
                mixes, sParam, share_row0 + pre_post_lane, mPost, mPre, pre_eps, post_mult, sPre, pre_post_lane
            )
        if const_expr(own is not None):
            own.rows(own_buffers, share_row0, share_rows, own_args)

    @cute.jit
    def row_scale(self, sMix: cute.Tensor, i: Int32, rms_eps: Float32) -> Float32:
        """CONTRACT §3 step 1 for share row i: rsqrt(mean square + eps)."""
        return prim.rsqrt_approx(prim.div_rn(sMix[i * NV + MIX], Float32(self.K)) + rms_eps)

    @cute.jit
    def row_mixes(self, sMix: cute.Tensor, i: Int32, rms_eps: Float32, count: int) -> list:
        """The first `count` dot products of share row i times the row's scale."""
        r = self.row_scale(sMix, i, rms_eps)
        return [sMix[i * NV + n] * r for n in range(count)]

    @cute.jit
    def row_pre_post(
        self,
        mixes: list,
        sParam: cute.Tensor,
        row: Int32,
        mPost: cute.Tensor,
        mPre: cute.Tensor,
        pre_eps: Float32,
        post_mult: Float32,
        sPre: cute.Tensor | None = None,
        i: Int32 | None = None,
    ):
        """CONTRACT §3 steps 2-3 of one row: the next pre and this post (sigmoids); the pre also into sPre's share row
        i when given (the own-pre layer input reads it there)."""
        for j in cutlass.range_constexpr(HC):
            z = mixes[j] * sParam[0] + sParam[3 + j]
            pre = prim.rcp_approx(Float32(1.0) + prim.exp_approx(-z)) + pre_eps
            mPre[row, j] = pre
            if const_expr(sPre is not None):
                sPre[i * HC + j] = pre
        for j in cutlass.range_constexpr(HC):
            z = mixes[HC + j] * sParam[1] + sParam[3 + HC + j]
            mPost[row, j] = prim.rcp_approx(Float32(1.0) + prim.exp_approx(-z)) * post_mult

    @cute.jit
    def row_comb(
        self,
        sMix: cute.Tensor,
        sParam: cute.Tensor,
        share_row0: Int32,
        share_rows: Int32,
        mComb: cute.Tensor,
        rms_eps: Float32,
        sinkhorn_eps: Float32,
    ):
        """CONTRACT §3 step 4 on one warp: comb = Sinkhorn(softmax rows of the 16 comb logits), lane i for share
        row i; lanes past the rows redo the last one and store nothing."""
        lane = cute.arch.lane_idx()
        i = cutlass.min(lane, share_rows - 1)
        r = self.row_scale(sMix, i, rms_eps)
        rC = cute.make_rmem_tensor((HC * HC,), Float32)
        for a in cutlass.range_constexpr(HC):
            logits = []
            for b in cutlass.range_constexpr(HC):
                n = 2 * HC + HC * a + b
                logits.append((sMix[i * NV + n] * r) * sParam[2] + sParam[3 + n])
            top = cute.arch.fmax(cute.arch.fmax(logits[0], logits[1]), cute.arch.fmax(logits[2], logits[3]))
            ex = [prim.exp_approx(logits[b] - top) for b in range(HC)]
            inv = prim.rcp_approx((ex[0] + ex[1]) + (ex[2] + ex[3]))
            for b in cutlass.range_constexpr(HC):
                rC[a * HC + b] = ex[b] * inv + sinkhorn_eps
        self.normalize_columns(rC, sinkhorn_eps)
        for _ in cutlass.range(self.repeat - 1, unroll=SINKHORN_UNROLL):
            self.sinkhorn_step(rC, sinkhorn_eps)
        if lane < share_rows:
            for a in cutlass.range_constexpr(HC):
                for b in cutlass.range_constexpr(HC):
                    mComb[share_row0 + i, a, b] = rC[a * HC + b]

    @cute.jit
    def sinkhorn_step(self, rC: cute.Tensor, eps: Float32):
        """One Sinkhorn repeat in place on a register 4 x 4 matrix: rows, then columns."""
        for a in cutlass.range_constexpr(HC):
            c = [rC[a * HC + b] for b in range(HC)]
            inv = prim.rcp_approx((c[0] + c[1]) + (c[2] + c[3]) + eps)
            for b in cutlass.range_constexpr(HC):
                rC[a * HC + b] = c[b] * inv
        self.normalize_columns(rC, eps)

    @cute.jit
    def normalize_columns(self, rC: cute.Tensor, eps: Float32):
        """C[a][b] / ((C[0][b] + C[1][b]) + (C[2][b] + C[3][b]) + eps)."""
        for b in cutlass.range_constexpr(HC):
            total = (rC[b] + rC[HC + b]) + (rC[2 * HC + b] + rC[3 * HC + b])
            inv = prim.rcp_approx(total + eps)
            for a in cutlass.range_constexpr(HC):
                rC[a * HC + b] = rC[a * HC + b] * inv

    @property
    def finish_threads(self) -> int:
        """Threads of a finish CTA: one per (group, element) of its row, at least 2 warps."""
        return max(2, -(-self.groups * NV // WARP)) * WARP

    @cute.kernel
    def finish_kernel(
        self,
        mScale: cute.Tensor,
        mBase: cute.Tensor,
        mPost: cute.Tensor,
        mComb: cute.Tensor,
        mPre: cute.Tensor,
        mRank: cute.Tensor,
        rms_eps: Float32,
        pre_eps: Float32,
        sinkhorn_eps: Float32,
        post_mult: Float32,
    ):
        """Schedule "partials", second launch: CTA b finishes row b (finish_row)."""
        self.finish_row(mScale, mBase, mPost, mComb, mPre, mRank, rms_eps, pre_eps, sinkhorn_eps, post_mult)

    @cute.kernel
    def own_finish_kernel(
        self,
        mScale: cute.Tensor,
        mBase: cute.Tensor,
        mPost: cute.Tensor,
        mComb: cute.Tensor,
        mPre: cute.Tensor,
        mRank: cute.Tensor,
        rms_eps: Float32,
        pre_eps: Float32,
        sinkhorn_eps: Float32,
        post_mult: Float32,
        mX: cute.Tensor,
        mW: cute.Tensor,
        mOut: cute.Tensor,
        mQ: cute.Tensor | None,
        mQScale: cute.Tensor | None,
        norm_eps: Float32,
    ):
        """finish_kernel with the row's own-pre layer input (and its quantized form) written too."""
        own_args = (mX, mW, mOut, mQ, mQScale, norm_eps)
        self.finish_row(mScale, mBase, mPost, mComb, mPre, mRank, rms_eps, pre_eps, sinkhorn_eps, post_mult, own_args)

    @cute.jit
    def finish_row(
        self,
        mScale: cute.Tensor,
        mBase: cute.Tensor,
        mPost: cute.Tensor,
        mComb: cute.Tensor,
        mPre: cute.Tensor,
        mRank: cute.Tensor,
        rms_eps: Float32,
        pre_eps: Float32,
        sinkhorn_eps: Float32,
        post_mult: Float32,
        own_args: tuple | None = None,
    ):
        """CTA b finishes row b. Thread (g, n) sums group g's 8 CTA partials of element n in rank order (the cluster
        sum; 8 loads in flight), then 25 threads sum the G groups in order (the finishing CTA's sum): the tile
        schedule's bits. Then the epilogue."""
        tidx, _, _ = cute.arch.thread_idx()
        row, _, _ = cute.arch.block_idx()
        smem = cutlass.memory.SmemAllocator()
        sGroup = smem.allocate_tensor(Float32, cute.make_layout(self.groups * NV), byte_alignment=16)
        sMix = smem.allocate_tensor(Float32, cute.make_layout(NV), byte_alignment=16)
        sParam = smem.allocate_tensor(Float32, cute.make_layout(3 + MIX), byte_alignment=16)
        own = self.own_finish if const_expr(own_args is not None) else None
        own_buffers = own.allocate(smem, 1) if const_expr(own is not None) else None
        if tidx < 3:
            sParam[tidx] = mScale[tidx]
        if tidx < MIX:
            sParam[3 + tidx] = mBase[tidx]
        cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()
        if tidx < self.groups * NV:
            g = tidx // NV
            n = tidx - g * NV
            parts = [mRank[g * CLUSTER + r, row, n] for r in range(CLUSTER)]
            acc = parts[0]
            for r in cutlass.range_constexpr(1, CLUSTER):
                acc = acc + parts[r]
            sGroup[tidx] = acc
        cute.arch.sync_threads()
        if tidx < NV:
            total = sGroup[tidx]
            for g in cutlass.range_constexpr(1, self.groups):
                total = total + sGroup[g * NV + tidx]
            sMix[tidx] = total
        cute.arch.sync_threads()
        self.finish_rows(
            sMix,
            sParam,
            row,
            Int32(1),
            mPost,
            mComb,
            mPre,
            rms_eps,
            pre_eps,
            sinkhorn_eps,
            post_mult,
            own,
            own_buffers,
            own_args,
        )
