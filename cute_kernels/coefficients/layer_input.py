"""The layer input of the next sublayer, by clusters of 8 CTAs: out = RMSNorm_w(c), where
c = bf16(sum_j pre_mix[j] * R[j]) (the carried pre-mix collapse) or stream 0 / the embedding row exactly
(one-hot). CTA r of a cluster owns the columns [r*H/8, (r+1)*H/8) of NR rows; the sums of squares of the
rounded c are exchanged across the cluster (DSMEM), then out = bf16(c * rsqrt(sum/H + eps) * w). The
"_unnormed" modes (no norm weight) write c itself.

The inline form of the coefficients kernel runs these clusters after the projection clusters of the tile
that reads the same rows (so their stream reads hit L2); LayerInputKernel runs them alone, with the same
bits, for a scheduler that runs the projection on a side stream, and (DeepSeek-V4's own-pre layer input) with the
normed layer input's MXFP8 or FP8 1x128 form written beside it (cute_kernels/quant.py: 16 adjacent lanes hold 128
consecutive columns of one row, since a CTA's H/8 columns are whole 128-column groups).
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr

from cute_kernels import FP8_GROUP, VEC, reduce
from cute_kernels import ptx as prim
from cute_kernels.coefficients.config import CLUSTER, HC, WARP
from cute_kernels.quant import Fp8GroupWriter, Mxfp8Writer

LAYER_INPUT_WARPS = 8  # warps per CTA of the layer-input-only kernel
INLINE_BUDGET = 2  # 16-byte vectors per thread of the inline form's layer-input clusters (x2 one-hot)
INPUT_ONLY_BUDGET = 2  # the same for the layer-input-only kernel


UNNORMED = "_unnormed"  # the suffix of a layer-input mode that writes the collapse without the RMSNorm
QUANT_FORMS = ("mxfp8", "fp8_1x128", "fp8_1x128_ue8m0")  # the quantized forms the layer-input kernel writes beside bf16


def collapse_vector(pre: list, streams: list) -> list:
    """The 4 packed bf16 words of one 8-column vector's collapse: bf16(pre0*R0 + pre1*R1 + ...) in the reference's
    order and roundings (`streams`: each stream's 4 words). Every layer input's collapse is this one formula."""
    words = []
    for e in range(4):
        vals = []
        for unpack in (prim.bf16_lo, prim.bf16_hi):
            acc = prim.mul_rn(pre[0], unpack(streams[0][e]))
            for j in range(1, HC):
                acc = prim.add_rn(acc, prim.mul_rn(pre[j], unpack(streams[j][e])))
            vals.append(acc)
        words.append(prim.cvt_bf16x2(vals[0], vals[1]))
    return words


def square_sum(words: list) -> Float32:
    """One vector's sum of squares, its elements in order (the first step of every layer input's RMS)."""
    part = Float32(0.0)
    for e in range(4):
        c0 = prim.bf16_lo(words[e])
        c1 = prim.bf16_hi(words[e])
        part = part + c0 * c0 + c1 * c1
    return part


def normed_vector(words: list, inv: Float32, w_words: tuple) -> list:
    """bf16(c * inv * w) of one vector, packed (the norm's last step)."""
    out = []
    for e in range(4):
        lo = prim.mul_rn(prim.mul_rn(prim.bf16_lo(words[e]), inv), prim.bf16_lo(w_words[e]))
        hi = prim.mul_rn(prim.mul_rn(prim.bf16_hi(words[e]), inv), prim.bf16_hi(w_words[e]))
        out.append(prim.cvt_bf16x2(lo, hi))
    return out


def collapse_of(layer_input: str) -> str:
    """The collapse a layer-input mode computes: "carried" (the carried pre-mix) or "one_hot" (stream 0)."""
    return layer_input.removesuffix(UNNORMED)


def normalizes(layer_input: str) -> bool:
    """Whether a layer-input mode applies the RMSNorm (takes a norm weight)."""
    return not layer_input.endswith(UNNORMED)


def norm_rows_per_cluster(H: int, threads: int, layer_input: str, budget: int) -> int:
    """Rows per layer-input cluster: as many as `budget` (carried: 4 stream reads per vector) or 2*budget
    (one-hot) 16-byte vectors per thread cover, a power of two in 1..16. Budget 2 keeps the layer-input
    code from raising the projection's registers (inline form), and ptxas from sinking the later vectors'
    loads below the first one's math (more vectors: one round trip each)."""
    per_thread = budget if collapse_of(layer_input) == "carried" else 2 * budget
    rows = max(1, min(16, per_thread * threads // (H // (CLUSTER * 8))))
    return 1 << (rows.bit_length() - 1)


@cute.jit
def cluster_prologue() -> tuple:
    """(rank in the cluster, cluster index, shared-memory allocator, the exchange mbarrier initialised),
    after the cluster arrive that the first cluster_wait matches."""
    tidx, _, _ = cute.arch.thread_idx()
    rank, cluster_id, _ = cute.arch.block_idx()
    smem = cutlass.memory.SmemAllocator()
    mbar = smem.allocate_array(Int64, num_elems=1)
    if tidx == 0:
        cute.arch.mbarrier_init(mbar, 1)
    cute.arch.mbarrier_init_fence()
    # Peers push into this CTA's shared memory only after every CTA of the cluster got here.
    cute.arch.cluster_arrive_relaxed()
    return rank, cluster_id, smem, mbar


class LayerInputRole:
    """The layer-input CTAs of one compile-time shape: NR rows per cluster, H/8 columns per CTA."""

    def __init__(
        self, H: int, broadcast: bool, layer_input: str, cta_warps: int, budget: int, quant: str | None = None
    ) -> None:
        self.H = H
        self.collapse = collapse_of(layer_input)  # "carried" or "one_hot"
        self.normalize = normalizes(layer_input)
        self.row_stride = H if broadcast else HC * H  # elements per row of the input tensor
        self.cta_warps = cta_warps
        self.threads = WARP * cta_warps
        self.vecs_per_row = H // (CLUSTER * 8)  # 8-column vectors of a CTA's columns
        self.norm_rows = norm_rows_per_cluster(H, self.threads, layer_input, budget)
        self.norm_vpt = -(-(self.norm_rows * self.vecs_per_row) // self.threads)
        # The quantized form of the normed layer input: `quant` None, or one of QUANT_FORMS.
        self.quant = quant
        self.mxfp8 = self.fp8 = None
        if quant is not None:
            if quant not in QUANT_FORMS or not self.normalize:
                raise ValueError(f"quant must be None or one of {QUANT_FORMS} with a normed layer input, got {quant!r}")
            if (H // CLUSTER) % FP8_GROUP:
                raise ValueError(f"a quantized layer input needs H a multiple of {CLUSTER * FP8_GROUP}, got {H}")
            if quant == "mxfp8":
                self.mxfp8 = Mxfp8Writer(H, H // CLUSTER, self.threads)
            else:
                self.fp8 = Fp8GroupWriter(H, ue8m0=quant == "fp8_1x128_ue8m0")

    @cute.jit
    def cluster_cta(
        self,
        smem: cutlass.memory.SmemAllocator,
        mbar: cute.Pointer,
        mX: cute.Tensor,
        mPreMix: cute.Tensor | None,
        mW: cute.Tensor | None,
        mOut: cute.Tensor,
        norm_eps: Float32,
        rank: Int32,
        cluster: Int32,
        mQ: cute.Tensor | None = None,
        mScale: cute.Tensor | None = None,
        clusters: Int32 | None = None,
    ):
        """One CTA of a layer-input cluster: collapse and RMSNorm (unnormed modes: the collapse) of H/8 columns of
        NR rows; with `quant` also their quantized form into mQ / mScale (MXFP8: `clusters` of them zero the scale
        padding rows)."""
        tidx, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        rows = mX.shape[0]
        nr = const_expr(self.norm_rows)
        vpr = const_expr(self.vecs_per_row)
        vpt = const_expr(self.norm_vpt)
        row0 = cluster * nr
        sVec = smem.allocate_tensor(Float32, cute.make_layout(nr * vpr), byte_alignment=16)
        sRecv = smem.allocate_tensor(Float32, cute.make_layout(CLUSTER * nr), byte_alignment=16)

        # This thread's vectors: v = tidx + k*threads, row v // vpr, column block v % vpr.
        vec_in = []
        vec_row = []
        vec_col = []
        for k in cutlass.range_constexpr(vpt):
            v = cutlass.min(tidx + k * self.threads, nr * vpr - 1)
            vec_in.append(tidx + k * self.threads < nr * vpr)
            local_row = v // vpr
            vec_row.append(local_row)
            vec_col.append(rank * (self.H // CLUSTER) + (v - local_row * vpr) * 8)
        w_words = [prim.ld_v4_i32(mW.iterator + vec_col[k]) for k in range(vpt)] if const_expr(self.normalize) else []
        cute.arch.griddepcontrol_wait()

        # Every read in flight before any math.
        loaded = []
        for k in cutlass.range_constexpr(vpt):
            row = cutlass.min(row0 + vec_row[k], rows - 1)
            nstreams = HC if self.collapse == "carried" else 1
            streams = [
                prim.ld_v4_i32(mX.iterator + (row * self.row_stride + j * self.H + vec_col[k])) for j in range(nstreams)
            ]
            pre = prim.ld_v4_f32(mPreMix.iterator + row * HC) if self.collapse == "carried" else None
            loaded.append((streams, pre))
        # ptxas would otherwise sink the later vectors' loads below the first vector's math (one
        # memory round trip per vector); loads cannot move across a barrier.
        if const_expr(vpt > 1):
            cute.arch.sync_threads()
        if const_expr(self.mxfp8 is not None):
            self.mxfp8.zero_padding(mScale, rows, rank, tidx, cluster, clusters)

        c_words = []
        for k in cutlass.range_constexpr(vpt):
            streams, pre = loaded[k]
            if const_expr(self.collapse == "carried"):
                c_words.append(collapse_vector(pre, streams))
            else:
                c_words.append(list(streams[0]))
        cute.arch.griddepcontrol_launch_dependents()
        if const_expr(not self.normalize):
            cute.arch.cluster_wait()  # matches the prologue's arrive; nothing is exchanged
            for k in cutlass.range_constexpr(vpt):
                row = row0 + vec_row[k]
                if vec_in[k]:
                    if row < rows:
                        prim.st_v4_i32(mOut.iterator + (row * self.H + vec_col[k]), tuple(c_words[k]))
        else:
            for k in cutlass.range_constexpr(vpt):
                part = square_sum(c_words[k])
                if vec_in[k]:
                    sVec[tidx + k * self.threads] = part
            cute.arch.sync_threads()
            cute.arch.cluster_wait()
            if warp == 0:
                reduce.expect_bytes(mbar, CLUSTER * nr * 4)
            # One warp per row sums the row's vectors (fixed lane order, then a butterfly) and sends it
            # to every CTA of the cluster.
            for rr in cutlass.range_constexpr(0, nr, self.cta_warps):
                r = rr + warp
                if r < nr:
                    part = Float32(0.0)
                    for i in cutlass.range_constexpr(-(-vpr // 32)):
                        if lane + i * 32 < vpr:
                            part = part + sVec[r * vpr + lane + i * 32]
                    part = cute.arch.warp_reduction_sum(part)
                    if lane < CLUSTER:
                        reduce.push(sRecv.iterator + (rank * nr + r), part, mbar, lane)
            # Where the quantized form goes, while the sums cross the cluster (as the boundary's epilogue does).
            places = []
            for k in cutlass.range_constexpr(vpt):
                row = row0 + vec_row[k]
                if const_expr(self.mxfp8 is not None):
                    places.append(self.mxfp8.place(mQ, mScale, row, vec_col[k] // VEC))
                if const_expr(self.fp8 is not None):
                    places.append(self.fp8.place(mQ, mScale, row, rows, vec_col[k] // VEC))
            cute.arch.mbarrier_wait(mbar, 0)

            for k in cutlass.range_constexpr(vpt):
                total = sRecv[vec_row[k]]
                for p in cutlass.range_constexpr(1, CLUSTER):
                    total = total + sRecv[p * nr + vec_row[k]]
                inv = prim.rsqrt_approx(prim.div_rn(total, Float32(self.H)) + norm_eps)
                out = normed_vector(c_words[k], inv, w_words[k])
                row = row0 + vec_row[k]
                if vec_in[k]:
                    if row < rows:
                        prim.st_v4_i32(mOut.iterator + (row * self.H + vec_col[k]), tuple(out))
                # Every lane joins the group's shuffles: a tail vector's whole group of 16 lanes only skips the stores.
                if const_expr(self.quant is not None):
                    writer = self.mxfp8 if const_expr(self.mxfp8 is not None) else self.fp8
                    writer.quantize_vector(out, places[k], cutlass.Boolean(vec_in[k] & (row < rows)))


class LayerInputKernel:
    """The layer input alone (no projection, no workspace), for the scheduler's main stream while the
    projection runs beside it; the inline form's cluster code, so the same bits."""

    def __init__(
        self, H: int, *, variant: str = "standard", layer_input: str = "carried", quant: str | None = None
    ) -> None:
        self.broadcast = variant == "broadcast"
        self.role = LayerInputRole(H, self.broadcast, layer_input, LAYER_INPUT_WARPS, INPUT_ONLY_BUDGET, quant)

    @cute.jit
    def __call__(
        self,
        mX: cute.Tensor,  # [T, 4, H] bf16 streams, or [T, H] bf16 embedding (broadcast)
        mPreMix: cute.Tensor | None,  # [T, 4] fp32 carried pre (the carried collapse)
        mW: cute.Tensor | None,  # [H] bf16 norm weight (None: an unnormed mode)
        mOut: cute.Tensor,  # [T, H] bf16 layer input
        mQ: cute.Tensor | None,  # [T, H] e4m3 (with `quant`)
        mScale: cute.Tensor | None,  # MXFP8: [roundup(T, 128) * H/32] uint8, swizzled 128x4; FP8 1x128: [H/128, T_pad]
        norm_eps: Float32,
        stream: cuda.CUstream,
    ):
        clusters = (mX.shape[0] + (self.role.norm_rows - 1)) // self.role.norm_rows
        self.kernel(mX, mPreMix, mW, mOut, mQ, mScale, norm_eps).launch(
            grid=[CLUSTER, clusters, 1],
            block=[self.role.threads, 1, 1],
            cluster=[CLUSTER, 1, 1],
            stream=stream,
            use_pdl=True,
            # Without it ptxas aims at full occupancy (32 registers) and sinks loads below math.
            min_blocks_per_mp=1,
        )

    @cute.kernel
    def kernel(
        self,
        mX: cute.Tensor,
        mPreMix: cute.Tensor | None,
        mW: cute.Tensor | None,
        mOut: cute.Tensor,
        mQ: cute.Tensor | None,
        mScale: cute.Tensor | None,
        norm_eps: Float32,
    ):
        rank, cluster_id, smem, mbar = cluster_prologue()
        _, clusters, _ = cute.arch.grid_dim()
        self.role.cluster_cta(smem, mbar, mX, mPreMix, mW, mOut, norm_eps, rank, cluster_id, mQ, mScale, clusters)
