"""The fused decode boundary of one rank (SPEC §2 steps 2-6): mHC post, collapse, RMSNorm, MXFP8.

Layout: one thread-block cluster of `cluster_n` CTAs per row; CTA `r` of the cluster owns the
contiguous columns [r*C, (r+1)*C) with C = H / cluster_n a multiple of 128, and thread `t` owns
the 8-element (16-byte) vectors t, t + threads, t + 2*threads, ... of that chunk (threads past
the chunk on their last vector read a clamped duplicate and store nothing). Everything a thread
needs stays in its registers; the only exchange is the RMS sum of squares: per-warp partials
pushed to every CTA of the cluster with st.async into shared memory, one mbarrier wait, then
every CTA reduces the same slots in the same order, so a row's bits never depend on T or on the
grid. An MXFP8 block is 4 adjacent lanes (amax by shuffles), and the first lane of each 16
writes the 4 scale bytes of its 128 columns as one word.

Row schedule (`BoundaryConfig`): by default every row has its own cluster (grid = [cluster_n, T]).
With `max_clusters`, G = ceil(T / ceil(T / max_clusters)) clusters loop over the rows r, r + G,
r + 2G, ... (every cluster takes the same number of rows, give or take one), and with `prefetch`
the loads of the next rows stay in flight while the current row is reduced and stored. The
exchange slots and mbarriers are then double-buffered by row parity. The per-row arithmetic and
reduction order are the same in every schedule, so the schedule never changes a bit.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch
from cutlass import BFloat16, Float8E4M3FN, Float32, Int32, Int64, Uint8, Uint32, const_expr

from cute_kernels import ptx as prim
from cute_kernels.compile import WarmupJob, check_arch, compile_kernel, fake_stream, fake_tensor, jit_cache

HC = 4
VEC = 8  # bf16 elements per thread vector: one 16-byte access
MXFP8_BLOCK = 32
MAX_CLUSTER = 8  # the portable cluster size limit
MOE_GROUP = 8  # experts whose gathers are issued together
SCALE_WORD_COLS = 4 * 32  # columns of one 4-byte word of MXFP8 scales
MIN_CHUNK = 512  # the default split keeps at least this many columns per CTA
Y_SOURCES = ("x", "moe")
E4M3_NAN_WORD = 0x7F7F7F7F
MAX_ROWS = 65535  # the grid's y extent
COEFS = HC + HC * HC + HC  # post, comb ([src, dst], row-major) and pre of one row
PREFETCH_DEPTHS = (0, 1, 2)
CACHE_HINTS = ("none", "loads", "all")
SCALE_PADS = ("tail", "early")
# The default row schedule is sized for an H100/H200 (132 SMs; a B200 has more): launch bounds
# cap the registers at 96 per thread so that a known number of CTAs fit on an SM, and the cluster
# cap takes 90% of the clusters that then fit, so that every cluster is resident from the start
# (one that waited for a free slot would run its rows after the others had finished theirs).
SMS = 132
REGISTER_BUDGET = 96
RESIDENT_SHARE = 0.9


@dataclass(frozen=True)
class BoundaryConfig:
    """Launch shape (CTAs per row, threads per CTA) and row schedule; the knobs' defaults are one cluster per row."""

    cluster_n: int
    threads: int
    # At most this many clusters, each looping over its rows (balanced); 0: one cluster per row.
    max_clusters: int = 0
    # Rows ahead whose loads stay in flight while a row is reduced and stored (looping clusters only).
    prefetch: int = 0
    # "loads": the read-once inputs skip L1 and are evict-first in L2; "all": also streaming (.cs) output stores.
    cache_hints: str = "none"
    # MXFP8 scale padding rows: "tail" (4-byte stores after each row), "early" (16-byte stores after the first loads).
    scale_pad: str = "tail"
    # CTAs per SM the register allocation must allow (launch bounds); 0: as many registers as the code wants.
    min_ctas_per_sm: int = 0

    @staticmethod
    def for_hidden(H: int) -> BoundaryConfig:
        """The default for hidden size H: the widest cluster (<= 8) whose CTAs own >= 512 columns, looping clusters.

        Every CTA's chunk is a multiple of 128 columns, so MXFP8 blocks and 4-block scale words
        never straddle two CTAs. The row schedule never changes a bit of the result: up to the
        cap each row still has its own cluster; past it, clusters loop with one row prefetched.
        """
        return BoundaryConfig.scheduled(BoundaryConfig.baseline(H))

    @staticmethod
    def scheduled(base: BoundaryConfig) -> BoundaryConfig:
        """`base`'s split with the looping-cluster row schedule: a cap from the register budget, prefetch."""
        ctas_per_sm = min(32, 2048 // base.threads, 65536 // (REGISTER_BUDGET * base.threads))
        cap = int(RESIDENT_SHARE * (SMS * ctas_per_sm // base.cluster_n))
        # Cache hints measured no better than plain accesses on the H200 (docs/PERF.md v3): none by default.
        return replace(
            base, max_clusters=cap, prefetch=1, cache_hints="none", scale_pad="early", min_ctas_per_sm=ctas_per_sm
        )

    @staticmethod
    def baseline(H: int) -> BoundaryConfig:
        """The split, one cluster per row, plain loads and stores: 1024 columns (128 threads) per CTA when
        H allows it, else the widest cluster. Measured on the H200 (docs/PERF.md v1), 128-thread CTAs
        with no idle lane beat the widest split by 5-12 % at 512 rows and tie it at few rows."""
        _check_hidden(H)
        if H % 1024 == 0 and 2 <= H // 1024 <= MAX_CLUSTER:
            return BoundaryConfig.for_cluster(H, H // 1024)
        return BoundaryConfig.widest(H)

    @staticmethod
    def widest(H: int) -> BoundaryConfig:
        """The widest cluster (<= 8) whose CTAs own >= 512 columns in multiples of 128 (v1's default)."""
        _check_hidden(H)
        widths = [n for n in range(1, MAX_CLUSTER + 1) if H % (n * SCALE_WORD_COLS) == 0 and H // n >= MIN_CHUNK]
        return BoundaryConfig.for_cluster(H, max(widths, default=1))

    @staticmethod
    def single_cta(H: int) -> BoundaryConfig:
        """One CTA per row (for benchmarking against the split)."""
        return BoundaryConfig.for_cluster(H, 1)

    @staticmethod
    def for_cluster(H: int, cluster_n: int) -> BoundaryConfig:
        """`cluster_n` CTAs per row with the default thread count for their chunk (for sweeps)."""
        _check_cluster(H, cluster_n)
        config = BoundaryConfig(cluster_n, _default_threads(H // cluster_n))
        config.validate(H)
        return config

    @property
    def looping(self) -> bool:
        """Whether clusters loop over several rows (a cap on the cluster count)."""
        return self.max_clusters > 0

    def validate(self, H: int) -> None:
        """Raise ValueError unless this config tiles a row of H columns and its schedule knobs are valid."""
        _check_cluster(H, self.cluster_n)
        vecs, t = H // self.cluster_n // VEC, self.threads
        if not (isinstance(t, int) and 32 <= t <= 1024 and t % 32 == 0 and t <= _round_up(vecs, 32)):
            raise ValueError(
                f"threads must be a multiple of 32 in 32..1024 and leave no warp idle (<= {_round_up(vecs, 32)} "
                f"for {vecs} vectors per CTA); got threads={t!r} for H={H}, cluster_n={self.cluster_n}"
            )
        m = self.max_clusters
        if isinstance(m, bool) or not isinstance(m, int) or not 0 <= m <= MAX_ROWS:
            raise ValueError(f"max_clusters must be an int in 0..{MAX_ROWS} (0: one cluster per row), got {m!r}")
        if self.prefetch not in PREFETCH_DEPTHS or isinstance(self.prefetch, bool):
            raise ValueError(f"prefetch must be one of {PREFETCH_DEPTHS}, got {self.prefetch!r}")
        if self.prefetch and not self.looping:
            raise ValueError("prefetch needs looping clusters (max_clusters > 0): a lone row has nothing to prefetch")
        if self.cache_hints not in CACHE_HINTS:
            raise ValueError(f"cache_hints must be one of {CACHE_HINTS}, got {self.cache_hints!r}")
        if self.scale_pad not in SCALE_PADS:
            raise ValueError(f"scale_pad must be one of {SCALE_PADS}, got {self.scale_pad!r}")
        c = self.min_ctas_per_sm
        if isinstance(c, bool) or not isinstance(c, int) or not 0 <= c <= 32 or c * self.threads > 2048:
            raise ValueError(f"min_ctas_per_sm must be an int in 0..32 with at most 2048 threads per SM, got {c!r}")
        if self.scale_pad == "tail" and self.looping:
            raise ValueError('scale_pad="tail" pads after each row of its own cluster: looping clusters need "early"')

    def vecs_per_thread(self, H: int) -> int:
        """16-byte vectors each thread owns in its CTA's chunk (the last may be idle on some threads)."""
        return -(-(H // self.cluster_n // VEC) // self.threads)

    def clusters(self, rows: int) -> int:
        """Clusters launched for `rows` rows (the kernel computes the same on the device side of the launch)."""
        if not self.looping or rows == 0:
            return rows
        per_cluster = -(-rows // self.max_clusters)
        return -(-rows // per_cluster)


def _round_up(a: int, b: int) -> int:
    return -(-a // b) * b


def _row_major(shape: tuple) -> cute.Layout:
    """A compact layout whose last mode is contiguous (so each vector is one 16-byte register run)."""
    return cute.make_ordered_layout(shape, order=tuple(range(len(shape) - 1, -1, -1)))


def _check_hidden(H: int) -> None:
    if isinstance(H, bool) or not isinstance(H, int) or H < 256 or H % 256:
        raise ValueError(f"the hidden size must be a positive multiple of 256, got {H!r}")


def _check_cluster(H: int, cluster_n: int) -> None:
    _check_hidden(H)
    if not (isinstance(cluster_n, int) and 1 <= cluster_n <= MAX_CLUSTER and H % (cluster_n * SCALE_WORD_COLS) == 0):
        raise ValueError(
            f"cluster_n must be an int in 1..{MAX_CLUSTER} that splits H={H} into multiples of "
            f"{SCALE_WORD_COLS} columns, got {cluster_n!r}"
        )


def _default_threads(chunk: int) -> int:
    """Threads for a chunk: one vector each while that takes at most 512 threads, else fewer threads."""
    vecs = chunk // VEC
    per_thread = 1
    while _round_up(-(-vecs // per_thread), 32) > 512:
        per_thread += 1
    return _round_up(-(-vecs // per_thread), 32)


class _RowRegs:
    """The registers one row's loads land in: the streams, the partial and addend, the coefficients."""

    def __init__(self, kernel: FusedBoundaryKernel) -> None:
        vpt = kernel.vpt
        self.rR = cute.make_rmem_tensor(_row_major((vpt, HC, VEC)), BFloat16)
        self.rX = cute.make_rmem_tensor(_row_major((vpt, VEC)), BFloat16) if kernel.y_source == "x" else None
        self.rS = cute.make_rmem_tensor(_row_major((vpt, VEC)), BFloat16) if kernel.shared else None
        # One per lane (lane i holds coefficient i) when prefetching, else all of them in every thread.
        self.coef = cute.make_rmem_tensor((1 if kernel.lane_coefs else COEFS,), Float32)


class _Ctx:
    """What every row of a CTA shares: the tensors, this thread's columns, the norm weight, the exchange."""

    def __init__(self, **fields: Any) -> None:
        self.__dict__.update(fields)


class FusedBoundaryKernel:
    """One fused-boundary kernel: the y source, the outputs, the launch shape and the row schedule are compile-time."""

    def __init__(
        self,
        H: int,
        *,
        y_source: str = "x",
        shared: bool = False,
        pre: bool = True,
        mxfp8: bool = False,
        aux: bool = False,
        config: BoundaryConfig | None = None,
    ) -> None:
        config = config if config is not None else BoundaryConfig.for_hidden(H)
        config.validate(H)
        if y_source not in Y_SOURCES:
            raise ValueError(f"y_source must be one of {Y_SOURCES}, got {y_source!r}")
        if mxfp8 and not pre:
            raise ValueError("MXFP8 output needs the normalized layer input (pre)")
        self.H = H
        self.y_source = y_source
        self.shared = shared
        self.pre = pre
        self.mxfp8 = mxfp8
        self.aux = aux
        self.cluster_n = config.cluster_n
        self.threads = config.threads
        self.chunk = H // config.cluster_n
        self.vecs = self.chunk // VEC  # 16-byte vectors per CTA
        self.vpt = config.vecs_per_thread(H)
        # Threads past the chunk on their last vector: they load a clamped duplicate and store nothing.
        self.tail = self.vpt * self.threads != self.vecs
        self.warps = config.threads // 32
        self.slots = self.warps * config.cluster_n  # RMS partials per row
        # Only the RMS needs cross-CTA traffic: the residual-only kernel launches no cluster.
        self.use_cluster = pre and config.cluster_n > 1
        self.scale_cols = H // MXFP8_BLOCK  # Kp: H is a multiple of 128, so no padded columns
        self.max_clusters = config.max_clusters
        self.looping = config.looping
        self.prefetch = config.prefetch
        self.stages = 2 if config.looping else 1  # exchange buffers, by row parity
        # A prefetched row keeps its 24 coefficients in one register per lane, shuffled out when used.
        self.lane_coefs = config.prefetch > 0
        self.stream_loads = config.cache_hints != "none"
        self.stream_stores = config.cache_hints == "all"
        self.scale_pad = config.scale_pad
        self.min_ctas_per_sm = config.min_ctas_per_sm

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
        mAux: cute.Tensor | None,  # [T, H] bf16
        eps: Float32,
        stream: cuda.CUstream,
    ):
        rows = mR.shape[0]
        clusters = rows
        if const_expr(self.looping):
            # The fewest rows per cluster under the cap, then the fewest clusters that give each that many.
            per_cluster = (rows + (self.max_clusters - 1)) // self.max_clusters
            clusters = (rows + per_cluster - 1) // per_cluster
        self.kernel(mR, mPost, mComb, mPre, mW, mX, mShared, mG, mEW, mIdx, mNewR, mOut, mQ, mScale, mAux, eps).launch(
            grid=[self.cluster_n, clusters, 1],
            block=[self.threads, 1, 1],
            cluster=[self.cluster_n, 1, 1] if const_expr(self.use_cluster) else None,
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
        mAux: cute.Tensor | None,
        eps: Float32,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        cta, first_row, _ = cute.arch.block_idx()
        vpt = const_expr(self.vpt)
        copy16 = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BFloat16, num_bits_per_copy=128)

        smem = cutlass.memory.SmemAllocator()
        sRed, mbar = None, None
        if const_expr(self.pre):
            sRed = smem.allocate_tensor(Float32, cute.make_layout(self.stages * self.slots), byte_alignment=16)
        if const_expr(self.use_cluster):
            mbar = smem.allocate_array(cutlass.Int64, num_elems=self.stages)
            if tidx == 0:
                for s in cutlass.range_constexpr(self.stages):
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
            rW = cute.make_rmem_tensor(_row_major((vpt, VEC)), BFloat16)
            for v in cutlass.range_constexpr(vpt):
                cute.copy(copy16, cute.local_tile(mW, (VEC,), (vcols[v],)), rW[v, None])
        policy = prim.l2_evict_first_policy() if const_expr(self.stream_loads) else None
        cute.arch.griddepcontrol_wait()

        ctx = _Ctx(
            mR=mR, mPost=mPost, mComb=mComb, mPre=mPre, mX=mX, mShared=mShared, mG=mG, mEW=mEW, mIdx=mIdx,
            mNewR=mNewR, mOut=mOut, mQ=mQ, mScale=mScale, mAux=mAux, eps=eps, rows=mR.shape[0], cta=cta,
            tidx=tidx, vcols=vcols, valid=valid, rW=rW, sRed=sRed, mbar=mbar, policy=policy,
        )  # fmt: skip
        if const_expr(not self.looping):
            regs = _RowRegs(self)
            self.load_row(ctx, regs, first_row)
            cute.arch.griddepcontrol_launch_dependents()
            if const_expr(self.mxfp8 and self.scale_pad == "early"):
                self.zero_scale_padding_early(ctx, first_row, ctx.rows)
            self.process_row(ctx, regs, first_row, 0, Int32(0), None)
            if const_expr(self.mxfp8 and self.scale_pad == "tail"):
                self.zero_scale_padding(mScale, first_row, cta, tidx)
        else:
            rows, clusters = ctx.rows, cute.arch.grid_dim()[1]
            # Row i of this cluster (first_row + i*clusters) lands in regs[i % 2] at depth 2.
            regs = [_RowRegs(self) for _ in range(2 if self.prefetch == 2 else 1)]
            for i in cutlass.range_constexpr(self.prefetch):
                if const_expr(i == 0):
                    self.load_row(ctx, regs[0], first_row)
                else:
                    if first_row + clusters < rows:
                        self.load_row(ctx, regs[1], first_row + clusters)
            cute.arch.griddepcontrol_launch_dependents()
            if const_expr(self.mxfp8):
                self.zero_scale_padding_early(ctx, first_row, clusters)
            if const_expr(self.use_cluster):
                cute.arch.cluster_wait()  # every peer's mbarriers are initialised
            # Two rows per trip, so that each uses its own exchange stage with a static index. The
            # row goes through an opaque move so that the compiler keeps no per-tensor row pointers
            # alive across the loop.
            row, phase = first_row, Int32(0)
            while row < rows:
                self.loop_row(ctx, regs[0], prim.opaque_i32(row), 0, phase, clusters)
                if row + clusters < rows:
                    self.loop_row(ctx, regs[-1], prim.opaque_i32(row + clusters), 1, phase, clusters)
                row, phase = row + 2 * clusters, phase ^ 1

    @cute.jit
    def loop_row(self, ctx: _Ctx, regs: _RowRegs, row: Int32, stage: int, phase: Int32, clusters: Int32):
        """One row of a looping cluster: its loads unless prefetched, then the row, prefetching `prefetch` rows on."""
        ahead = None
        if const_expr(self.prefetch == 0):
            self.load_row(ctx, regs, row)
        else:
            ahead = row + self.prefetch * clusters
        self.process_row(ctx, regs, row, stage, phase, ahead)

    @cute.jit
    def process_row(self, ctx: _Ctx, regs: _RowRegs, row: Int32, stage: int, phase: Int32, ahead: Int32 | None):
        """New streams (and aux) of a loaded row, then its norm; the loads of row `ahead` go out in between."""
        rC, sumsq = self.compute_row(ctx, regs, row)
        if const_expr(ahead is not None):
            # regs is consumed: refill it while this row's sum goes round the cluster.
            if ahead < ctx.rows:
                self.load_row(ctx, regs, ahead)
        if const_expr(self.pre):
            self.finish_row(ctx, row, rC, sumsq, stage, phase)

    @cute.jit
    def load_row(self, ctx: _Ctx, regs: _RowRegs, row: Int32):
        """Issue every load of one row into `regs`; nothing waits for them here."""
        vpt = const_expr(self.vpt)
        self.load_coefs(ctx, regs.coef, row)
        for v in cutlass.range_constexpr(vpt):
            for k in cutlass.range_constexpr(HC):
                self.load16(ctx, cute.local_tile(ctx.mR[row, k, None], (VEC,), (ctx.vcols[v],)), regs.rR[v, k, None])
        if const_expr(self.shared):
            for v in cutlass.range_constexpr(vpt):
                self.load16(ctx, cute.local_tile(ctx.mShared[row, None], (VEC,), (ctx.vcols[v],)), regs.rS[v, None])
        if const_expr(self.y_source == "x"):
            for v in cutlass.range_constexpr(vpt):
                self.load16(ctx, cute.local_tile(ctx.mX[row, None], (VEC,), (ctx.vcols[v],)), regs.rX[v, None])

    @cute.jit
    def load16(self, ctx: _Ctx, gSrc: cute.Tensor, rDst: cute.Tensor):
        """One 16-byte vector of a read-once input into registers (L1-bypassing and L2 evict-first with hints)."""
        if const_expr(ctx.policy is None):
            copy16 = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BFloat16, num_bits_per_copy=128)
            cute.copy(copy16, gSrc, rDst)
        else:
            words = prim.ld_global_v4_stream(gSrc.iterator.toint(), ctx.policy)
            rw = cute.recast_tensor(rDst, Uint32)
            for i in cutlass.range_constexpr(4):
                rw[i] = words[i]

    @cute.jit
    def load_coefs(self, ctx: _Ctx, coef: cute.Tensor, row: Int32):
        """post, comb and pre of a row: all 24 in every thread, or coefficient i in lane i (lane_coefs)."""
        n = const_expr(COEFS if self.pre else HC + HC * HC)
        if const_expr(self.lane_coefs):
            # Flat offsets into the compact [T, 4], [T, 4, 4] and [T, 4] fp32 tensors.
            lane = cute.arch.lane_idx()
            addr = ctx.mPost.iterator.toint() + (Int64(row) * HC + Int64(cutlass.min(lane, HC - 1))) * 4
            i_comb = cutlass.min(cutlass.max(lane - HC, Int32(0)), HC * HC - 1)
            a_comb = ctx.mComb.iterator.toint() + (Int64(row) * (HC * HC) + Int64(i_comb)) * 4
            addr = Int64(cutlass.select_(lane < HC, addr, a_comb))
            if const_expr(self.pre):
                i_pre = cutlass.min(cutlass.max(lane - HC - HC * HC, Int32(0)), HC - 1)
                a_pre = ctx.mPre.iterator.toint() + (Int64(row) * HC + Int64(i_pre)) * 4
                addr = Int64(cutlass.select_(lane < HC + HC * HC, addr, a_pre))
            coef[0] = prim.f32_from_bits(prim.ld_global_b32_pred(addr, lane < n))
        else:
            for j in cutlass.range_constexpr(HC):
                coef[j] = ctx.mPost[row, j]
            for k in cutlass.range_constexpr(HC):
                for j in cutlass.range_constexpr(HC):
                    coef[HC + k * HC + j] = ctx.mComb[row, k, j]
            if const_expr(self.pre):
                for j in cutlass.range_constexpr(HC):
                    coef[HC + HC * HC + j] = ctx.mPre[row, j]

    @cute.jit
    def coefs(self, coef: cute.Tensor) -> tuple[list, list, list | None]:
        """(post[j], comb[k][j], pre[j]) of a loaded row."""
        n = const_expr(COEFS if self.pre else HC + HC * HC)
        if const_expr(self.lane_coefs):
            vals = [cute.arch.shuffle_sync(coef[0], i) for i in range(n)]
        else:
            vals = [coef[i] for i in range(n)]
        post = vals[:HC]
        comb = [[vals[HC + k * HC + j] for j in range(HC)] for k in range(HC)]
        pre = vals[HC + HC * HC :] if const_expr(self.pre) else None
        return post, comb, pre

    @cute.jit
    def compute_row(self, ctx: _Ctx, regs: _RowRegs, row: Int32) -> tuple[cute.Tensor | None, Float32]:
        """Store the new streams (and aux) of a loaded row; return its collapse (fp32 of bf16) and sum of squares."""
        vpt = const_expr(self.vpt)
        valid = ctx.valid
        post, comb, pre = self.coefs(regs.coef)
        y = self.make_y(ctx, regs, row)
        rR = regs.rR
        rC = cute.make_rmem_tensor(_row_major((vpt, VEC)), Float32) if const_expr(self.pre) else None
        sumsq = Float32(0.0)
        for v in cutlass.range_constexpr(vpt):
            rf = [rR[v, k, None].load().to(Float32) for k in range(HC)]
            new_streams = []
            for j in cutlass.range_constexpr(HC):
                # Same operation order and roundings as the reference: post*y, then + comb[k,j]*R[k].
                words = []
                for e in cutlass.range_constexpr(0, VEC, 2):
                    pair = []
                    for h in cutlass.range_constexpr(2):
                        acc = prim.mul_rn(post[j], y[v, e + h])
                        for k in cutlass.range_constexpr(HC):
                            acc = prim.mul_add_rn(comb[k][j], rf[k][e + h], acc)
                        pair.append(acc)
                    words.append(prim.cvt_bf16x2(pair[0], pair[1]))
                new_streams.append(words)
                self.store_words(words, cute.local_tile(ctx.mNewR[row, j, None], (VEC,), (ctx.vcols[v],)), valid[v])
            # The rounded new streams, back in fp32.
            rp = [[self.unpack(words, e) for e in range(VEC)] for words in new_streams]
            if const_expr(self.aux):
                words = []
                for e in cutlass.range_constexpr(0, VEC, 2):
                    pair = []
                    for h in cutlass.range_constexpr(2):
                        s = prim.add_rn(
                            prim.add_rn(prim.add_rn(rp[0][e + h], rp[1][e + h]), rp[2][e + h]), rp[3][e + h]
                        )
                        pair.append(prim.mul_rn(s, Float32(1.0 / HC)))
                    words.append(prim.cvt_bf16x2(pair[0], pair[1]))
                self.store_words(words, cute.local_tile(ctx.mAux[row, None], (VEC,), (ctx.vcols[v],)), valid[v])
            if const_expr(self.pre):
                for e in cutlass.range_constexpr(0, VEC, 2):
                    pair = []
                    for h in cutlass.range_constexpr(2):
                        acc = prim.mul_rn(pre[0], rp[0][e + h])
                        for j in cutlass.range_constexpr(1, HC):
                            acc = prim.mul_add_rn(pre[j], rp[j][e + h], acc)
                        pair.append(acc)
                    word = prim.cvt_bf16x2(pair[0], pair[1])
                    c0, c1 = prim.bf16_lo(word), prim.bf16_hi(word)
                    rC[v, e], rC[v, e + 1] = c0, c1
                    if const_expr(valid[v] is None):
                        sumsq = sumsq + c0 * c0 + c1 * c1
                    else:
                        sumsq = sumsq + Float32(cutlass.select_(valid[v], c0 * c0 + c1 * c1, Float32(0.0)))
        return rC, sumsq

    @cute.jit
    def finish_row(self, ctx: _Ctx, row: Int32, rC: cute.Tensor, sumsq: Float32, stage: int, phase: Int32):
        """The row's RMS over the cluster, then out (and MXFP8)."""
        vpt = const_expr(self.vpt)
        total = self.row_sum(sumsq, ctx.sRed, ctx.mbar, ctx.cta, stage, phase)
        inv = prim.rsqrt_approx(prim.div_rn(total, Float32(self.H)) + ctx.eps)
        for v in cutlass.range_constexpr(vpt):
            if const_expr(self.looping):
                # Unpacked per row: fp32 copies hoisted out of the loop would hold twice the registers.
                rw = cute.recast_tensor(ctx.rW[v, None], Uint32)
                packed = [prim.opaque_u32(rw[i]) for i in range(VEC // 2)]
                wf = [self.unpack(packed, e) for e in range(VEC)]
            else:
                wf = ctx.rW[v, None].load().to(Float32)
            words = [prim.cvt_bf16x2(rC[v, e] * inv * wf[e], rC[v, e + 1] * inv * wf[e + 1]) for e in range(0, VEC, 2)]
            self.store_words(words, cute.local_tile(ctx.mOut[row, None], (VEC,), (ctx.vcols[v],)), ctx.valid[v])
            if const_expr(self.mxfp8):
                self.quantize_vector(words, ctx.mQ, ctx.mScale, row, ctx.vcols[v], ctx.valid[v])

    @cute.jit
    def make_y(self, ctx: _Ctx, regs: _RowRegs, row: Int32) -> cute.Tensor:
        """y for this thread's vectors as a (vpt, 8) fp32 register tensor holding bf16 values.

        The one place that knows where y comes from (`y_source`): a later multi-rank kernel plugs
        its rank-order sum of peer partials in here.
        """
        vpt = const_expr(self.vpt)
        y = cute.make_rmem_tensor(_row_major((vpt, VEC)), Float32)
        if const_expr(self.y_source == "x"):
            for v in cutlass.range_constexpr(vpt):
                y[v, None].store(regs.rX[v, None].load().to(Float32))
        else:
            self.moe_combine(y, ctx.mG, ctx.mEW, ctx.mIdx, row, ctx.vcols)
        # y = bf16(partial + shared): the shared addend comes last, then one rounding.
        if const_expr(self.shared):
            for v in cutlass.range_constexpr(vpt):
                ss = regs.rS[v, None].load().to(Float32)
                self.round_into(y, v, [prim.add_rn(y[v, e], ss[e]) for e in range(VEC)])
        elif const_expr(self.y_source == "moe"):
            for v in cutlass.range_constexpr(vpt):
                self.round_into(y, v, [y[v, e] for e in range(VEC)])
        return y

    @cute.jit
    def moe_combine(
        self, acc: cute.Tensor, mG: cute.Tensor, mEW: cute.Tensor, mIdx: cute.Tensor, row: Int32, vcols: list
    ):
        """acc = sum_i w[row, i] * G[idx[row, i]] in fp32, i in order; idx < 0 adds nothing."""
        vpt = const_expr(self.vpt)
        top_k = mEW.shape[1]
        acc.fill(0.0)
        g_base = mG.iterator.toint()
        for group in cutlass.range(cute.ceil_div(top_k, MOE_GROUP)):
            # Issue every index, weight and row gather of the group before the first add.
            experts, weights = [], []
            for u in cutlass.range_constexpr(MOE_GROUP):
                i = group * MOE_GROUP + u
                safe_i = cutlass.min(i, top_k - 1)
                e = mIdx[row, safe_i]
                experts.append(Int32(cutlass.select_(i < top_k, e, Int32(-1))))
                weights.append(mEW[row, safe_i])
            gathered = []
            for u in cutlass.range_constexpr(MOE_GROUP):
                valid = experts[u] >= 0
                row_off = Int64(cutlass.max(experts[u], Int32(0))) * self.H
                gathered.append(
                    [prim.ld_global_v4_pred(g_base + (row_off + Int64(vcols[v] * VEC)) * 2, valid) for v in range(vpt)]
                )
            for u in cutlass.range_constexpr(MOE_GROUP):
                valid = experts[u] >= 0
                for v in cutlass.range_constexpr(vpt):
                    for e in cutlass.range_constexpr(VEC):
                        word = gathered[u][v][e // 2]
                        g = prim.bf16_lo(word) if e % 2 == 0 else prim.bf16_hi(word)
                        summed = prim.mul_add_rn(weights[u], g, acc[v, e])
                        acc[v, e] = Float32(cutlass.select_(valid, summed, acc[v, e]))

    @cute.jit
    def round_into(self, y: cute.Tensor, v: int, vals: list):
        """y[v, :] = the fp32 values of bf16(vals)."""
        for e in cutlass.range_constexpr(0, VEC, 2):
            word = prim.cvt_bf16x2(vals[e], vals[e + 1])
            y[v, e] = prim.bf16_lo(word)
            y[v, e + 1] = prim.bf16_hi(word)

    @cute.jit
    def unpack(self, words: list, e: int) -> Float32:
        """The fp32 value of bf16 element e of a vector held as 4 packed words."""
        return prim.bf16_lo(words[e // 2]) if e % 2 == 0 else prim.bf16_hi(words[e // 2])

    @cute.jit
    def store_words(self, words: list, gDst: cute.Tensor, valid: cutlass.Boolean | None):
        """Store 4 packed bf16 words as one 16-byte vector (unless `valid` is False); streaming with cache hints "all"."""
        if const_expr(self.stream_stores):
            addr = gDst.iterator.toint()
            if const_expr(valid is None):
                prim.st_global_v4_b32(addr, *words, streaming=True)
            else:
                if valid:
                    prim.st_global_v4_b32(addr, *words, streaming=True)
        else:
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

    @cute.jit
    def row_sum(
        self, val: Float32, sRed: cute.Tensor, mbar: cute.Pointer | None, cta: Int32, stage: int, phase: Int32
    ) -> Float32:
        """The sum of `val` over every thread of the row's CTAs, in a fixed order, on every thread.

        Looping clusters alternate two exchange stages by row parity. A peer can only write a
        stage again two rows later, after this CTA's every warp has sent the row in between,
        which each warp does after reading the stage.
        """
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        val = cute.arch.warp_reduction_sum(val)
        base = const_expr(stage * self.slots)
        slot = cta * self.warps + warp
        if const_expr(self.use_cluster):
            if const_expr(not self.looping):
                cute.arch.cluster_wait()  # every peer's mbarrier is initialised
            if warp == 0:
                with cute.arch.elect_one():
                    cute.arch.mbarrier_arrive_and_expect_tx(mbar + stage, self.slots * 4)
            if lane < self.cluster_n:
                prim.st_async_remote_f32(val, sRed.iterator + base + slot, mbar + stage, lane)
            cute.arch.mbarrier_wait(mbar + stage, phase)
        else:
            if lane == 0:
                sRed[base + slot] = val
            cute.arch.barrier()
        slots = const_expr(self.slots)
        part = Float32(0.0)
        for i in cutlass.range_constexpr(cute.ceil_div(slots, 32)):
            if lane + i * 32 < slots:
                part = part + sRed[base + lane + i * 32]
        if const_expr(self.use_cluster and self.looping):
            # The peers' next writes to this stage come through the async proxy: order our reads first.
            cute.arch.fence_view_async_shared()
        return cute.arch.warp_reduction_sum(part)

    @cute.jit
    def quantize_vector(
        self, words: list, mQ: cute.Tensor, mScale: cute.Tensor, row: Int32, vcol: Int32, valid: cutlass.Boolean | None
    ):
        """MXFP8 of one 8-element vector of `out` (SPEC §4); 4 adjacent lanes share a 32-block.

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
        m1 = prim.f32_from_bits(Uint32(cutlass.max(254 - e, Int32(1))) << 23)
        m1 = Float32(cutlass.select_(e == 0, Float32(1.0), m1))
        m1 = Float32(cutlass.select_(e == 254, Float32(2.0**-64), m1))
        m2 = Float32(cutlass.select_(e == 254, Float32(2.0**-63), Float32(1.0)))
        q = []
        for i in cutlass.range_constexpr(VEC):
            x = self.unpack(words, i) * m1 * m2
            q.append(cute.arch.fmax(cute.arch.fmin(x, Float32(448.0)), Float32(-448.0)))
        q_lo = prim.cvt_e4m3x4(q[0], q[1], q[2], q[3])
        q_hi = prim.cvt_e4m3x4(q[4], q[5], q[6], q[7])
        nan_block = e == 255
        q_lo = Uint32(cutlass.select_(nan_block, Uint32(E4M3_NAN_WORD), q_lo))
        q_hi = Uint32(cutlass.select_(nan_block, Uint32(E4M3_NAN_WORD), q_hi))
        q_addr = mQ.iterator.toint() + (Int64(row) * self.H + Int64(vcol * VEC))
        # The 4 scale bytes of 128 columns form one word: gather them from lanes +0, +4, +8, +12.
        lane = cute.arch.lane_idx()
        word = Uint32(e) << Uint32(8 * ((lane >> 2) & 3))
        word = word | cute.arch.shuffle_sync_bfly(word, offset=4)
        word = word | cute.arch.shuffle_sync_bfly(word, offset=8)
        scale_addr = mScale.iterator.toint() + self.scale_offset(row, vcol * VEC // MXFP8_BLOCK)
        if const_expr(valid is None):
            self.store_quantized(q_addr, q_lo, q_hi, scale_addr, word, lane)
        else:
            if valid:
                self.store_quantized(q_addr, q_lo, q_hi, scale_addr, word, lane)

    @cute.jit
    def store_quantized(self, q_addr: Int64, q_lo: Uint32, q_hi: Uint32, scale_addr: Int64, word: Uint32, lane: Int32):
        """The 8 e4m3 bytes of a vector, and the scale word from the first lane of each 16."""
        prim.st_global_v2_b32(q_addr, q_lo, q_hi)
        if lane % 16 == 0:
            prim.st_global_b32(scale_addr, word)

    @cute.jit
    def scale_offset(self, m: Int32, k: Int32) -> Int64:
        """Byte offset of scale (m, k), k % 4 == 0, in the swizzled 128x4 layout."""
        return Int64(m // 128) * (128 * self.scale_cols) + Int64((k // 4) * 512 + (m % 32) * 16 + ((m % 128) // 32) * 4)

    @cute.jit
    def zero_scale_padding(self, mScale: cute.Tensor, row: Int32, cta: Int32, tidx: Int32):
        """Zero this CTA's scale words of the padding rows T..roundup(T, 128)-1, shared by the last tile's rows."""
        rows = Int32(mScale.shape[0] // self.scale_cols)  # roundup(T, 128)
        num_rows = Int32(cute.arch.grid_dim()[1])
        tile_start = rows - 128
        if row >= tile_start:
            in_tile = num_rows - tile_start  # real rows in the last tile
            pad_rows = 128 - in_tile
            todo = cutlass.max(pad_rows - (row - tile_start), Int32(0))
            mine = (todo + in_tile - 1) // in_tile
            words_per_row = const_expr(self.chunk // (4 * MXFP8_BLOCK))
            base = mScale.iterator.toint()
            k0 = cta * (self.chunk // MXFP8_BLOCK)
            for item in cutlass.range(tidx, mine * words_per_row, self.threads):
                m = num_rows + (row - tile_start) + (item // words_per_row) * in_tile
                k = k0 + (item % words_per_row) * 4
                prim.st_global_b32(base + self.scale_offset(m, k), Uint32(0))

    @cute.jit
    def zero_scale_padding_early(self, ctx: _Ctx, cluster: Int32, clusters: Int32):
        """Zero this CTA's columns of the scale padding rows T..roundup(T, 128)-1, spread over every cluster.

        16-byte segment s of a 512-byte block holds rows s, s+32, s+64, s+96 of the last 128-row
        tile: past the real rows a whole segment is padding (one 16-byte store), before them the
        padded rows of a segment are its tail (at most two stores). Right after the loads go out,
        these stores stay off the row's critical path.
        """
        rows = ctx.rows
        blocks = const_expr(self.chunk // SCALE_WORD_COLS)  # 512-byte blocks of this CTA per tile
        tile = Int64((rows - 1) // 128) * (128 * self.scale_cols)
        base = ctx.mScale.iterator.toint() + tile + Int64(ctx.cta * (blocks * 512))
        start = cluster * self.threads + ctx.tidx
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
                        prim.st_global_v4_b32(addr, zero, zero, zero, zero)
                    if first == 1:
                        prim.st_global_b32(addr + 4, zero)
                        prim.st_global_v2_b32(addr + 8, zero, zero)
                    if first == 2:
                        prim.st_global_v2_b32(addr + 8, zero, zero)
                    if first == 3:
                        prim.st_global_b32(addr + 12, zero)
                else:
                    for q in cutlass.range_constexpr(4):
                        if first <= q:
                            prim.st_global_b32(addr + 4 * q, zero)


def mxfp8_scale_bytes(rows: int, H: int) -> int:
    """Bytes of the swizzled 128x4 scale buffer for [rows, H] (H a multiple of 128)."""
    return -(-rows // 128) * 128 * (H // MXFP8_BLOCK)


@jit_cache
def compile_fused_boundary(
    H: int,
    y_source: str,
    shared: bool,
    pre: bool,
    mxfp8: bool,
    aux: bool,
    config: BoundaryConfig,
    *,
    arch: str,
) -> Callable[..., Any]:
    """Compile one fused-boundary variant with its launch shape and row schedule; T (and P, top-k) stay dynamic.

    The compiled function takes, positionally, (residual, post, comb, pre, norm_weight, x,
    shared, gemm2_permuted, expert_weights, idx, new_residual, out, mxfp8_data, mxfp8_scale,
    aux, norm_eps), with None for every tensor the variant does not use.
    """
    check_arch(arch)
    kernel = FusedBoundaryKernel(H, y_source=y_source, shared=shared, pre=pre, mxfp8=mxfp8, aux=aux, config=config)
    T, top_k = cute.sym_int(), cute.sym_int()
    bf16 = lambda shape: fake_tensor(BFloat16, shape, divisibility=8)  # noqa: E731
    f32 = lambda shape: fake_tensor(Float32, shape, divisibility=1)  # noqa: E731
    moe = y_source == "moe"
    args = (
        bf16((T, HC, H)),  # residual
        f32((T, HC)),  # post
        f32((T, HC, HC)),  # comb
        f32((T, HC)) if pre else None,  # pre
        bf16((H,)) if pre else None,  # norm weight
        bf16((T, H)) if not moe else None,  # x
        bf16((T, H)) if shared else None,  # shared addend / shared_output
        bf16((cute.sym_int(), H)) if moe else None,  # gemm2_permuted
        f32((T, top_k)) if moe else None,  # expert weights
        fake_tensor(Int32, (T, top_k), divisibility=1) if moe else None,  # permuted row per expert
        bf16((T, HC, H)),  # new residual
        bf16((T, H)) if pre else None,  # out
        fake_tensor(Float8E4M3FN, (T, H), divisibility=16) if mxfp8 else None,
        fake_tensor(Uint8, (cute.sym_int(),), divisibility=4) if mxfp8 else None,
        bf16((T, H)) if aux else None,
        Float32(0.0),  # norm eps
    )
    return compile_kernel(kernel, *args, fake_stream(), arch=arch)


class BoundaryVariant(NamedTuple):
    """The compile-time flags of one fused-boundary kernel."""

    y_source: str = "x"  # "x": a ready partial; "moe": the top-k combine of gemm2_permuted
    shared: bool = False  # an addend: bf16(x + shared), or the MoE shared_output
    pre: bool = True  # collapse + RMSNorm; False: residual-only
    mxfp8: bool = False
    aux: bool = False


ENGINE_VARIANTS: tuple[BoundaryVariant, ...] = tuple(
    BoundaryVariant(y_source, shared, pre, mxfp8, aux)
    for y_source in Y_SOURCES
    for shared in (False, True)
    for pre, mxfp8 in ((False, False), (True, False), (True, True))
    for aux in (False, True)
)


@functools.cache
def default_config(H: int) -> BoundaryConfig:
    """The launch shape and row schedule used when none is given: a function of H only (batch invariance)."""
    return BoundaryConfig.for_hidden(H)


def compiled_boundary(
    H: int, variant: BoundaryVariant, *, arch: str, config: BoundaryConfig | None = None
) -> Callable[..., Any]:
    """The compiled kernel of one variant (compiled or loaded on first use)."""
    config = default_config(H) if config is None else config
    return compile_fused_boundary(H, *variant, config, arch=arch)


def warmup_keys(
    H: int,
    *,
    arch: str,
    config: BoundaryConfig | None = None,
    variants: Sequence[BoundaryVariant] = ENGINE_VARIANTS,
) -> list[WarmupJob]:
    """One warmup job per variant an engine may launch at hidden size H (all of them by default)."""
    check_arch(arch)
    config = default_config(H) if config is None else config
    config.validate(H)
    return [
        WarmupJob(
            name=f"boundary H={H} {variant_name(v)}",
            compile_fn=compile_fused_boundary,
            args=(H, *v, config),
            kwargs=(("arch", arch),),
        )
        for v in variants
    ]


def variant_name(v: BoundaryVariant) -> str:
    """A short readable name of a variant, e.g. "moe+shared pre mxfp8 aux"."""
    parts = [v.y_source + ("+shared" if v.shared else "")]
    parts.append("pre" if v.pre else "residual-only")
    parts += [flag for flag, on in (("mxfp8", v.mxfp8), ("aux", v.aux)) if on]
    return " ".join(parts)


def _check(name: str, t: object, dtype: torch.dtype, shape: tuple, device: int, align: int) -> None:
    """One tensor argument: dtype, shape (None = any), contiguity, alignment, device."""
    # One cheap conjunction first: an engine calls a boundary ~100 times per decode step.
    if (
        isinstance(t, torch.Tensor)
        and t.dtype is dtype
        and t.shape == shape
        and t.is_contiguous()
        and not t.data_ptr() % align
        and t.get_device() == device
    ):
        return
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise TypeError(f"{name} must have dtype {dtype}, got {t.dtype}")
    if t.dim() != len(shape) or any(s is not None and s != n for s, n in zip(shape, t.shape)):
        want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise ValueError(f"{name} must have shape {want}, got {list(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    if t.data_ptr() % align:
        raise ValueError(f"{name} must start on a {align}-byte boundary (address {t.data_ptr():#x})")
    if t.get_device() != device:
        raise ValueError(f"{name} must be on the device of residual ({_device_name(device)}), got {t.device}")


def _device_name(index: int) -> str:
    return "cpu" if index < 0 else f"cuda:{index}"


def fused_boundary(
    *,
    residual: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    pre: torch.Tensor | None,
    norm_weight: torch.Tensor | None,
    norm_eps: float,
    x: torch.Tensor | None = None,
    shared: torch.Tensor | None = None,
    moe: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    new_residual: torch.Tensor,
    out: torch.Tensor | None = None,
    mxfp8_data: torch.Tensor | None = None,
    mxfp8_scale: torch.Tensor | None = None,
    aux: torch.Tensor | None = None,
    arch: str,
    config: BoundaryConfig | None = None,
    check: bool = True,
) -> None:
    """Run the fused boundary of one rank, writing new_residual (and out, MXFP8, aux when given).

    y is `x` (plus `shared`), or with `moe=(gemm2_permuted, expert_weights, idx)` the MoE top-k
    combine (plus `shared`, the shared-expert output). pre=None is the residual-only boundary.
    `check=False` skips the host checks for a caller that has made them already; the compiled
    function still rejects a wrong dtype, shape, stride, alignment or device before it launches
    (with TVM-FFI's messages), and the scale buffer size and row limit are checked regardless.
    """
    if check:
        post = _check_args(
            residual, post, comb, pre, norm_weight, norm_eps, x, shared, moe, new_residual,
            out, mxfp8_data, mxfp8_scale, aux, arch, config,
        )  # fmt: skip
    elif post.dim() == 3:
        post = post.view(post.shape[0], HC)
    rows, _, H = residual.shape
    if not check and (
        rows > MAX_ROWS or (mxfp8_scale is not None and mxfp8_scale.numel() != mxfp8_scale_bytes(rows, H))
    ):
        raise ValueError(f"mxfp8_scale must hold mxfp8_scale_bytes({rows}, {H}) bytes and rows <= {MAX_ROWS}")
    if rows == 0:
        return
    variant = BoundaryVariant(
        "x" if moe is None else "moe", shared is not None, pre is not None, mxfp8_data is not None, aux is not None
    )
    fn = compiled_boundary(H, variant, arch=arch, config=config)
    fn(*kernel_args(residual, post, comb, pre, norm_weight, norm_eps, x, shared, moe, new_residual, out,
                    mxfp8_data, mxfp8_scale, aux))  # fmt: skip


def kernel_args(
    residual: Any,
    post: Any,
    comb: Any,
    pre: Any,
    norm_weight: Any,
    norm_eps: float,
    x: Any,
    shared: Any,
    moe: tuple[Any, Any, Any] | None,
    new_residual: Any,
    out: Any,
    mxfp8_data: Any,
    mxfp8_scale: Any,
    aux: Any,
) -> tuple:
    """The positional arguments of a compiled fused-boundary kernel, None for every unused tensor."""
    g, ew, idx = moe if moe is not None else (None, None, None)
    w = norm_weight if pre is not None else None
    return (residual, post, comb, pre, w, x, shared, g, ew, idx, new_residual, out, mxfp8_data, mxfp8_scale, aux,
            float(norm_eps))  # fmt: skip


def _check_args(
    residual: object,
    post: object,
    comb: object,
    pre: object,
    norm_weight: object,
    norm_eps: object,
    x: object,
    shared: object,
    moe: object,
    new_residual: object,
    out: object,
    mxfp8_data: object,
    mxfp8_scale: object,
    aux: object,
    arch: str,
    config: BoundaryConfig | None,
) -> torch.Tensor:
    """Every host-visible check of fused_boundary; returns post viewed as [T, 4]."""
    check_arch(arch)
    if not isinstance(residual, torch.Tensor):
        raise TypeError(f"residual must be a torch.Tensor, got {type(residual).__name__}")
    if residual.dim() != 3 or residual.shape[1] != HC:
        raise ValueError(f"residual must have shape [T, {HC}, H] (hc = {HC}), got {list(residual.shape)}")
    rows, _, H = residual.shape
    if H % 256 or H == 0:
        raise ValueError(f"the hidden size (residual.shape[2]) must be a positive multiple of 256, got {H}")
    if rows > MAX_ROWS:
        raise ValueError(f"at most {MAX_ROWS} rows per launch (one grid row each), got {rows}")
    if config is not None:
        if not isinstance(config, BoundaryConfig):
            raise TypeError(f"config must be a BoundaryConfig or None, got {type(config).__name__}")
        config.validate(H)
    dev = residual.get_device()
    bf16, f32 = torch.bfloat16, torch.float32
    _check("residual", residual, bf16, (rows, HC, H), dev, 16)
    if isinstance(post, torch.Tensor) and post.dim() == 3:
        _check("post", post, f32, (rows, HC, 1), dev, 4)
        post = post.view(rows, HC)
    _check("post", post, f32, (rows, HC), dev, 4)
    _check("comb", comb, f32, (rows, HC, HC), dev, 4)
    if (x is None) == (moe is None):
        raise ValueError("give exactly one input: x (a bf16 partial) or moe=(gemm2_permuted, expert_weights, idx)")
    if x is not None:
        _check("x", x, bf16, (rows, H), dev, 16)
    else:
        if not isinstance(moe, (tuple, list)) or len(moe) != 3:
            raise TypeError("moe must be a tuple (gemm2_permuted, expert_weights, idx)")
        g, ew, idx = moe
        _check("moe gemm2_permuted", g, bf16, (None, H), dev, 16)
        _check("moe expert_weights", ew, f32, (rows, None), dev, 4)
        _check("moe idx", idx, torch.int32, (rows, ew.shape[1]), dev, 4)
    if shared is not None:
        _check("shared", shared, bf16, (rows, H), dev, 16)
    _check("new_residual", new_residual, bf16, (rows, HC, H), dev, 16)
    if isinstance(norm_eps, bool) or not isinstance(norm_eps, (int, float)):
        raise TypeError(f"norm_eps must be a float, got {type(norm_eps).__name__}")
    if pre is None:
        if out is not None or mxfp8_data is not None or mxfp8_scale is not None:
            raise ValueError("the residual-only boundary (pre=None) writes no out and no MXFP8")
    else:
        _check("pre", pre, f32, (rows, HC), dev, 4)
        _check("norm_weight", norm_weight, bf16, (H,), dev, 16)
        if out is None:
            raise ValueError("out (the bf16 layer input [T, H]) is required when pre is given")
        _check("out", out, bf16, (rows, H), dev, 16)
        if (mxfp8_data is None) != (mxfp8_scale is None):
            raise ValueError("give both mxfp8_data and mxfp8_scale, or neither")
        if mxfp8_data is not None:
            _check("mxfp8_data", mxfp8_data, torch.float8_e4m3fn, (rows, H), dev, 16)
            _check("mxfp8_scale", mxfp8_scale, torch.uint8, (mxfp8_scale_bytes(rows, H),), dev, 4)
    if aux is not None:
        _check("aux", aux, bf16, (rows, H), dev, 16)
    if dev < 0:
        raise ValueError(f"the fused boundary runs on CUDA tensors; residual is on {residual.device}")
    return post
