"""The boundary's loads role: one row's streams, partial, addend and coefficients into registers, and the
rank's partial y_r from them (the bf16 partial x, or the MoE top-k combine, plus the shared addend); the
Ctx every role of the kernel reads."""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64, Uint32, const_expr

from cute_kernels import HC, VEC, ptx
from cute_kernels.allreduce.peer import PeerState
from cute_kernels.allreduce.protocol import ERROR_MOE_INDEX, ERROR_MOE_ROW
from cute_kernels.boundary.config import COEFS

MOE_GROUP = 8  # experts whose gathers are issued together


def row_major(shape: tuple) -> cute.Layout:
    """A compact layout whose last mode is contiguous (so each vector is one 16-byte register run)."""
    return cute.make_ordered_layout(shape, order=tuple(range(len(shape) - 1, -1, -1)))


@dataclass(frozen=True)
class Ctx:
    """What every row of a CTA shares, made once by FusedBoundaryKernel.kernel: the row part (the kernel's tensors,
    this thread's place in the launch, what the CTA holds across rows) and the peer part (`peer`, W > 1)."""

    # The kernel's arguments (FusedBoundaryKernel.__call__ gives their shapes).
    mR: cute.Tensor
    mPost: cute.Tensor
    mComb: cute.Tensor
    mPre: cute.Tensor | None
    mX: cute.Tensor | None
    mShared: cute.Tensor | None
    mG: cute.Tensor | None
    mEW: cute.Tensor | None
    mIdx: cute.Tensor | None
    mNewR: cute.Tensor
    mOut: cute.Tensor | None
    mQ: cute.Tensor | None
    mScale: cute.Tensor | None
    mQ8: cute.Tensor | None
    mScale8: cute.Tensor | None
    mAux: cute.Tensor | None
    mError: cute.Tensor | None
    eps: Float32
    # The launch and this thread's place in it.
    rows: Int32  # T
    clusters: Int32  # the grid's y extent: cluster c takes rows c, c + clusters, ...
    cta: Int32  # this CTA's column chunk of a row
    tidx: Int32
    vcols: list  # per vector of this thread: its position in the row, in vectors
    valid: list  # per vector: whether it is real (None: always; a tail thread's last holds a clamped duplicate)
    # What the CTA holds across its rows.
    rW: cute.Tensor | None  # this thread's vectors of the norm weight (pre)
    sRed: cute.Tensor | None  # the cluster sum's slots (pre)
    sMix: cute.Tensor | None  # the premix cells (Epilogue.premix)
    mbar: cute.Pointer | None  # the cluster sum's mbarriers
    # The own pre (own_pre.OwnPreRole): fn's pre rows, the mix parameters, the exchange's slots and mbarriers.
    mMixFn: cute.Tensor | None
    mix: list | None
    sOwn: cute.Tensor | None
    mbarOwn: cute.Pointer | None
    peer: PeerState | None  # the peer exchange's state (W > 1, once the call's generation is known)
    own_fn: list | None = None  # the own pre's fn values in registers (FusedBoundaryKernel's fn_in_registers)


class RowRegs:
    """The registers one row's loads land in: the streams, the partial and addend, one coefficient per lane, and a
    staged row's slot words (made by RowLoads.regs)."""

    def __init__(self, vpt: int, *, x: bool, shared: bool, slot_shape: tuple | None) -> None:
        self.rR = cute.make_rmem_tensor(row_major((vpt, HC, VEC)), BFloat16)
        self.rX = cute.make_rmem_tensor(row_major((vpt, VEC)), BFloat16) if x else None
        self.rS = cute.make_rmem_tensor(row_major((vpt, VEC)), BFloat16) if shared else None
        # Lane i holds coefficient i (post, comb, pre), shuffled out when used.
        self.coef = cute.make_rmem_tensor((1,), Float32)
        # A staged row's slot words, loaded with the row (PeerReduce.row_slot_shape).
        self.rSlot = None if slot_shape is None else cute.make_rmem_tensor(slot_shape, Uint32)


