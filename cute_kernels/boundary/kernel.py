"""The fused decode boundary of one rank (CONTRACT §2 steps 2-6): mHC post, collapse, RMSNorm, MXFP8 / FP8 1x128.

Layout: one thread-block cluster of `cluster_n` CTAs per row; CTA `r` of the cluster owns the
contiguous columns [r*C, (r+1)*C) with C = H / cluster_n a multiple of 128, and thread `t` owns
the 8-element (16-byte) vectors t, t + threads, t + 2*threads, ... of that chunk (threads past
the chunk on their last vector read a clamped duplicate and store nothing). Everything a thread
needs stays in its registers; the only exchange is the RMS sum of squares: per-warp partials
pushed to every CTA of the cluster with st.async into shared memory, one mbarrier wait, then
every CTA reduces the same slots in the same order, so a row's bits never depend on T or on the
grid.

Row schedule: G = ceil(T / ceil(T / max_clusters)) clusters loop over the rows r, r + G, r + 2G, ...
(every cluster takes the same number of rows, give or take one), and the loads of a cluster's next
row stay in flight while the current row is reduced and stored. The exchange slots and mbarriers
are double-buffered by row parity. The per-row arithmetic and reduction order do not depend on the
schedule, so the schedule never changes a bit.

Roles: `loads.RowLoads` (a row's loads and this rank's partial), `allreduce.peer.PeerReduce` (W > 1: y
from every rank's partial), `epilogue.Epilogue` (post, collapse, aux, RMSNorm, MXFP8 through
`cute_kernels.quant`), `own_pre.OwnPreRole` (DeepSeek-V4: the pre computed from the new streams, one more
cluster exchange, where the pre is not given). The kernel hands each role what it needs (`loads.Ctx`, the loads role to the
peer role's staged phases); no role holds another.
"""

from __future__ import annotations

import dataclasses

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64, const_expr

from cute_kernels import VEC, ptx
from cute_kernels.allreduce.peer import PeerReduce, PeerState
from cute_kernels.allreduce.protocol import CALL_UNIT, STATE_RANK, STATE_TIMEOUT_US
from cute_kernels.boundary.config import BoundaryConfig
from cute_kernels.boundary.epilogue import Epilogue
from cute_kernels.boundary.loads import Ctx, RowLoads, RowRegs, row_major
from cute_kernels.boundary.own_pre import OwnPreRole


