"""The boundary's loads role: one row's streams, partial, addend and coefficients into registers, and the
rank's partial y_r from them (the bf16 partial x, or the MoE top-k combine, plus the shared addend)."""

from __future__ import annotations

from typing import Any

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64, Uint32, const_expr

from cute_kernels import ptx
from cute_kernels.allreduce.protocol import ERROR_MOE_INDEX, ERROR_MOE_ROW
from cute_kernels.boundary.config import COEFS, HC, VEC

MOE_GROUP = 8  # experts whose gathers are issued together


def row_major(shape: tuple) -> cute.Layout:
    """A compact layout whose last mode is contiguous (so each vector is one 16-byte register run)."""
    return cute.make_ordered_layout(shape, order=tuple(range(len(shape) - 1, -1, -1)))


class Ctx:
    """What every row of a CTA shares: the tensors, this thread's columns, the norm weight, the exchange."""

    def __init__(self, **fields: Any) -> None:
        self.__dict__.update(fields)


class RowRegs:
    """The registers one row's loads land in: the streams, the partial and addend, one coefficient per lane."""

    def __init__(self, loads: RowLoads) -> None:
        vpt = loads.vpt
        self.rR = cute.make_rmem_tensor(row_major((vpt, HC, VEC)), BFloat16)
        self.rX = cute.make_rmem_tensor(row_major((vpt, VEC)), BFloat16) if loads.y_source == "x" else None
        self.rS = cute.make_rmem_tensor(row_major((vpt, VEC)), BFloat16) if loads.shared else None
        # Lane i holds coefficient i (post, comb, pre), shuffled out when used.
        self.coef = cute.make_rmem_tensor((1,), Float32)
        # A staged row's slot words, loaded with the row (allreduce.peer: two-shot its y, one-shot every partial).
        self.rSlot = None if loads.slots is None else cute.make_rmem_tensor(loads.slots.row_slot_shape(), Uint32)


class RowLoads:
    """Issues a row's loads (`vpt` 16-byte vectors per thread) and forms this rank's partial from them."""

    def __init__(self, H: int, vpt: int, *, y_source: str, shared: bool, pre: bool) -> None:
        self.H = H
        self.vpt = vpt
        self.y_source = y_source
        self.shared = shared
        self.pre = pre
        # The peer role of a staged kernel, whose rows load their slot words with their other loads (set by the
        # kernel); a two-shot row takes y from its slot instead of the partial.
        self.slots: Any = None

    @cute.jit
    def load_row(self, ctx: Ctx, regs: RowRegs, row: Int32):
        """Issue every load of one row into `regs`; nothing waits for them here."""
        vpt = const_expr(self.vpt)
        self.load_coefs(ctx, regs.coef, row)
        copy16 = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BFloat16, num_bits_per_copy=128)
        for v in cutlass.range_constexpr(vpt):
            for k in cutlass.range_constexpr(HC):
                cute.copy(copy16, cute.local_tile(ctx.mR[row, k, None], (VEC,), (ctx.vcols[v],)), regs.rR[v, k, None])
        if const_expr(self.slots is None or self.slots.protocol == "oneshot"):
            self.load_partial(ctx, regs, row)
        if const_expr(self.slots is not None):
            self.slots.prefetch_slots(ctx, regs.rSlot, row)

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
