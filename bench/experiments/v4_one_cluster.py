"""DeepSeek-V4's boundary in ONE launch at few rows (#47's <= 5 us target), an experiment, not shipped code.

The shipped V4 boundary is the residual-only boundary (R' written), then the coefficients kernel's own-pre variant
(R' read back by ~128 K-slice CTAs, their sums handed to a finishing CTA through L2, Sinkhorn beside the layer input):
5.6-7.3 us at <= 16 rows on the H200. Its chain holds two kernels, an L2 handoff and R' read back. Here a cluster of
C CTAs (16 at H 7168, 8 at H 4096) owns a row's whole 4H width, as V4's one-launch `final` does with hc_head's 4 mixes,
and holds all 24 mixes' fn in registers (each thread one 8-column vector of one stream: 24 x 8 fp32, loaded before the
PDL wait), so one launch makes R', its 25 sums, post / comb / pre, the collapse and the norm, for up to 8 rows a
cluster with one exchange of each kind for all of them:

  after the wait every row's y, streams, post and comb into shared memory (cp.async, one round trip);
  thread (j, v) of CTA c, row by row: R'_j at vector c*V + v (the boundary's operations), stored, its 24 dot
  products with fn and its sum of squares, warp sums into shared memory;
  thread (row, n): the CTA's sum of total n (warps in order), pushed to every CTA of the cluster (st.async); then the
  cluster's (CTAs in order): the rows' 25 totals in the coefficients epilogue's layout;
  CTA 0: one warp post and pre (lane per row), another comb (softmax, Sinkhorn; lane per row), both the coefficients
  epilogue's code; the collapse warps of every CTA: each row's collapse with its pre, sums of squares through a second
  exchange, the norm, the layer input.

Three variants. `fma` (OneClusterV4): the mixes' dot products are fp32 FMAs in a fixed order, so post / comb / pre /
the layer input differ from the shipped path's in the last bits (held to the reference by tolerance). `exact`
(OneClusterV4Exact): the bits of the shipped path, so that a shipped form could take few rows while the
partials schedule takes many without breaking batch invariance: a CTA's 448 / 512 columns are whole slices of the
coefficients kernel's split along K, each warp runs that kernel's split-bf16 MMAs on its 8 chunks (rows in the
m-tile's upper half), the chunks are folded as it folds them (warp, rank, group order; the slices go to an owner CTA
per row, which also runs post / pre and comb and sends the pre to every CTA), and the layer input's sum of squares
keeps the own-pre layer input's order (every CTA gets every vector's square: a third exchange). The exact variant
also writes the MXFP8 form (`--forms mxfp8`): a task's 4 vectors are one 32-column block (its amax without a shuffle,
Mxfp8Writer's scale and rounding), the scale bytes stored one at a time (a CTA's 448 columns at H 7168 hold 3.5 scale
words), the 128-row padding zeroed a (row, word) at a time over every CTA of the launch; and FP8 1x128 (`--forms fp8`):
each block's amax goes to every CTA (a 128-column group's 4 blocks lie in two CTAs at H 7168: one more exchange, after
the norm), then Fp8GroupWriter's scale and rounding. W = 1, a ready partial, up to 8 rows a cluster. `persistent`
(OneClusterV4Persistent, for many rows): the exact variant's steps with a few clusters looping over batches of 8 rows,
fn loaded once, the next batch's rows staged during the current one's exchanges, comb's Sinkhorn after the last batch.

    python -m bench.experiments.v4_one_cluster [--hidden 4096 7168] [--rows 1 4 8 16] [--variant fma exact persistent]
        [--forms bf16 mxfp8 fp8] [--weights cold warm] [--prefetch] [--isolate] [--max-clusters 4] [--replays 7]
        [--compile-only]

Prints, per variant, form, weights and shape: GPU us per call of the one launch and of the shipped
`V4Boundaries.sublayer` (same form), one graph method (bench.timing); each output's largest error against the reference
(the shipped path's beside it); and how many words differ from the shipped path's (all 0 is the exact variants' claim,
quantized bytes included). `cold`: each call of a graph its own layer's weights, so fn comes from HBM (a step's case,
where this design's few SMs pull 1.5-2.75 MB of fn through their own load queues); `warm`: one layer's for every call.
`--prefetch`: each CTA first asks its fn lines into L2 (no registers held), then loads them. In a graph of calls each
call's loads before its PDL wait overlap the call before it (cold only for the first call's part that does not);
`--isolate` puts a zeroing kernel without PDL between calls (its own time subtracted), so that every call pays its
loads, as after a sublayer's GEMM that leaves no SM free; the step experiment (v4_one_cluster_step.py) is the real
case.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import cutlass
import cutlass.cute as cute
import torch
from cutlass import BFloat16, Float8E4M3FN, Float32, Int32, Int64, Uint8, Uint32, const_expr
from cutlass.cutlass_dsl import dsl_user_op

from cute_kernels import HC, MXFP8_BLOCK, VEC, ptx, reduce
from cute_kernels.coefficients.config import CHUNK, CLUSTER, MIX, NV, projection_split
from cute_kernels.coefficients.epilogue import EpilogueRole
from cute_kernels.coefficients.layer_input import collapse_vector, normed_vector, square_sum
from cute_kernels.compile import compile_kernel, fake_stream, fake_tensor
from cute_kernels.quant import Fp8GroupWriter, block_scale, group_words, quantize_words

SLOT = 28  # floats per warp slot of the mixes exchange: 24 dot products and the sum of squares, 16-byte pushes
MAX_SHARE = 8  # rows a cluster may take at most (shared memory is sized for them); the persistent variant's batch
MAX_BATCHES = 32  # batches one persistent cluster may take (lanes of its Sinkhorn warp)
CLUSTERS = {4096: 8, 7168: 16}  # CTAs per row's cluster: 24 x 8 fn values a thread, one thread per (stream, vector)
VARIANTS = ("fma", "exact", "persistent")  # OneClusterV4, OneClusterV4Exact, OneClusterV4Persistent
FORMS = ("bf16", "mxfp8", "fp8")  # the layer input alone, or with its MXFP8 or FP8 1x128 form (the exact variants)
QUANTIZE = {"bf16": False, "mxfp8": "mxfp8", "fp8": "fp8_1x128"}  # each form's V4Boundaries.sublayer(quantize=)
LI_SLICES = 8  # the layer-input kernel's column slices (its CTAs of a cluster), whose order the own-pre form keeps


class OneClusterV4:
    """The V4 boundary of rows whose 4H width one cluster of `cluster_n` CTAs owns, in one launch."""

    def __init__(
        self, H: int, cluster_n: int, max_clusters: int, sinkhorn_repeat: int = 20, *, prefetch: bool = False
    ) -> None:
        if H % (cluster_n * VEC):
            raise ValueError(f"H {H} does not split into {cluster_n} CTAs of whole vectors")
        self.H = H
        self.C = cluster_n
        self.V = H // cluster_n // VEC  # vectors of one stream per CTA
        self.threads = HC * self.V
        if self.threads % 32 or self.threads > 256:
            # 24 x 8 fn values a thread: 255 registers, so at most 256 threads in an SM's 64K registers.
            raise ValueError(f"{self.threads} threads (4 x {self.V} vectors): not a whole number of warps <= 256")
        self.warps = self.threads // 32
        self.K = HC * H
        self.max_clusters = max_clusters
        self.collapse_warps = -(-self.V // 32)
        self.sink_warp = self.warps - 1  # CTA 0's: comb of the cluster's rows
        self.pp_warp = self.warps - 2  # CTA 0's: post and pre
        if self.pp_warp < self.collapse_warps:
            raise ValueError(f"{self.warps} warps leave none apart from the collapse's {self.collapse_warps}")
        self.sq_slots = cluster_n * self.collapse_warps
        self.max_share = min(MAX_SHARE, self.threads // NV)  # rows a cluster takes: a thread per (row, total)
        self.epi = EpilogueRole(self.K, sinkhorn_repeat, self.threads, 1)
        self.prefetch = prefetch  # the CTA's fn lines asked into L2 before its register loads (prefetch_fn)

    @cute.jit
    def __call__(
        self,
        mR: cute.Tensor,  # [T, 4, H] bf16 streams
        mX: cute.Tensor,  # [T, H] bf16 reduced partial y
        mPost: cute.Tensor,  # [T, 4] fp32 carried post
        mComb: cute.Tensor,  # [T, 4, 4] fp32 carried comb
        mFn: cute.Tensor,  # [24, 4H] fp32
        mParam: cute.Tensor,  # [27] fp32: scale (3), base (24)
        mW: cute.Tensor,  # [H] bf16 norm weight
        mNewR: cute.Tensor,  # [T, 4, H] bf16
        mOut: cute.Tensor,  # [T, H] bf16 layer input
        mPostOut: cute.Tensor,  # [T, 4] fp32
        mCombOut: cute.Tensor,  # [T, 4, 4] fp32
        mPreOut: cute.Tensor,  # [T, 4] fp32
        mQ: cute.Tensor | None,  # exact variants, a quantized form: [T, H] e4m3
        mScale: cute.Tensor | None,  # mxfp8: swizzled 128x4 E8M0 scales (128-row padded); fp8: [H/128, T_pad] fp32
        rms_eps: Float32,
        pre_eps: Float32,
        sinkhorn_eps: Float32,
        post_mult: Float32,
        norm_eps: Float32,
        stream,
    ):
        split, clusters = self.launch_shape(mR.shape[0])
        self.kernel(
            mR, mX, mPost, mComb, mFn, mParam, mW, mNewR, mOut, mPostOut, mCombOut, mPreOut, mQ, mScale,
            rms_eps, pre_eps, sinkhorn_eps, post_mult, norm_eps, split,
        ).launch(
            grid=[self.C, clusters, 1],
            block=[self.threads, 1, 1],
            cluster=[self.C, 1, 1],
            stream=stream,
            use_pdl=True,
        )  # fmt: skip

    def launch_shape(self, rows: Int32) -> tuple:
        """(rows a cluster, clusters) of a call: at most max_share rows a cluster (shared memory, one m-tile half, one
        owner CTA a row), spread over up to max_clusters clusters, more where they need them."""
        share = cutlass.max(cutlass.min((rows + (self.max_clusters - 1)) // self.max_clusters, self.max_share), 1)
        return share, (rows + share - 1) // share

    @cute.kernel
    def kernel(
        self,
        mR: cute.Tensor,
        mX: cute.Tensor,
        mPost: cute.Tensor,
        mComb: cute.Tensor,
        mFn: cute.Tensor,
        mParam: cute.Tensor,
        mW: cute.Tensor,
        mNewR: cute.Tensor,
        mOut: cute.Tensor,
        mPostOut: cute.Tensor,
        mCombOut: cute.Tensor,
        mPreOut: cute.Tensor,
        mQ: cute.Tensor | None,
        mScale: cute.Tensor | None,
        rms_eps: Float32,
        pre_eps: Float32,
        sinkhorn_eps: Float32,
        post_mult: Float32,
        norm_eps: Float32,
        split: Int32,
    ):
        """The launch: the variant's body on its tensors, eps values and `split` (rows a cluster, or with the
        persistent variant the call's batches)."""
        io = (mR, mX, mPost, mComb, mFn, mParam, mW, mNewR, mOut, mPostOut, mCombOut, mPreOut, mQ, mScale)
        self.body(io, (rms_eps, pre_eps, sinkhorn_eps, post_mult, norm_eps), split)

    @cute.jit
    def body(self, io: tuple, eps: tuple, share: Int32):
        """One cluster's rows: the fma variant (the class docstring)."""
        mR, mX, mPost, mComb, mFn, mParam, mW, mNewR, mOut, mPostOut, mCombOut, mPreOut, mQ, mScale = io
        rms_eps, pre_eps, sinkhorn_eps, post_mult, norm_eps = eps
        tidx, _, _ = cute.arch.thread_idx()
        cta, cluster, _ = cute.arch.block_idx()
        warp = tidx // 32
        lane = cute.arch.lane_idx()
        j = tidx // self.V  # this thread's stream
        v = tidx - j * self.V  # and its vector of the CTA's chunk
        vc = cta * self.V + v  # the vector's index in a row
        rows = mR.shape[0]
        row0 = cluster * share
        count = cutlass.min(share, rows - row0)
        V, C, W = self.V, self.C, self.warps

        smem = cutlass.memory.SmemAllocator()
        sIn, sCo, sRp = self.allocate_rows(smem)
        sWarp = smem.allocate_tensor(Float32, cute.make_layout(MAX_SHARE * W * NV), byte_alignment=16)
        sSlot = smem.allocate_tensor(Float32, cute.make_layout(MAX_SHARE * C * NV), byte_alignment=16)
        sTot = smem.allocate_tensor(Float32, cute.make_layout(MAX_SHARE * NV), byte_alignment=16)
        sSq = smem.allocate_tensor(Float32, cute.make_layout(MAX_SHARE * self.sq_slots), byte_alignment=16)
        sParam = smem.allocate_tensor(Float32, cute.make_layout(3 + MIX), byte_alignment=16)
        mbar = smem.allocate_array(cutlass.Int64, num_elems=2)  # the mixes' exchange, the squares'
        if tidx == 0:
            for s in cutlass.range_constexpr(2):
                cute.arch.mbarrier_init(mbar + s, 1)
        cute.arch.mbarrier_init_fence()
        cute.arch.cluster_arrive_relaxed()

        # Weights, before the wait: this thread's fn values (24 mixes x 8 columns of stream j), the mix parameters,
        # the norm weight of vector v (the collapse threads).
        self.prefetch_fn(mFn, cta, tidx)
        fn_base = mFn.iterator.toint() + (Int64(j * self.H) + Int64(vc * VEC)) * 4
        f = []
        for m in cutlass.range_constexpr(MIX):
            lo = ptx.ld_global_v4_pred(fn_base + Int64(m * self.K) * 4, cutlass.Boolean(True))
            hi = ptx.ld_global_v4_pred(fn_base + Int64(m * self.K) * 4 + 16, cutlass.Boolean(True))
            f.append([ptx.f32_from_bits(w) for w in (*lo, *hi)])
        if tidx < 3 + MIX:
            sParam[tidx] = mParam[tidx]
        w_words = ptx.ld_global_v4_pred(
            mW.iterator.toint() + Int64(cta * V + cutlass.min(tidx, V - 1)) * (VEC * 2), tidx < V
        )
        cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()
        self.stage_rows(mR, mX, mPost, mComb, sIn, sCo, row0, count, cta, tidx)
        cute.arch.cp_async_wait_group(0)
        cute.arch.barrier()
        for i in cutlass.range(count):
            row = row0 + i
            words = self.new_stream(sIn, sCo, i, j, v)
            nb = mNewR.iterator.toint() + (Int64(row) * (HC * self.H) + Int64(j * self.H) + Int64(vc * VEC)) * 2
            ptx.st_global_v4_b32(nb, words[0], words[1], words[2], words[3])
            ptx.st_v4_i32(sRp.iterator + ((i * HC + j) * V + v) * 4, tuple(words))
            # The 24 dot products and the sum of squares, elements in order; then the warp's sums.
            acc = [Float32(0.0) for _ in range(NV)]
            for e in cutlass.range_constexpr(VEC):
                x = ptx.bf16_lo(words[e // 2]) if e % 2 == 0 else ptx.bf16_hi(words[e // 2])
                acc[MIX] = ptx.mul_add_rn(x, x, acc[MIX])
                for m in cutlass.range_constexpr(MIX):
                    acc[m] = ptx.mul_add_rn(f[m][e], x, acc[m])
            sums = [reduce.warp_sum(a) for a in acc]
            if lane == 0:
                for n in cutlass.range_constexpr(NV):
                    sWarp[(i * W + warp) * NV + n] = sums[n]
        cute.arch.cluster_wait()  # every peer's mbarriers are initialised
        cute.arch.barrier()  # every warp's sums of every row in sWarp
        # The CTA's sums (warps in order), thread (i, n) each, pushed to every CTA; then the cluster's (CTAs in order).
        if warp == 0:
            reduce.expect_bytes(mbar, count * (C * NV * 4))
        if tidx < count * NV:
            i, n = tidx // NV, tidx % NV
            s = reduce.ordered_sum([sWarp[(i * W + w) * NV + n] for w in range(W)])
            for c in cutlass.range_constexpr(C):
                reduce.push(sSlot.iterator + (i * C + cta) * NV + n, s, mbar, Int32(c))
        reduce.wait_pushes(mbar, Int32(0), False)
        if tidx < count * NV:
            i, n = tidx // NV, tidx % NV
            sTot[i * NV + n] = reduce.ordered_sum([sSlot[(i * C + c) * NV + n] for c in range(C)])
        cute.arch.barrier()  # the rows' 25 totals in sTot, the layout the coefficients epilogue reads
        if cta == 0:
            if warp == self.pp_warp:
                if lane < count:
                    mixes = self.epi.row_mixes(sTot, lane, rms_eps, 2 * HC)
                    self.epi.row_pre_post(mixes, sParam, row0 + lane, mPostOut, mPreOut, pre_eps, post_mult)
            if warp == self.sink_warp:
                self.epi.row_comb(sTot, sParam, row0, count, mCombOut, rms_eps, sinkhorn_eps)
        if warp < self.collapse_warps:
            self.layer_input(
                sRp, sTot, sSq, sParam, mbar + 1, mOut, w_words, rms_eps, pre_eps, norm_eps, row0, count, cta
            )  # fmt: skip

    def allocate_rows(self, smem: cutlass.memory.SmemAllocator, new_streams: bool = True) -> tuple:
        """Shared memory of the rows: their inputs (y and the 4 streams per vector), post and comb, and (unless
        `new_streams` is False: None) R'."""
        V = self.V
        sIn = smem.allocate_tensor(Int32, cute.make_layout(MAX_SHARE * (HC + 1) * V * 4), byte_alignment=16)
        sCo = smem.allocate_tensor(Float32, cute.make_layout(MAX_SHARE * 5 * HC), byte_alignment=16)
        sRp = None
        if new_streams:
            sRp = smem.allocate_tensor(Int32, cute.make_layout(MAX_SHARE * HC * V * 4), byte_alignment=16)
        return sIn, sCo, sRp

    @cute.jit
    def prefetch_fn(self, mFn: cute.Tensor, cta: Int32, tidx: Int32):
        """Where `prefetch`: every 128-byte line of the CTA's fn columns (24 mixes x 4 streams x its H / C columns)
        asked into L2, a share a thread, before the register loads: those are bounded by what an SM keeps in flight,
        a prefetch holds no register, so HBM streams the CTA's whole share at once."""
        if const_expr(self.prefetch):
            run_lines = const_expr(self.H // self.C * 4 // 128)  # lines of one (mix, stream) run of columns
            base = mFn.iterator.toint() + Int64(cta * (self.H // self.C) * 4)
            for i in cutlass.range(tidx, MIX * HC * run_lines, self.threads):
                run = i // run_lines  # m * 4 + j: the run at m * K + j * H
                ptx.prefetch_l2(base + Int64(run) * (self.H * 4) + Int64((i - run * run_lines) * 128))

    @cute.jit
    def stage_rows(
        self,
        mR: cute.Tensor,
        mX: cute.Tensor,
        mPost: cute.Tensor,
        mComb: cute.Tensor,
        sIn: cute.Tensor,
        sCo: cute.Tensor,
        row0: Int32,
        count: Int32,
        cta: Int32,
        tidx: Int32,
    ):
        """Every row's inputs into shared memory at once (cp.async, committed): thread (j, v) its stream j's vector
        (and y's, j == 0); threads (i, q) < 5 * count the row's post (q 0) and comb rows (q 1-4), 16 bytes each."""
        V = self.V
        j = tidx // V
        v = tidx - j * V
        vc = cta * V + v
        for i in cutlass.range(count):
            row = row0 + i
            slot = sIn.iterator + ((i * (HC + 1) + 1 + j) * V + v) * 4
            ptx.cp_async_16(slot, mR.iterator + (Int64(row) * (HC * self.H) + Int64(j * self.H) + Int64(vc * VEC)))
            if j == 0:
                ptx.cp_async_16(
                    sIn.iterator + (i * (HC + 1) * V + v) * 4, mX.iterator + (Int64(row) * self.H + vc * VEC)
                )
        if tidx < 5 * count:
            i, q = tidx // 5, tidx % 5
            if q == 0:
                ptx.cp_async_16(sCo.iterator + i * 5 * HC, mPost.iterator + (row0 + i) * HC)
            else:
                ptx.cp_async_16(sCo.iterator + (i * 5 + q) * HC, mComb.iterator + ((row0 + i) * HC + (q - 1)) * HC)
        cute.arch.cp_async_commit_group()

    @cute.jit
    def new_stream(self, sIn: cute.Tensor, sCo: cute.Tensor, i: Int32, j: Int32, vv: Int32) -> list:
        """R'_j of staged row i at the CTA's vector vv, 4 packed bf16 words: bf16(post*y + sum_k comb[k, j] * R[k]),
        the boundary kernel's operations (Epilogue.compute_row)."""
        V = self.V
        y = ptx.ld_v4_i32(sIn.iterator + (i * (HC + 1) * V + vv) * 4)
        rs = [ptx.ld_v4_i32(sIn.iterator + ((i * (HC + 1) + 1 + k) * V + vv) * 4) for k in range(HC)]
        post = sCo[(i * 5) * HC + j]
        comb = [sCo[(i * 5 + 1 + k) * HC + j] for k in range(HC)]
        words = []
        for e in cutlass.range_constexpr(0, VEC, 2):
            pair = []
            for h in cutlass.range_constexpr(2):
                unpack = ptx.bf16_lo if h == 0 else ptx.bf16_hi
                acc = ptx.mul_rn(post, unpack(y[e // 2]))
                for k in cutlass.range_constexpr(HC):
                    acc = ptx.mul_add_rn(comb[k], unpack(rs[k][e // 2]), acc)
                pair.append(acc)
            words.append(ptx.cvt_bf16x2(pair[0], pair[1]))
        return words

    @cute.jit
    def collapse(
        self, sRp: cute.Tensor, sTot: cute.Tensor, sParam: cute.Tensor, i: Int32, vv: Int32, rms_eps, pre_eps
    ) -> list:
        """Vector vv of row i collapsed with the row's pre (from its totals: the coefficients epilogue's operations,
        row_mixes then row_pre_post's sigmoid), its 4 new streams from shared memory."""
        mixes = self.epi.row_mixes(sTot, i, rms_eps, HC)
        pre = []
        for jj in cutlass.range_constexpr(HC):
            z = mixes[jj] * sParam[0] + sParam[3 + jj]
            pre.append(ptx.rcp_approx(Float32(1.0) + ptx.exp_approx(-z)) + pre_eps)
        streams = [ptx.ld_v4_i32(sRp.iterator + ((i * HC + jj) * self.V + vv) * 4) for jj in range(HC)]
        return collapse_vector(pre, streams)

    @cute.jit
    def layer_input(
        self,
        sRp: cute.Tensor,
        sTot: cute.Tensor,
        sSq: cute.Tensor,
        sParam: cute.Tensor,
        mbar: cute.Pointer,
        mOut: cute.Tensor,
        w_words: tuple,
        rms_eps: Float32,
        pre_eps: Float32,
        norm_eps: Float32,
        row0: Int32,
        count: Int32,
        cta: Int32,
    ):
        """The collapse warps: vector v's collapse of each row with its pre, the cluster's sums of squares (one
        exchange for every row, slots in order), then the normed vectors."""
        tidx, _, _ = cute.arch.thread_idx()
        warp = tidx // 32
        lane = cute.arch.lane_idx()
        V, cw = self.V, self.collapse_warps
        vv = cutlass.min(tidx, V - 1)
        if warp == 0:
            reduce.expect_bytes(mbar, count * (self.sq_slots * 4))
        for i in cutlass.range(count):
            c = self.collapse(sRp, sTot, sParam, i, vv, rms_eps, pre_eps)
            part = Float32(cutlass.select_(tidx < V, square_sum(c), Float32(0.0)))
            total_w = reduce.warp_sum(part)
            if lane < self.C:
                reduce.push(sSq.iterator + i * self.sq_slots + cta * cw + warp, total_w, mbar, lane)
        reduce.wait_pushes(mbar, Int32(0), False)
        for i in cutlass.range(count):
            part = Float32(0.0)
            for s in cutlass.range_constexpr(-(-self.sq_slots // 32)):
                if lane + s * 32 < self.sq_slots:
                    part = part + sSq[i * self.sq_slots + lane + s * 32]
            total = reduce.warp_sum(part)
            inv = ptx.rsqrt_approx(ptx.div_rn(total, Float32(self.H)) + norm_eps)
            c = self.collapse(sRp, sTot, sParam, i, vv, rms_eps, pre_eps)
            out = normed_vector(c, inv, w_words)
            ob = mOut.iterator.toint() + (Int64(row0 + i) * self.H + Int64((cta * V + vv) * VEC)) * 2
            ptx.st_global_v4_pred(ob, out[0], out[1], out[2], out[3], tidx < V)


class OneClusterV4Exact(OneClusterV4):
    """OneClusterV4 with the shipped path's bits: the mixes by the coefficients kernel's own split-bf16 MMAs on the
    same 32-column chunks, folded as it folds them (a slice's chunks in warp order, a group's slices in rank order, the
    groups in order), and the layer input's sum of squares in the own-pre layer input's order (a slice's vectors in lane
    order, the butterfly, the 8 slices in order). A CTA's columns are whole slices of that split, so each chunk's
    partial is the one the shipped kernel makes; each row's slices go to an owner CTA (one row each, up to C rows), which
    folds them, runs post / pre and comb for it and sends the pre to every CTA. Three exchanges: slices, pre, squares."""

    def __init__(
        self,
        H: int,
        cluster_n: int,
        max_clusters: int,
        sinkhorn_repeat: int = 20,
        *,
        quant: str | None = None,
        prefetch: bool = False,
    ) -> None:
        super().__init__(H, cluster_n, max_clusters, sinkhorn_repeat, prefetch=prefetch)
        if quant not in (None, "mxfp8", "fp8"):
            raise ValueError(f"quant must be None, 'mxfp8' or 'fp8' (FP8 1x128), got {quant!r}")
        self.mxfp8 = quant == "mxfp8"  # the layer input's MXFP8 form too (a task's 4 vectors are one 32-column block)
        # FP8 1x128: a group's 4 blocks may lie in two CTAs (H 7168), so their amaxes go round the cluster.
        self.fp8 = Fp8GroupWriter(H, ue8m0=False) if quant == "fp8" else None
        self.scale_cols = H // MXFP8_BLOCK  # a multiple of 4: H is one of 128
        self.Wc, self.G = projection_split(H, False)  # chunks a slice, groups of 8 slices
        self.slice_cols = CHUNK * self.Wc
        self.cols = H // cluster_n
        if self.cols % self.slice_cols:
            raise ValueError(f"a CTA's {self.cols} columns are not whole {self.slice_cols}-column slices at H {H}")
        self.kc = self.cols // CHUNK  # chunks of one stream a CTA
        self.spc = self.cols // self.slice_cols  # slices of one stream a CTA
        self.nchunks = HC * self.kc
        if self.nchunks % self.warps:
            raise ValueError(f"{self.nchunks} chunks do not split over {self.warps} warps")
        self.cpw = self.nchunks // self.warps  # chunks a warp: 24 fn words each a lane
        self.slices = HC * H // self.slice_cols
        self.stream_slices = H // self.slice_cols
        self.quads = self.V // 4  # collapse tasks of a row: 4 vectors each
        self.li_vecs = H // VEC // LI_SLICES  # vectors of one of the layer input's 8 column slices
        self.workers = (self.warps - 2) * 32  # every warp but the post / pre and Sinkhorn warps
        self.max_share = min(MAX_SHARE, cluster_n, self.workers // self.quads)

    @cute.jit
    def body(self, io: tuple, eps: tuple, share: Int32):
        """One cluster's rows: the exact variant (the class docstring)."""
        mR, mX, mPost, mComb, mFn, mParam, mW, mNewR, mOut, mPostOut, mCombOut, mPreOut, mQ, mScale = io
        rms_eps, pre_eps, sinkhorn_eps, post_mult, norm_eps = eps
        tidx, _, _ = cute.arch.thread_idx()
        cta, cluster, _ = cute.arch.block_idx()
        warp = tidx // 32
        rows = mR.shape[0]
        row0 = cluster * share
        count = cutlass.min(share, rows - row0)
        smem = cutlass.memory.SmemAllocator()
        sIn, sCo, sRp = self.allocate_rows(smem)
        buf = self.allocate_exact(smem)
        sParam, mbar = buf[8], buf[9]
        self.init_barriers(mbar)
        fn, w_words, q = self.weights(mFn, mParam, mW, sParam, cta)
        cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()
        self.stage_rows(mR, mX, mPost, mComb, sIn, sCo, row0, count, cta, tidx)
        if const_expr(self.mxfp8):
            self.zero_scale_padding(mScale, rows, cluster * self.C + cta, tidx)
        split = self.split_fn(fn)  # while the rows are on their way
        cute.arch.cp_async_wait_group(0)
        cute.arch.barrier()
        self.chunks(sIn, sCo, sRp, buf, mNewR, split, row0, count)
        cute.arch.cluster_wait()  # every peer's mbarriers are initialised
        cute.arch.barrier()  # every chunk's partials in sChunk
        self.batch_exchanges(buf, mPostOut, mPreOut, eps, row0, count, Int32(0), None)
        if cta < count:
            if warp == self.sink_warp:
                self.epi.row_comb(buf[3], sParam, row0 + cta, Int32(1), mCombOut, rms_eps, sinkhorn_eps)
        if warp < self.warps - 2:
            self.layer_input_exact(sRp, buf, io, w_words, norm_eps, row0, count, cta, q, Int32(0))

    def allocate_exact(self, smem: cutlass.memory.SmemAllocator) -> tuple:
        """The exact variant's shared memory beyond the rows': (sChunk, sRecv, sGroup, sTot, sOwnPre, sPre, sSq,
        sSlice, sParam, mbar, sAmax), mbar its 4 mbarriers (slices to owners, pre, squares, FP8 1x128 amaxes;
        init_barriers sets them up), sAmax None without FP8 1x128."""
        f32 = lambda n: smem.allocate_tensor(Float32, cute.make_layout(n), byte_alignment=16)  # noqa: E731
        out = (
            f32(self.nchunks * MAX_SHARE * NV),  # sChunk: every chunk's partials of every row
            f32(self.slices * NV),  # sRecv: an owner's row, every slice
            f32(self.G * NV),  # sGroup
            f32(NV),  # sTot
            f32(HC),  # sOwnPre
            f32(MAX_SHARE * HC),  # sPre: every row's
            f32(MAX_SHARE * (self.H // VEC)),  # sSq: every row's vectors' squares
            f32(MAX_SHARE * LI_SLICES),  # sSlice
            f32(3 + MIX),  # sParam
        )
        mbar = smem.allocate_array(cutlass.Int64, num_elems=4)
        sAmax = None  # FP8 1x128: every row's blocks' amax bits
        if self.fp8 is not None:
            sAmax = smem.allocate_tensor(
                Int32, cute.make_layout(MAX_SHARE * (self.H // MXFP8_BLOCK)), byte_alignment=16
            )
        return out + (mbar, sAmax)

    @cute.jit
    def init_barriers(self, mbar: cute.Pointer):
        """The 4 mbarriers initialised (one arrival a phase) and announced to the cluster (cluster_wait before the
        first push)."""
        tidx, _, _ = cute.arch.thread_idx()
        if tidx == 0:
            for s in cutlass.range_constexpr(4):
                cute.arch.mbarrier_init(mbar + s, 1)
        cute.arch.mbarrier_init_fence()
        cute.arch.cluster_arrive_relaxed()

    @cute.jit
    def weights(self, mFn: cute.Tensor, mParam: cute.Tensor, mW: cute.Tensor, sParam: cute.Tensor, cta: Int32):
        """Before the wait: this lane's fn values of each of its warp's chunks (the coefficients kernel's load_fn: fn
        rows 8 jn + g at the lane's 8 columns), the mix parameters into sParam, the norm weight of its task's vectors.
        Returns (fn, the weight words, the task's vector quad q)."""
        tidx, _, _ = cute.arch.thread_idx()
        warp = tidx // 32
        lane = cute.arch.lane_idx()
        g, t = lane // 4, lane % 4
        self.prefetch_fn(mFn, cta, tidx)
        fn = []
        for u in cutlass.range_constexpr(self.cpw):
            lc = warp + self.warps * u
            js = lc // self.kc
            col = js * self.H + cta * self.cols + (lc - js * self.kc) * CHUNK + t * VEC
            per = []
            for jn in cutlass.range_constexpr(3):
                base = mFn.iterator + ((8 * jn + g) * self.K + col)
                per.append(list(ptx.ld_v4_f32(base) + ptx.ld_v4_f32(base + 4)))
            fn.append(per)
        if tidx < 3 + MIX:
            sParam[tidx] = mParam[tidx]
        q = tidx % self.quads
        w_words = [
            ptx.ld_global_v4_pred(
                mW.iterator.toint() + Int64(cta * self.V + 4 * q + m) * (VEC * 2), cutlass.Boolean(True)
            )
            for m in range(4)
        ]
        return fn, w_words, q

    def split_fn(self, fn: list) -> list:
        """The B fragments of each chunk: [chunk](hi, lo), each [n-tile][pair] bf16x2 words (split_bf16x2)."""
        split = []
        for u in range(self.cpw):
            hi, lo = [], []
            for jn in range(3):
                pairs = [ptx.split_bf16x2(fn[u][jn][2 * p], fn[u][jn][2 * p + 1]) for p in range(4)]
                hi.append([h for h, _ in pairs])
                lo.append([low for _, low in pairs])
            split.append((hi, lo))
        return split

    @cute.jit
    def chunks(
        self,
        sIn: cute.Tensor,
        sCo: cute.Tensor,
        sRp: cute.Tensor,
        buf: tuple,
        mNewR: cute.Tensor,
        split: list,
        row0: Int32,
        count: Int32,
    ):
        """Each chunk of the warp: lane (g, t) makes R' of row g at the chunk's columns 8t.. (stored, and kept for the
        collapse), then the chunk's MMAs as the coefficients kernel's project_batch (rows g < count in the upper half
        of the m-tile, the lower zero), its partials into sChunk."""
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        warp = tidx // 32
        lane = cute.arch.lane_idx()
        g, t = lane // 4, lane % 4
        sChunk = buf[0]
        V = self.V
        zero = Uint32(0)
        real = g < count
        i = cutlass.min(g, count - 1)
        for u in cutlass.range_constexpr(self.cpw):
            lc = warp + self.warps * u
            js = lc // self.kc
            vv = (lc - js * self.kc) * 4 + t
            words = self.new_stream(sIn, sCo, i, js, vv)
            if real:
                nb = (
                    mNewR.iterator.toint()
                    + (Int64(row0 + g) * (HC * self.H) + Int64(js * self.H) + Int64((cta * V + vv) * VEC)) * 2
                )
                ptx.st_global_v4_b32(nb, words[0], words[1], words[2], words[3])
                ptx.st_v4_i32(sRp.iterator + ((g * HC + js) * V + vv) * 4, tuple(words))
            a = [(words[2 * s], zero, words[2 * s + 1], zero) for s in range(2)]
            gram = [Float32(0.0)] * 4
            for s in cutlass.range_constexpr(2):
                gram = list(ptx.mma_bf16(a[s], (words[2 * s], words[2 * s + 1]), gram))
            base = (lc * MAX_SHARE + g) * NV
            hi, lo = split[u]
            for jn in cutlass.range_constexpr(3):
                acc = [Float32(0.0)] * 4
                for s in cutlass.range_constexpr(2):
                    acc = list(ptx.mma_bf16(a[s], (hi[jn][2 * s], hi[jn][2 * s + 1]), acc))
                    acc = list(ptx.mma_bf16(a[s], (lo[jn][2 * s], lo[jn][2 * s + 1]), acc))
                if real:
                    sChunk[base + 8 * jn + 2 * t] = acc[0]
                    sChunk[base + 8 * jn + 2 * t + 1] = acc[1]
            if real:
                if t == g // 2:  # row g's square sum is Gram[g][g]
                    sChunk[base + MIX] = Float32(cutlass.select_((g % 2) == 1, gram[1], gram[0]))

    @cute.jit
    def batch_exchanges(
        self,
        buf: tuple,
        mPostOut: cute.Tensor,
        mPreOut: cute.Tensor,
        eps: tuple,
        row0: Int32,
        count: Int32,
        phase: Int32,
        sKeep: cute.Tensor | None,
    ):
        """A batch's slices to the rows' owners (CTA i for row i; each slice's chunks in warp order), the pre and
        squares exchanges armed; then, on an owner, its row's totals (a group's slices in rank order, a thread per
        (group, total), then the groups in order) into sTot (and sKeep), and its post / pre written and the pre sent
        to every CTA. Every thread of the CTA calls it; it ends on a CTA barrier on an owner."""
        rms_eps, pre_eps, _, post_mult, _ = eps
        sChunk, sRecv, sGroup, sTot, sOwnPre, sPre = buf[0], buf[1], buf[2], buf[3], buf[4], buf[5]
        sParam, mbar = buf[8], buf[9]
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        warp = tidx // 32
        lane = cute.arch.lane_idx()
        if cta < count:
            if warp == 0:
                reduce.expect_bytes(mbar, self.slices * NV * 4)
        per_slice = count * NV
        for e in cutlass.range(tidx, HC * self.spc * per_slice, self.threads):
            sl = e // per_slice
            r = e - sl * per_slice
            ri = r // NV
            n = r - ri * NV
            js = sl // self.spc
            b = sl - js * self.spc
            lc0 = js * self.kc + b * self.Wc
            val = reduce.ordered_sum([sChunk[((lc0 + w) * MAX_SHARE + ri) * NV + n] for w in range(self.Wc)])
            s = js * self.stream_slices + cta * self.spc + b
            reduce.push(sRecv.iterator + s * NV + n, val, mbar, ri)
        if warp == 0:
            reduce.expect_bytes(mbar + 1, count * (HC * 4))
            reduce.expect_bytes(mbar + 2, count * ((self.H // VEC) * 4))
            if const_expr(self.fp8 is not None):
                reduce.expect_bytes(mbar + 3, count * ((self.H // MXFP8_BLOCK) * 4))
        if cta < count:
            reduce.wait_pushes(mbar, phase, False)
            for e in cutlass.range(tidx, self.G * NV, self.threads):
                gg = e // NV
                sGroup[e] = reduce.ordered_sum(
                    [sRecv[(gg * CLUSTER + rr) * NV + (e - gg * NV)] for rr in range(CLUSTER)]
                )
            cute.arch.barrier()
            if tidx < NV:
                total = reduce.ordered_sum([sGroup[gg * NV + tidx] for gg in range(self.G)])
                sTot[tidx] = total
                if const_expr(sKeep is not None):
                    sKeep[tidx] = total
            cute.arch.barrier()
            if warp == self.pp_warp:
                if lane == 0:
                    mixes = self.epi.row_mixes(sTot, 0, rms_eps, 2 * HC)
                    self.epi.row_pre_post(
                        mixes, sParam, row0 + cta, mPostOut, mPreOut, pre_eps, post_mult, sOwnPre, Int32(0)
                    )
                    pre = (sOwnPre[0], sOwnPre[1], sOwnPre[2], sOwnPre[3])
                    for c in cutlass.range_constexpr(self.C):
                        reduce.push(sPre.iterator + cute.assume(cta * HC, divby=4), pre, mbar + 1, Int32(c))

    @cute.jit
    def layer_input_exact(
        self,
        sRp: cute.Tensor,
        buf: tuple,
        io: tuple,
        w_words: list,
        norm_eps: Float32,
        row0: Int32,
        count: Int32,
        cta: Int32,
        q: Int32,
        phase: Int32,
    ):
        """The worker warps: task (row, 4 vectors) collapses its vectors with the row's pre, sends their squares to
        every CTA; each CTA then sums a row's squares in the own-pre layer input's order and normalises (`buf`:
        allocate_exact's buffers, `io`: the launch's tensors)."""
        sPre, sSq, sSlice, mbar, sAmax = buf[5], buf[6], buf[7], buf[9], buf[10]
        mOut, mQ, mScale = io[8], io[12], io[13]
        tidx, _, _ = cute.arch.thread_idx()
        V = self.V
        row_vecs = self.H // VEC
        ti = tidx // self.quads
        task = tidx < count * self.quads
        reduce.wait_pushes(mbar + 1, phase, False)  # every row's pre
        pre = [sPre[cutlass.min(ti, count - 1) * HC + jj] for jj in range(HC)]
        cs = []
        for m in cutlass.range_constexpr(4):
            vv = 4 * q + m
            streams = [
                ptx.ld_v4_i32(sRp.iterator + ((cutlass.min(ti, count - 1) * HC + jj) * V + vv) * 4) for jj in range(HC)
            ]
            cs.append(collapse_vector(pre, streams))
        if task:
            sq = (square_sum(cs[0]), square_sum(cs[1]), square_sum(cs[2]), square_sum(cs[3]))
            for c in cutlass.range_constexpr(self.C):
                dst = sSq.iterator + cute.assume(ti * row_vecs + cta * V + 4 * q, divby=4)
                reduce.push(dst, sq, mbar + 2, Int32(c))
        reduce.wait_pushes(mbar + 2, phase, False)  # every row's squares
        # A row's 8 slice sums, a worker warp each: its vectors in lane order, then the butterfly (OwnInputRole.slice_sums).
        warp = tidx // 32
        lane = cute.arch.lane_idx()
        for task8 in cutlass.range(warp, count * LI_SLICES, self.workers // 32):
            base = (task8 // LI_SLICES) * row_vecs + (task8 % LI_SLICES) * self.li_vecs
            part = Float32(0.0)
            for k in cutlass.range_constexpr(-(-self.li_vecs // 32)):
                if lane + 32 * k < self.li_vecs:
                    part = part + sSq[base + lane + 32 * k]
            part = cute.arch.warp_reduction_sum(part)
            if lane == 0:
                sSlice[task8] = part
        cute.arch.barrier(barrier_id=1, number_of_threads=self.workers)
        tc = cutlass.min(ti, count - 1)
        total = sSlice[tc * LI_SLICES]
        for s8 in cutlass.range_constexpr(1, LI_SLICES):
            total = total + sSlice[tc * LI_SLICES + s8]
        inv = ptx.rsqrt_approx(ptx.div_rn(total, Float32(self.H)) + norm_eps)
        outs = [normed_vector(cs[m], inv, w_words[m]) for m in range(4)]
        block = cta * (V // 4) + q  # this task's 32-column block of the row
        if task:
            for m in cutlass.range_constexpr(4):
                ob = mOut.iterator.toint() + (Int64(row0 + ti) * self.H + Int64((cta * V + 4 * q + m) * VEC)) * 2
                ptx.st_global_v4_b32(ob, outs[m][0], outs[m][1], outs[m][2], outs[m][3])
            if const_expr(self.mxfp8):
                self.quantize_block(outs, mQ, mScale, row0 + ti, block)
        if const_expr(self.fp8 is not None):
            self.quantize_group(outs, sAmax, mbar + 3, mQ, mScale, row0, ti, task, block, cta, phase)

    @cute.jit
    def quantize_group(
        self,
        outs: list,
        sAmax: cute.Tensor,
        mbar: cute.Pointer,
        mQ: cute.Tensor,
        mScale: cute.Tensor,
        row0: Int32,
        ti: Int32,
        task: cutlass.Boolean,
        block: Int32,
        cta: Int32,
        phase: Int32,
    ):
        """FP8 1x128 of the tasks' blocks: each block's amax to every CTA (its group's 4 blocks may lie in two), then
        each task takes its group's amax, Fp8GroupWriter's scale and rounding for its 32 values, and the group's first
        block's task stores the scale (and, on the call's last row, the zeros of the padding rows up to T_pad)."""
        blocks = self.H // MXFP8_BLOCK
        if task:
            amax = Int32(block_amax(outs))
            for c in cutlass.range_constexpr(self.C):
                reduce.push(sAmax.iterator + ti * blocks + block, amax, mbar, Int32(c))
        reduce.wait_pushes(mbar, phase, False)  # every block's amax of every row
        if task:
            first = block // 4 * 4
            gmax = Uint32(sAmax[ti * blocks + first])
            for k in cutlass.range_constexpr(1, 4):
                gmax = cutlass.max(gmax, Uint32(sAmax[ti * blocks + first + k]))
            sf, inverse = self.fp8.scale(gmax)
            row = row0 + ti
            for m in cutlass.range_constexpr(4):
                q_lo, q_hi = group_words(outs[m], inverse)
                ptx.st_global_v2_b32(
                    mQ.iterator.toint() + Int64(row) * self.H + Int64((block * 4 + m) * VEC), q_lo, q_hi
                )
            if block == first:
                padded = mScale.shape[1]  # T_pad
                base = mScale.iterator.toint() + (Int64(block // 4) * Int64(padded)) * 4
                ptx.st_global_b32(base + Int64(row) * 4, ptx.f32_bits(sf))
                rows = mQ.shape[0]
                if row == rows - 1:
                    for k in cutlass.range_constexpr(1, 4):
                        if row + k < padded:
                            ptx.st_global_b32(base + Int64(row + k) * 4, Uint32(0))

    @cute.jit
    def quantize_block(self, outs: list, mQ: cute.Tensor, mScale: cute.Tensor, row: Int32, block: Int32):
        """MXFP8 of one 32-column block of the layer input (its 4 vectors, this thread's): the block amax over its
        32 values (no shuffle), Mxfp8Writer's scale and rounding, the 32 e4m3 bytes and the scale byte (at H 7168 a
        CTA's 448 columns hold 3.5 scale words, so the byte goes out alone)."""
        e, m1, m2 = block_scale(block_amax(outs) << 16)
        for m in cutlass.range_constexpr(4):
            q_lo, q_hi = quantize_words(outs[m], e, m1, m2)
            ptx.st_global_v2_b32(mQ.iterator.toint() + Int64(row) * self.H + Int64((block * 4 + m) * VEC), q_lo, q_hi)
        st_global_u8(mScale.iterator.toint() + self.scale_offset(row, block), Uint32(e))

    @cute.jit
    def scale_offset(self, m: Int32, k: Int32) -> Int64:
        """Byte offset of scale (m, k) in the swizzled 128x4 layout (reference.swizzled_scale_offsets)."""
        return Int64(m // 128) * (128 * self.scale_cols) + Int64(
            (k // 4) * 512 + (m % 32) * 16 + ((m % 128) // 32) * 4 + k % 4
        )

    @cute.jit
    def zero_scale_padding(self, mScale: cute.Tensor, rows: Int32, gcta: Int32, tidx: Int32):
        """This CTA's share (global CTA `gcta` of the launch) of the scale padding rows T..roundup(T, 128)-1, a
        4-byte word (4 blocks of one row) at a time, so that no store touches a real row's bytes."""
        words = self.scale_cols // 4
        pad = (rows + 127) // 128 * 128 - rows
        _, clusters, _ = cute.arch.grid_dim()
        stride = clusters * self.C * self.threads
        for e in cutlass.range(gcta * self.threads + tidx, pad * words, stride):
            m = rows + e // words
            kw = e - (e // words) * words
            ptx.st_global_b32(mScale.iterator.toint() + self.scale_offset(m, kw * 4), Uint32(0))


class OneClusterV4Persistent(OneClusterV4Exact):
    """OneClusterV4Exact for many rows: a few clusters loop over batches of up to 8 rows (batch b of cluster c: rows
    (b * clusters + c) * 8 ..), fn held in registers across them, the next batch's rows staged while this one is
    exchanged, and comb's Sinkhorn of every row a CTA owns run once after the last batch (a lane a row). The same
    bits as the exact variant (the same operations on each row)."""

    def __init__(self, H: int, cluster_n: int, max_clusters: int, sinkhorn_repeat: int = 20, **options: Any) -> None:
        super().__init__(H, cluster_n, max_clusters, sinkhorn_repeat, **options)  # quant, prefetch
        if self.max_share < MAX_SHARE:  # a batch's every row needs an owner CTA and its collapse tasks
            raise ValueError(f"a persistent cluster of {cluster_n} CTAs takes {self.max_share} rows, not {MAX_SHARE}")
        self.max_share = MAX_SHARE  # a batch: a cluster takes any number of them (up to MAX_BATCHES)

    def launch_shape(self, rows: Int32) -> tuple:
        """(the call's batches of 8 rows, clusters): enough clusters that none takes more than MAX_BATCHES batches,
        at most max_clusters where that suffices."""
        batches = (rows + MAX_SHARE - 1) // MAX_SHARE
        return batches, cutlass.max(cutlass.min(batches, self.max_clusters), (batches + MAX_BATCHES - 1) // MAX_BATCHES)

    @cute.jit
    def body(self, io: tuple, eps: tuple, batches: Int32):
        """A cluster's batches (the class docstring); `batches`: of the whole call."""
        mR, mX, mPost, mComb, mFn, mParam, mW, mNewR, mOut, mPostOut, mCombOut, mPreOut, mQ, mScale = io
        rms_eps, _, sinkhorn_eps, _, norm_eps = eps
        tidx, _, _ = cute.arch.thread_idx()
        cta, cluster, _ = cute.arch.block_idx()
        _, clusters, _ = cute.arch.grid_dim()
        warp = tidx // 32
        rows = mR.shape[0]
        mine = (batches - cluster + clusters - 1) // clusters  # batches cluster, cluster + clusters, ...
        smem = cutlass.memory.SmemAllocator()
        # Two stages of the rows' inputs (a batch's are staged while the one before is exchanged); R' once (a batch's
        # is read before the next batch's chunks write it).
        V = self.V
        in_words = MAX_SHARE * (HC + 1) * V * 4
        co_words = MAX_SHARE * 5 * HC
        sIn2 = smem.allocate_tensor(Int32, cute.make_layout(2 * in_words), byte_alignment=16)
        sCo2 = smem.allocate_tensor(Float32, cute.make_layout(2 * co_words), byte_alignment=16)
        sRp = smem.allocate_tensor(Int32, cute.make_layout(MAX_SHARE * HC * V * 4), byte_alignment=16)
        buf = self.allocate_exact(smem)
        sParam, mbar = buf[8], buf[9]
        sKeep = smem.allocate_tensor(Float32, cute.make_layout(MAX_BATCHES * NV), byte_alignment=16)
        self.init_barriers(mbar)
        fn, w_words, q = self.weights(mFn, mParam, mW, sParam, cta)
        cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()
        row0 = cluster * MAX_SHARE
        self.stage_rows(mR, mX, mPost, mComb, sIn2, sCo2, row0, cutlass.min(MAX_SHARE, rows - row0), cta, tidx)
        if const_expr(self.mxfp8):
            self.zero_scale_padding(mScale, rows, cluster * self.C + cta, tidx)
        split = self.split_fn(fn)
        cute.arch.cluster_wait()  # every peer's mbarriers are initialised
        owned = Int32(0)  # batches whose row `cta` this CTA owns
        for b in cutlass.range(mine):
            bat0 = (b * clusters + cluster) * MAX_SHARE
            count = cutlass.min(MAX_SHARE, rows - bat0)
            stage = b % 2
            # The next batch's rows into the other stage (an empty group past the last), then this batch's.
            nxt0 = bat0 + clusters * MAX_SHARE
            if b + 1 < mine:
                self.stage_rows(
                    mR, mX, mPost, mComb,
                    cute.make_tensor(sIn2.iterator + (1 - stage) * in_words, cute.make_layout(in_words)),
                    cute.make_tensor(sCo2.iterator + (1 - stage) * co_words, cute.make_layout(co_words)),
                    nxt0, cutlass.min(MAX_SHARE, rows - nxt0), cta, tidx,
                )  # fmt: skip
            else:
                cute.arch.cp_async_commit_group()
            cute.arch.cp_async_wait_group(1)
            cute.arch.barrier()
            sIn = cute.make_tensor(sIn2.iterator + stage * in_words, cute.make_layout(in_words))
            sCo = cute.make_tensor(sCo2.iterator + stage * co_words, cute.make_layout(co_words))
            # An owner's rows are a prefix of its batches (only the call's last batch is partial), so `owned` counts
            # them and the slices' mbarrier, armed on owners only, completes a phase a batch like the other two.
            sKeepB = cute.make_tensor(sKeep.iterator + owned * NV, cute.make_layout(NV))
            self.chunks(sIn, sCo, sRp, buf, mNewR, split, bat0, count)
            cute.arch.barrier()  # every chunk's partials in sChunk
            self.batch_exchanges(buf, mPostOut, mPreOut, eps, bat0, count, stage, sKeepB)
            if warp < self.warps - 2:
                self.layer_input_exact(sRp, buf, io, w_words, norm_eps, bat0, count, cta, q, stage)
            if cta < count:
                owned = owned + 1
            cute.arch.barrier()  # every reader of this stage and of the batch's buffers is done
        if cta < MAX_SHARE:
            if warp == self.sink_warp:
                if owned > 0:
                    # This CTA's rows: cluster * 8 + cta, then every clusters * 8 rows, one a batch.
                    view = cute.make_tensor(
                        mCombOut.iterator + (cluster * MAX_SHARE + cta) * (HC * HC),
                        cute.make_layout((owned, HC, HC), stride=(clusters * MAX_SHARE * HC * HC, HC, 1)),
                    )
                    self.epi.row_comb(sKeep, sParam, Int32(0), owned, view, rms_eps, sinkhorn_eps)


def block_amax(outs: list) -> Uint32:
    """The bf16 magnitude bit pattern of a 32-column block's amax (4 vectors of 4 packed words): |x| orders like its
    bits, and NaN sorts above Inf."""
    amax = Uint32(0)
    for m in range(4):
        for w in range(4):
            word = Uint32(outs[m][w])
            amax = cutlass.max(amax, word & Uint32(0x7FFF), (word >> 16) & Uint32(0x7FFF))
    return amax


@dsl_user_op
def st_global_u8(addr: Int64, val: Uint32, *, loc=None, ip=None) -> None:
    """Store the low byte of `val` to a global address."""
    cute.arch.inline_ptx("st.global.u8 [{$r0}], {$r1};", read_only_args=[Int64(addr), Uint32(val)], loc=loc, ip=ip)


def compile_one_cluster(
    H: int,
    cluster_n: int,
    max_clusters: int,
    repeat: int,
    arch: str,
    exact: bool = False,
    quant: str | None = None,
    persistent: bool = False,
    prefetch: bool = False,
) -> Any:
    """The compiled experiment kernel (rows dynamic): OneClusterV4, or with `exact` OneClusterV4Exact (with
    `persistent` OneClusterV4Persistent; `quant` "mxfp8" or "fp8": with the layer input's MXFP8 or FP8 1x128 form;
    `prefetch`: fn's lines asked into L2 before the register loads)."""
    exact = exact or persistent
    T = cute.sym_int()
    b16 = lambda *s: fake_tensor(BFloat16, s)  # noqa: E731
    f32 = lambda *s: fake_tensor(Float32, s, divisibility=4)  # noqa: E731
    args = (
        b16(T, HC, H), b16(T, H), f32(T, HC), f32(T, HC, HC), f32(MIX, HC * H), f32(3 + MIX), b16(H),
        b16(T, HC, H), b16(T, H), f32(T, HC), f32(T, HC, HC), f32(T, HC),
        fake_tensor(Float8E4M3FN, (T, H), divisibility=16) if quant else None,
        {
            None: None,
            "mxfp8": fake_tensor(Uint8, (cute.sym_int(),), divisibility=4),  # swizzled E8M0 scales
            "fp8": fake_tensor(Float32, (H // 128, cute.sym_int()), divisibility=4),  # [H/128, T_pad]
        }[quant],
        Float32(0), Float32(0), Float32(0), Float32(0), Float32(0), fake_stream(),
    )  # fmt: skip
    if quant and not exact:
        raise ValueError("only the exact variants write a quantized form")
    if persistent:
        # ptxas -O3 keeps fn's 192 words a thread in local memory across the batch loop (40 registers, ~1.1k local
        # loads and stores in the SASS); -O2 keeps them in registers (255, a few hundred bytes of spills).
        kernel = OneClusterV4Persistent(H, cluster_n, max_clusters, repeat, quant=quant, prefetch=prefetch)
        return cute.compile(kernel, *args, options=f"--enable-tvm-ffi --gpu-arch {arch} --ptxas-options=-O2")
    if exact:
        kernel = OneClusterV4Exact(H, cluster_n, max_clusters, repeat, quant=quant, prefetch=prefetch)
    else:
        kernel = OneClusterV4(H, cluster_n, max_clusters, repeat, prefetch=prefetch)
    return compile_kernel(kernel, *args, arch=arch)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, nargs="+", default=[4096, 7168])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--max-clusters", type=int, default=4)
    ap.add_argument("--replays", type=int, default=7)
    ap.add_argument("--variant", nargs="+", choices=VARIANTS, default=list(VARIANTS[:2]))
    ap.add_argument(
        "--forms", nargs="+", choices=FORMS, default=list(FORMS), help="mxfp8, fp8 (FP8 1x128): the exact variants only"
    )
    ap.add_argument(
        "--weights",
        nargs="+",
        choices=("cold", "warm"),
        default=["cold", "warm"],
        help="cold: each call of a graph its own layer's weights (from HBM, as in a step); warm: one layer's for all",
    )
    ap.add_argument("--prefetch", action="store_true", help="fn's lines asked into L2 before the register loads")
    ap.add_argument(
        "--isolate",
        action="store_true",
        help="a zeroing kernel (no PDL) before each call, its own time subtracted: no call loads during the one before",
    )
    ap.add_argument("--compile-only", action="store_true", help="compile for sm_90a (no GPU) and stop")
    args = ap.parse_args(argv)
    if args.compile_only:
        for H in args.hidden:
            for variant, form in _cases(args):
                quant = None if form == "bf16" else form
                compile_one_cluster(
                    H, CLUSTERS[H], args.max_clusters, 20, "sm_90a", variant != "fma", quant, variant == "persistent",
                    args.prefetch,
                )  # fmt: skip
                print(f"compiled {variant} {form} H {H} (cluster {CLUSTERS[H]})", flush=True)
        return
    run(args)


def _cases(args: argparse.Namespace) -> list[tuple[str, str]]:
    """The (variant, form) pairs asked for that exist (the MXFP8 form is the exact variants')."""
    return [(v, f) for v in args.variant for f in args.forms if f == "bf16" or v != "fma"]


def run(args: argparse.Namespace) -> None:
    """Per variant, form, weights and shape: us per call of the one launch and of the shipped boundary; each output's
    error against the reference (the shipped path's beside it) and the words that differ from the shipped path's, over
    every input set of the timed graphs (their last outputs)."""
    from bench.timing import GraphTimer
    from bench.v4 import CALLS_PER_GRAPH, _inputs, _ours, own_weights
    from boundary import BoundaryAllReduce, DecodeStep, V4Boundaries
    from boundary.toy import ToyConfig, ToyModel

    device = torch.device("cuda")
    timer = GraphTimer(device, replays=args.replays)
    # --isolate: a one-word zeroing (no PDL) before each call, so that no call's weight loads overlap the call before
    # it (PDL lets the next call start loading during this one); a graph of the zeroings alone is subtracted.
    sep = torch.zeros(1, device=device)
    sep_us = timer.per_call_us([sep.zero_] * CALLS_PER_GRAPH) if args.isolate else 0.0

    def timed(calls: list) -> float:
        if not args.isolate:
            return timer.per_call_us(calls)
        return timer.per_call_us([lambda c=c: (sep.zero_(), c()) for c in calls]) - sep_us

    print(
        "variant form weights H rows | us: one launch, shipped | max |err| / max |ref| (one launch; shipped) | "
        "words != shipped"
    )
    for H in args.hidden:
        model = ToyModel(ToyConfig(hidden_size=H, num_layers=1, vocab=16), device=device)
        layer = model.layers[0]
        # cold: each call of a graph its own layer's weights (from HBM after the L2 flush, as a step's layers' are);
        # warm: one layer's for every call (in L2 after the first call).
        layers = {"warm": [layer] * CALLS_PER_GRAPH, "cold": [w for w, _ in own_weights(layer, model, CALLS_PER_GRAPH)]}
        for variant, form in _cases(args):
            quant = None if form == "bf16" else form
            compiled = compile_one_cluster(
                H, CLUSTERS[H], args.max_clusters, layer.hc_sinkhorn_iters, "sm_90a", variant != "fma", quant,
                variant == "persistent", args.prefetch,
            )  # fmt: skip
            quantize = QUANTIZE[form]
            for weights in args.weights:
                for rows in args.rows:
                    b = V4Boundaries(BoundaryAllReduce(H, max_rows=rows, device=device))
                    step = DecodeStep(rows=rows, side_stream=False)
                    sets = [_inputs(rows, H, device, seed) | {"layer": own} for seed, own in enumerate(layers[weights])]
                    ones = [_one_launch(compiled, quant, s) for s in sets]
                    name = f"{variant} {form} {weights}{' isolated' if args.isolate else ''} {H} {rows}"
                    try:
                        ours = timed([call for call, _ in ones])
                    except RuntimeError as err:  # e.g. a cluster the GPU cannot place: the other shapes still run
                        print(f"{name} | the one launch failed: {err}", flush=True)
                        break
                    theirs = timed([_ours(b, s["layer"], s, step, quantize) for s in sets])
                    torch.cuda.synchronize()
                    errs, differ = _compare([got for _, got in ones], sets)
                    print(f"{name} | {ours:.2f}, {theirs:.2f} | {errs} | {differ}", flush=True)
                    torch.cuda.empty_cache()


def _compare(outs: list, sets: list) -> tuple[str, str]:
    """Over every input set: each output's largest error against the fp32 reference relative to its largest
    magnitude (the one launch's; the shipped path's), and how many words differ from the shipped path's (its last
    outputs, kept by bench.v4._ours)."""
    from boundary import reference
    from tests.inputs import attn_params

    names = ("R'", "post", "comb", "pre", "li", "quantized data", "quantized scale")
    err = dict.fromkeys(names[:5], (0.0, 0.0))
    differ = dict.fromkeys(names, 0)
    for got, inp in zip(outs, sets, strict=True):
        layer = inp["layer"]
        norm = layer.attn_norm
        want = reference.v4_boundary(
            inp["y"], inp["residual"], inp["post"], inp["comb"], attn_params(layer), norm.weight, norm.variance_epsilon
        )
        state, li, quantized = inp["outputs"]
        shipped = (state.residual, state.post, state.comb, state.pre, li)
        if quantized is not None:
            shipped += (quantized.data, quantized.scale)
        for name, g, sh in zip(names, got, shipped, strict=False):
            differ[name] += _words_differ(g, sh)
        for name, g, w, sh in zip(names, got, want, shipped, strict=False):
            scale = w.double().abs().max().item() or 1.0
            e1 = (g.double() - w.double()).abs().max().item() / scale
            e2 = (sh.double() - w.double()).abs().max().item() / scale
            err[name] = (max(err[name][0], e1), max(err[name][1], e2))
    errs = ", ".join(f"{n} {a:.1e}; {b:.1e}" for n, (a, b) in err.items())
    return errs, ", ".join(f"{n} {k}" for n, k in differ.items() if n in names[:5] or len(outs[0]) > 5)


def _words_differ(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many elements of two same-shaped tensors differ bitwise (bf16, fp32, e4m3 or uint8)."""
    as_int = {2: torch.int16, 4: torch.int32, 1: torch.uint8}[a.element_size()]
    return int((a.view(as_int) != b.view(as_int)).sum())


def _one_launch(compiled: Any, quant: str | None, inp: dict[str, Any]) -> tuple[Any, tuple]:
    """A closure making the one-launch boundary on an input set with its layer's weights (`inp["layer"]`), and its
    outputs: R', post, comb, pre and the layer input in reference.V4Boundary's order, then a quantized form's data
    and scales."""
    from boundary import mxfp8_scale_bytes
    from boundary.reference import fp8_group_scale_rows
    from tests.inputs import attn_params

    layer = inp["layer"]
    fn, norm = layer.hc_attn_fn, layer.attn_norm
    param = torch.cat([layer.hc_attn_scale.float(), layer.hc_attn_base.float()]).contiguous()
    rows, hc, hidden = inp["residual"].shape
    dev = inp["residual"].device
    new, li = torch.empty_like(inp["residual"]), torch.empty_like(inp["y"])
    post, comb, pre = (
        torch.empty(rows, hc, device=dev),
        torch.empty(rows, hc, hc, device=dev),
        torch.empty(rows, hc, device=dev),
    )
    q = torch.empty(rows, hidden, dtype=torch.float8_e4m3fn, device=dev) if quant else None
    sf = None
    if quant == "mxfp8":
        sf = torch.empty(mxfp8_scale_bytes(rows, hidden), dtype=torch.uint8, device=dev)
    elif quant == "fp8":
        sf = torch.empty(hidden // 128, fp8_group_scale_rows(rows), dtype=torch.float32, device=dev)
    p = attn_params(layer)
    eps = (p.rms_eps, p.pre_eps, p.sinkhorn_eps, p.post_mult, norm.variance_epsilon)

    def call() -> None:
        compiled(
            inp["residual"], inp["y"], inp["post"], inp["comb"], fn, param, norm.weight, new, li, post, comb, pre, q,
            sf, *eps,
        )  # fmt: skip

    return call, (new, post, comb, pre, li) + ((q, sf) if quant else ())


def _state(inp: dict[str, Any]) -> Any:
    """The V4 sublayer's state on an input set (bench.v4._ours' form)."""
    from boundary import BoundaryState

    return BoundaryState(inp["residual"], inp["post"], inp["comb"], None, pending=inp["y"])  # type: ignore[arg-type]


if __name__ == "__main__":
    sys.exit(main())