class FusedBoundaryKernel:
    """One fused-boundary kernel: the y source, the outputs and the launch shape are compile-time."""

    def __init__(
        self,
        H: int,
        config: BoundaryConfig,
        *,
        y_source: str = "x",
        shared: bool = False,
        pre: bool = True,
        mxfp8: bool = False,
        aux: bool = False,
        fp8: str | None = None,
        world_size: int = 1,
        protocol: str = "oneshot",
        staged: bool = False,
        own_pre: bool = False,
        early_loads: bool = False,
    ) -> None:
        if own_pre and not pre:
            raise ValueError("own_pre computes the pre of the layer input: it needs pre=True")
        if config.fn_in_registers and not own_pre:
            raise ValueError("a config with fn_in_registers holds the own pre's weights: it needs own_pre=True")
        # The own pre's fn values loaded into registers before the PDL wait and kept across the CTA's rows, or (False)
        # prefetched into L2 there and loaded per row after it (bench/experiments/own_pre_fn_regs.py).
        self.fn_in_registers = config.fn_in_registers
        self.H = H
        # The first row's streams and coefficients issued before the PDL wait (unstaged; CONTRACT §7's precondition).
        self.early_loads = early_loads
        self.pre = pre
        self.mxfp8 = mxfp8
        self.cluster_n = config.cluster_n
        self.threads = config.threads
        self.max_clusters = config.max_clusters
        self.min_ctas_per_sm = config.min_ctas_per_sm
        self.vecs = H // config.cluster_n // VEC  # 16-byte vectors per CTA
        self.vpt = config.vecs_per_thread(H)
        # Threads past the chunk on their last vector: they load a clamped duplicate and store nothing.
        self.tail = self.vpt * self.threads != self.vecs
        # The unstaged peer kernel of a ready partial x, where every cluster takes one row (api.staged_call),
        # spins on the cluster sum; the one-rank kernel, the staged kernel and the MoE peer kernel, whose
        # clusters loop over rows at many rows, sleep, where the spin costs more than it saves
        # (docs/PERF.md decisions: spin).
        spin = world_size > 1 and not staged and y_source == "x"
        self.epilogue = Epilogue(
            H, config.cluster_n, config.threads, self.vpt, pre=pre, mxfp8=mxfp8, aux=aux, fp8=fp8, spin=spin
        )
        self.loads = RowLoads(H, self.vpt, y_source=y_source, shared=shared, pre=pre and not own_pre)
        # `own_pre`: the pre is computed here from the new streams (mMixFn, mMixParams), and written to mPre.
        self.own = None
        if own_pre:
            self.own = OwnPreRole(
                H, config.cluster_n, config.threads, self.vpt, use_cluster=self.epilogue.use_cluster, spin=spin
            )
        # W > 1: y is the rank-order sum of every rank's partial, exchanged through the peer slots. `staged`:
        # the exchange of every row goes out before the row loop (allreduce.peer; the host takes it for calls
        # of several rows per cluster); only a ready partial x is staged (a MoE partial would be combined twice).
        if staged and (world_size == 1 or y_source != "x"):
            raise ValueError("only the peer exchange of a ready partial x is staged")
        # The peer kernels of a ready partial x mix the streams (sum_k comb[k, j] * R[k]) while they wait for the
        # peers (Epilogue.premix, into shared memory: in registers it spilled beside the polls at W 4 and 8), in
        # every protocol and row schedule of H alike, so that a row's bits depend on neither (docs/PERF.md
        # decisions: premix). Not where its shared memory would cost residency (one CTA per row of many vectors
        # per thread, at H no model uses).
        self.premix = world_size > 1 and y_source == "x" and config.premix_fits(H)
        self.allreduce = None
        if world_size > 1:
            # The call counter's shares (allreduce.protocol) need fewer warps per launch than CALL_UNIT.
            max_warps = config.max_clusters * config.cluster_n * (config.threads // 32)
            if max_warps >= CALL_UNIT:
                raise ValueError(
                    f"{config} launches up to {max_warps} warps; the peer call counter counts < {CALL_UNIT}"
                )
            self.attach_allreduce(PeerReduce(H, world_size, protocol, self.vpt, config.cluster_n, staged=staged))
        self.moe = y_source == "moe"

    def attach_allreduce(self, allreduce: PeerReduce) -> None:
        """Make `allreduce` this kernel's peer role (the constructor's own; a test attaches a modified one)."""
        self.allreduce = allreduce

    def row_slots(self) -> bool:
        """Whether a row loads its slot words with its other loads (a staged peer kernel: PeerReduce.slots_with_row)."""
        return self.allreduce is not None and self.allreduce.slots_with_row

    @cute.jit
    def load_row(self, ctx: Ctx, regs: RowRegs, row: Int32):
        """Issue every load of one row: the loads role's and, where the row loads them too, its slot words."""
        slots = const_expr(self.row_slots())
        # A staged two-shot row takes y from its slot, not from the partial.
        self.loads.load_row(ctx, regs, row, partial=not (slots and self.allreduce.protocol == "twoshot"))
        if const_expr(slots):
            self.allreduce.prefetch_slots(ctx, regs.rSlot, row)

    @cute.jit
    def __call__(
        self,
        mR: cute.Tensor,  # [T, 4, H] bf16 streams
        mPost: cute.Tensor,  # [T, 4] fp32
        mComb: cute.Tensor,  # [T, 4, 4] fp32, [src, dst]
        mPre: cute.Tensor | None,  # [T, 4] fp32
        mW: cute.Tensor | None,  # [H] bf16 norm weight
        mX: cute.Tensor | None,  # [T, H] bf16 partial
        mShared: cute.Tensor | None,  # [T, H] bf16 addend
        mG: cute.Tensor | None,  # [P, H] bf16 gemm2_permuted
        mEW: cute.Tensor | None,  # [T, k] fp32 expert weights
        mIdx: cute.Tensor | None,  # [T, k] int32 permuted row, -1 = none
        mNewR: cute.Tensor,  # [T, 4, H] bf16
        mOut: cute.Tensor | None,  # [T, H] bf16
        mQ: cute.Tensor | None,  # [T, H] e4m3
        mScale: cute.Tensor | None,  # [roundup(T, 128) * H/32] uint8, swizzled 128x4
        mQ8: cute.Tensor | None,  # [T, H] e4m3, FP8 1x128
        mScale8: cute.Tensor | None,  # [H/128, T_pad] fp32, column-major per token
        mAux: cute.Tensor | None,  # [T, H] bf16
        mSlots: cute.Tensor | None,  # W > 1: [generations, W + 1, max_rows, H] bf16, this rank's receive slots
        mPeers: cute.Tensor | None,  # W > 1: [W] int64, every rank's receive-slot base address
        mState: cute.Tensor | None,  # W > 1: [3] int32: the call counter, rank, timeout (us)
        mError: cute.Tensor | None,  # W > 1 or MoE: [4] int32 device error word
        mMixFn: cute.Tensor | None,  # own pre: [4, 4H] fp32, the pre mixes' rows of fn
        mMixParams: cute.Tensor | None,  # own pre: [MIX_PARAMS] fp32: scale, base[4], rms_eps, eps
        eps: Float32,
        stream: cuda.CUstream,
    ):
        rows = mR.shape[0]
        # The fewest rows per cluster under the cap, then the fewest clusters that give each that many.
        per_cluster = (rows + (self.max_clusters - 1)) // self.max_clusters
        clusters = (rows + per_cluster - 1) // per_cluster
        self.kernel(
            mR,
            mPost,
            mComb,
            mPre,
            mW,
            mX,
            mShared,
            mG,
            mEW,
            mIdx,
            mNewR,
            mOut,
            mQ,
            mScale,
            mQ8,
            mScale8,
            mAux,
            mSlots,
            mPeers,
            mState,
            mError,
            mMixFn,
            mMixParams,
            eps,
        ).launch(
            grid=[self.cluster_n, clusters, 1],
            block=[self.threads, 1, 1],
            cluster=[self.cluster_n, 1, 1] if const_expr(self.epilogue.use_cluster) else None,
            stream=stream,
            use_pdl=True,
            min_blocks_per_mp=self.min_ctas_per_sm,
            # Given, so that the compile never asks a GPU for its shared memory size (-1: the driver's default).
            preferred_smem_carveout=-1 if const_expr(self.min_ctas_per_sm > 1) else None,
        )

    @cute.kernel
    def kernel(
        self,
        mR: cute.Tensor,
        mPost: cute.Tensor,
        mComb: cute.Tensor,
        mPre: cute.Tensor | None,
        mW: cute.Tensor | None,
        mX: cute.Tensor | None,
        mShared: cute.Tensor | None,
        mG: cute.Tensor | None,
        mEW: cute.Tensor | None,
        mIdx: cute.Tensor | None,
        mNewR: cute.Tensor,
        mOut: cute.Tensor | None,
        mQ: cute.Tensor | None,
        mScale: cute.Tensor | None,
        mQ8: cute.Tensor | None,
        mScale8: cute.Tensor | None,
        mAux: cute.Tensor | None,
        mSlots: cute.Tensor | None,
        mPeers: cute.Tensor | None,
        mState: cute.Tensor | None,
        mError: cute.Tensor | None,
        mMixFn: cute.Tensor | None,
        mMixParams: cute.Tensor | None,
        eps: Float32,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        cta, first_row, _ = cute.arch.block_idx()
        vpt = const_expr(self.vpt)
        epi = self.epilogue
        copy16 = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BFloat16, num_bits_per_copy=128)

        smem = cutlass.memory.SmemAllocator()
        sRed, mbar = None, None
        if const_expr(self.pre):
            sRed = smem.allocate_tensor(Float32, cute.make_layout(epi.stages * epi.slots), byte_alignment=16)
        sMix = None
        if const_expr(self.premix):
            sMix = smem.allocate_tensor(Float32, epi.mix_layout(), byte_alignment=16)
        own = self.own
        sOwn, mbarOwn = None, None
        own_fn = None
        if const_expr(own is not None):
            sOwn = smem.allocate_tensor(Float32, cute.make_layout(own.smem_floats()), byte_alignment=16)
        if const_expr(epi.use_cluster):
            barriers = const_expr(epi.stages + (own.stages if own is not None else 0))
            mbar = smem.allocate_array(cutlass.Int64, num_elems=barriers)
            if const_expr(own is not None):
                mbarOwn = mbar + epi.stages
            if tidx == 0:
                for s in cutlass.range_constexpr(barriers):
                    cute.arch.mbarrier_init(mbar + s, 1)
            cute.arch.mbarrier_init_fence()
            cute.arch.cluster_arrive_relaxed()

        # Row position (in vectors) of each of this thread's vectors, and whether it is real.
        vcols, valid = [], []
        for v in cutlass.range_constexpr(vpt):
            index = v * self.threads + tidx
            if const_expr(self.tail and v == vpt - 1):
                valid.append(index < self.vecs)
                index = cutlass.min(index, self.vecs - 1)
            else:
                valid.append(None)
            vcols.append(cta * self.vecs + index)

        # The norm weight is a parameter, not an output of the previous kernel: read it before the wait.
        rW = None
        if const_expr(self.pre):
            rW = cute.make_rmem_tensor(row_major((vpt, VEC)), BFloat16)
            for v in cutlass.range_constexpr(vpt):
                cute.copy(copy16, cute.local_tile(mW, (VEC,), (vcols[v],)), rW[v, None])
        if const_expr(own is not None):
            # fn is weights, so before the wait: this thread's fn values into registers, kept across its rows; or
            # the row's fn columns into L2, by the first cluster's CTAs only (every cluster's would repeat the same
            # 16 x 4 x H bytes once per cluster at many rows; a prefetch fills no register).
            if const_expr(self.fn_in_registers):
                own_fn = own.load_fn(mMixFn, vcols, valid)
            else:
                own.prefetch(mMixFn, cta, tidx, first_row == 0)
        rank, timeout_us, table = None, None, None
        if const_expr(self.allreduce is not None):
            # The workspace's constants (the call counter is written by the previous call: read after the wait).
            rank = mState[STATE_RANK]
            timeout_us = mState[STATE_TIMEOUT_US]
            # The peer table is set when the workspace is made: read it here, so that no push waits for it (at
            # W 8 and with a MoE partial, whose registers it would crowd, it is read, all at once, where pushed).
            if const_expr(self.allreduce.W <= 4 and not self.moe):
                table = [mPeers[p] for p in range(self.allreduce.W)]
        rows, clusters = mR.shape[0], cute.arch.grid_dim()[1]
        ctx = Ctx(
            mR=mR,
            mPost=mPost,
            mComb=mComb,
            mPre=mPre,
            mX=mX,
            mShared=mShared,
            mG=mG,
            mEW=mEW,
            mIdx=mIdx,
            mNewR=mNewR,
            mOut=mOut,
            mQ=mQ,
            mScale=mScale,
            mQ8=mQ8,
            mScale8=mScale8,
            mAux=mAux,
            mError=mError,
            eps=eps,
            rows=rows,
            clusters=clusters,
            cta=cta,
            tidx=tidx,
            vcols=vcols,
            valid=valid,
            rW=rW,
            sRed=sRed,
            sMix=sMix,
            mbar=mbar,
            mMixFn=mMixFn,
            mix=None,
            sOwn=sOwn,
            mbarOwn=mbarOwn,
            peer=None,
            own_fn=own_fn,
        )
        # Row i of this cluster (first_row + i*clusters) lands in regs; its successor's loads go out
        # while it is reduced and stored.
        staged = self.allreduce is not None and self.allreduce.staged
        regs = self.loads.regs(self.allreduce.row_slot_shape() if self.row_slots() else None)
        self.wait_and_load_first(ctx, regs, first_row)
        if const_expr(own is not None):
            # After the wait: mix_weights builds them with kernels of the same stream on its first call.
            ctx = dataclasses.replace(ctx, mix=own.params(mMixParams))
        if const_expr(self.allreduce is not None):
            calls = self.allreduce.read_counter(mState)
            deadline = ptx.globaltimer() + Int64(timeout_us) * 1000
            deadline_y = deadline + Int64(timeout_us) * 500  # a two-shot wait for y: see allreduce.peer
            gen = self.allreduce.call_generation(mState, calls)
            peer = PeerState(mSlots, mPeers, mState, table, rank, gen, deadline, deadline_y)
            ctx = dataclasses.replace(ctx, peer=peer)
        if const_expr(staged):
            # Every partial (and two-shot, every owned y) goes out before the row loop.
            self.allreduce.push_rows(ctx, self.loads, first_row)
            if const_expr(self.allreduce.protocol == "twoshot"):
                self.allreduce.reduce_owned(ctx, self.loads, first_row)
            self.load_row(ctx, regs, first_row)
        if const_expr(self.allreduce is None):
            cute.arch.griddepcontrol_launch_dependents()
        if const_expr(self.mxfp8):
            epi.quant.zero_padding(mScale, rows, cta, tidx, first_row, clusters)
        if const_expr(epi.use_cluster):
            cute.arch.cluster_wait()  # every peer's mbarriers are initialised
        # Two rows per trip, so that each uses its own exchange stage with a static index. The row
        # goes through an opaque move so that the compiler keeps no per-tensor row pointers alive
        # across the loop.
        row, phase = first_row, Int32(0)
        while row < rows:
            self.process_row(ctx, regs, ptx.opaque_i32(row), 0, phase)
            if row + clusters < rows:
                self.process_row(ctx, regs, ptx.opaque_i32(row + clusters), 1, phase)
            row, phase = row + 2 * clusters, phase ^ 1

    @cute.jit
    def wait_and_load_first(self, ctx: Ctx, regs: RowRegs, first_row: Int32):
        """Wait for the predecessor grid (PDL); then, unstaged, issue the first row's loads, before the call counter
        is read (no load of an unstaged row needs the peer state): in one basic block with the wait, their address
        arithmetic is scheduled before it, as at one rank. With `early_loads` (unstaged) the first row's streams and
        coefficients go out before the wait and only its partial after it (bench/experiments/early_loads_ab.py)."""
        if const_expr(self.allreduce is not None and self.allreduce.staged):
            cute.arch.griddepcontrol_wait()
        elif const_expr(self.early_loads):
            self.loads.load_row(ctx, regs, first_row, partial=False)
            cute.arch.griddepcontrol_wait()
            self.loads.load_partial(ctx, regs, first_row)
        else:
            cute.arch.griddepcontrol_wait()
            self.load_row(ctx, regs, first_row)

    @cute.jit
    def process_row(self, ctx: Ctx, regs: RowRegs, row: Int32, stage: int, phase: Int32):
        """A loaded row: y, the new streams (and aux), then its norm; the next row's loads go out in between."""
        ahead = row + ctx.clusters
        if const_expr(self.allreduce is None):
            post, comb, pre = self.loads.coefs(regs.coef)
            y = self.loads.partial(ctx, regs, row)
        else:
            y = self.loads.partial(ctx, regs, row)

            def coefs_and_premix():
                post, comb, pre = self.loads.coefs(regs.coef)
                if const_expr(self.premix):
                    self.epilogue.premix(ctx, regs.rR, comb)
                return post, comb, pre

            # The coefficient shuffles wait for their load, and the premix needs no y: the peer role does them
            # where no push waits for them and before its wait (inline: while the peers' pushes are on their way).
            y, (post, comb, pre) = self.allreduce.reduce(ctx, y, row, regs.rSlot, coefs_and_premix)
            if ahead >= ctx.rows:
                # This CTA waits for no peer any more: only now may the next kernel take its place, so
                # that a waiting grid never keeps a peer's grid (simulated ranks share the SMs) from running.
                cute.arch.griddepcontrol_launch_dependents()
        kept = [] if const_expr(self.own is not None) else None
        rC, sumsq = self.epilogue.compute_row(ctx, regs.rR, y, post, comb, pre, row, kept)
        # regs is consumed: refill it with the next row while this row's sum goes round the cluster.
        if ahead < ctx.rows:
            self.load_row(ctx, regs, ahead)
        if const_expr(self.own is not None):
            # The own pre, then the collapse with it (84 bytes of spills at 96 registers, H 7168: the fn weights in
            # flight beside the next row's loads; issued after the pre, ptxas spilled 256).
            pre = self.own.row_pre(
                ctx.mMixFn,
                ctx.mPre,
                ctx.mix,
                kept,
                ctx.vcols,
                ctx.valid,
                ctx.sOwn,
                ctx.mbarOwn,
                row,
                ctx.cta,
                ctx.tidx,
                stage,
                phase,
                ctx.own_fn,
            )
            rC, sumsq = self.epilogue.collapse(ctx, kept, pre)
        if const_expr(self.pre):
            self.epilogue.finish_row(ctx, row, rC, sumsq, stage, phase)