@dataclass(frozen=True)
class RowLoads:
    """Issues a row's loads (`vpt` 16-byte vectors per thread) and forms this rank's partial from them. Frozen: the
    DSL passes a frozen dataclass into a dynamic `if` or loop as it is (the peer role's staged phases take it)."""

    H: int
    vpt: int
    y_source: str  # "x": a ready partial; "moe": the top-k combine
    shared: bool  # an addend
    pre: bool  # the row's pre coefficients too

    def regs(self, slot_shape: tuple | None = None) -> RowRegs:
        """Registers for one row's loads (and, with `slot_shape`, its slot words)."""
        return RowRegs(self.vpt, x=self.y_source == "x", shared=self.shared, slot_shape=slot_shape)

    @cute.jit
    def load_row(self, ctx: Ctx, regs: RowRegs, row: Int32, partial: bool = True):
        """Issue every load of one row into `regs` (the partial's unless `partial` is False: a staged two-shot row
        takes y from its slot); nothing waits for them here."""
        vpt = const_expr(self.vpt)
        self.load_coefs(ctx, regs.coef, row)
        copy16 = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BFloat16, num_bits_per_copy=128)
        for v in cutlass.range_constexpr(vpt):
            for k in cutlass.range_constexpr(HC):
                cute.copy(copy16, cute.local_tile(ctx.mR[row, k, None], (VEC,), (ctx.vcols[v],)), regs.rR[v, k, None])
        if const_expr(partial):
            self.load_partial(ctx, regs, row)

    @cute.jit
    def load_partial(self, ctx: Ctx, regs: RowRegs, row: Int32):
        """Issue the loads of one row's partial (x and the addend; the MoE gathers are issued when combined)."""
        vpt = const_expr(self.vpt)
        copy16 = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BFloat16, num_bits_per_copy=128)
        if const_expr(self.shared):
            for v in cutlass.range_constexpr(vpt):
                cute.copy(copy16, cute.local_tile(ctx.mShared[row, None], (VEC,), (ctx.vcols[v],)), regs.rS[v, None])
        if const_expr(self.y_source == "x"):
            for v in cutlass.range_constexpr(vpt):
                cute.copy(copy16, cute.local_tile(ctx.mX[row, None], (VEC,), (ctx.vcols[v],)), regs.rX[v, None])

    @cute.jit
    def load_coefs(self, ctx: Ctx, coef: cute.Tensor, row: Int32):
        """Coefficient `lane` of the row (post [0, 4), comb [4, 20), pre [20, 24)) into lane `lane`."""
        n = const_expr(COEFS if self.pre else HC + HC * HC)
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
        coef[0] = ptx.f32_from_bits(ptx.ld_global_b32_pred(addr, lane < n))

    @cute.jit
    def coefs(self, coef: cute.Tensor) -> tuple[list, list, list | None]:
        """(post[j], comb[k][j], pre[j]) of a loaded row, shuffled out of the lanes that hold them."""
        n = const_expr(COEFS if self.pre else HC + HC * HC)
        vals = [cute.arch.shuffle_sync(coef[0], i) for i in range(n)]
        post = vals[:HC]
        comb = [[vals[HC + k * HC + j] for j in range(HC)] for k in range(HC)]
        pre = vals[HC + HC * HC :] if const_expr(self.pre) else None
        return post, comb, pre

    @cute.jit
    def partial(self, ctx: Ctx, regs: RowRegs, row: Int32) -> cute.Tensor:
        """This rank's partial for this thread's vectors as a (vpt, 8) fp32 register tensor holding bf16 values:
        x, or the MoE combine, then the shared addend last and one rounding (CONTRACT §2)."""
        vpt = const_expr(self.vpt)
        y = cute.make_rmem_tensor(row_major((vpt, VEC)), Float32)
        if const_expr(self.y_source == "x"):
            for v in cutlass.range_constexpr(vpt):
                y[v, None].store(regs.rX[v, None].load().to(Float32))
        else:
            self.moe_combine(ctx, y, row)
        if const_expr(self.shared):
            for v in cutlass.range_constexpr(vpt):
                ss = regs.rS[v, None].load().to(Float32)
                self.round_into(y, v, [ptx.add_rn(y[v, e], ss[e]) for e in range(VEC)])
        elif const_expr(self.y_source == "moe"):
            for v in cutlass.range_constexpr(vpt):
                self.round_into(y, v, [y[v, e] for e in range(VEC)])
        return y

    @cute.jit
    def moe_combine(self, ctx: Ctx, acc: cute.Tensor, row: Int32):
        """acc = sum_i w[row, i] * G[idx[row, i]] in fp32, i in order; an index -1 adds nothing, and so does
        any other index outside [0, P), which CTA 0's thread 0 also reports in the error word (CONTRACT §2)."""
        vpt = const_expr(self.vpt)
        mG, mEW, mIdx = ctx.mG, ctx.mEW, ctx.mIdx
        top_k = mEW.shape[1]
        experts_in_g = mG.shape[0]
        reporter = (ctx.tidx == 0) & (ctx.cta == 0)
        error = ctx.mError.iterator
        acc.fill(0.0)
        g_base = mG.iterator.toint()
        for group in cutlass.range(cute.ceil_div(top_k, MOE_GROUP)):
            # Issue every index, weight and row gather of the group before the first add.
            experts, weights = [], []
            for u in cutlass.range_constexpr(MOE_GROUP):
                i = group * MOE_GROUP + u
                safe_i = cutlass.min(i, top_k - 1)
                e = mIdx[row, safe_i]
                e = Int32(cutlass.select_(i < top_k, e, Int32(-1)))
                bad = (e < -1) | (e >= experts_in_g)
                if bad & reporter:
                    cute.arch.atomic_max(error + ERROR_MOE_ROW, row + 1, sem="relaxed", scope="gpu")
                    cute.arch.store(error + ERROR_MOE_INDEX, e)
                experts.append(Int32(cutlass.select_(bad, Int32(-1), e)))
                weights.append(mEW[row, safe_i])
            gathered = []
            for u in cutlass.range_constexpr(MOE_GROUP):
                valid = experts[u] >= 0
                row_off = Int64(cutlass.max(experts[u], Int32(0))) * self.H
                gathered.append(
                    [
                        ptx.ld_global_v4_pred(g_base + (row_off + Int64(ctx.vcols[v] * VEC)) * 2, valid)
                        for v in range(vpt)
                    ]
                )
            for u in cutlass.range_constexpr(MOE_GROUP):
                valid = experts[u] >= 0
                for v in cutlass.range_constexpr(vpt):
                    for e in cutlass.range_constexpr(VEC):
                        word = gathered[u][v][e // 2]
                        g = ptx.bf16_lo(word) if e % 2 == 0 else ptx.bf16_hi(word)
                        summed = ptx.mul_add_rn(weights[u], g, acc[v, e])
                        acc[v, e] = Float32(cutlass.select_(valid, summed, acc[v, e]))

    @cute.jit
    def round_into(self, y: cute.Tensor, v: int, vals: list):
        """y[v, :] = the fp32 values of bf16(vals)."""
        for e in cutlass.range_constexpr(0, VEC, 2):
            word = ptx.cvt_bf16x2(vals[e], vals[e + 1])
            y[v, e] = ptx.bf16_lo(word)
            y[v, e + 1] = ptx.bf16_hi(word)
