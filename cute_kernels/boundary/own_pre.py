"""The boundary's own-pre role (CONTRACT §4d): the pre of a row computed from its new streams R' in the kernel that
writes them, for DeepSeek-V4's layer input and `hc_head`. Only the pre needs it: `pre = sigmoid(scale * (fn . R') *
rsqrt(mean(R'^2) + rms_eps) + base) + eps` over the row's 4H values, with `fn` the 4 rows of the pre mixes (a layer's
first 4 of its 24, or hc_head's own) and no Sinkhorn, so the row's CTAs each take their columns' dot products, and
one more cluster exchange (as the RMS's) gives every thread the same 4 sums and sum of squares in a fixed order.

The CTA's `fn` columns are prefetched into L2 before the wait (weights: no register holds them); the mix parameters
(MIX_PARAMS floats: scale, 4 biases, rms_eps, eps) are read after it, since `mix_weights` writes them with kernels of
the same stream on its first call."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr

from cute_kernels import HC, VEC, ptx, reduce

MIX_PARAMS = 8  # scale, base[0..3], rms_eps, eps (added after the sigmoid), unused
SLOT = 8  # floats per warp slot of the exchange: the 4 dot products (one 16-byte push), the sum of squares
LINE = 128  # bytes of an L2 line


def vector_ok(valid: list, v: int) -> cutlass.Boolean:
    """Whether this thread's vector v is a real one (`valid[v]` None: always)."""
    return cutlass.Boolean(True) if valid[v] is None else valid[v]


class OwnPreRole:
    """The pre of rows whose columns are split over a cluster of `cluster_n` CTAs of `threads` threads (`vpt`
    vectors each); the exchange's slots and mbarriers double-buffered by row parity like the RMS's."""

    def __init__(self, H: int, cluster_n: int, threads: int, vpt: int, *, use_cluster: bool, spin: bool) -> None:
        self.H = H
        self.K = HC * H
        self.cluster_n = cluster_n
        self.threads = threads
        self.vpt = vpt
        self.warps = threads // 32
        self.slots = self.warps * cluster_n
        self.use_cluster = use_cluster
        self.spin = spin
        self.stages = 2

    def smem_floats(self) -> int:
        """Shared fp32 of the exchange's slots."""
        return self.stages * self.slots * SLOT

    @cute.jit
    def params(self, mMix: cute.Tensor) -> list:
        """The mix parameters in registers (every thread; after the wait)."""
        return [mMix[i] for i in range(MIX_PARAMS - 1)]

    @cute.jit
    def prefetch(self, mFn: cute.Tensor, cta: Int32, tidx: Int32, issue: cutlass.Boolean):
        """This CTA's columns of `fn` (4 rows x 4 streams x its chunk of fp32) into L2, a share of the lines per
        thread, where `issue` (before the wait)."""
        chunk_bytes = const_expr(self.H // self.cluster_n * 4)
        lines = const_expr(HC * HC * chunk_bytes // LINE)
        base = mFn.iterator.toint() + Int64(cta * chunk_bytes)
        for i in cutlass.range(tidx, Int32(cutlass.select_(issue, Int32(lines), Int32(0))), self.threads):
            piece = i // (chunk_bytes // LINE)  # which (row, stream) run of the chunk
            off = (i % (chunk_bytes // LINE)) * LINE
            ptx.prefetch_l2(base + Int64(piece) * (self.H * 4) + Int64(off))

    @cute.jit
    def fn_vector(self, mFn: cute.Tensor, v: int, j: int, vcols: list, ok: cutlass.Boolean) -> list:
        """fn's 4 pre rows at stream j's columns of this thread's vector v: [m][8] fp32 (zeros where not `ok`)."""
        base = mFn.iterator.toint()
        f = []
        for m in cutlass.range_constexpr(HC):
            addr = base + (Int64(m * self.K + j * self.H) + Int64(vcols[v] * VEC)) * 4
            lo = ptx.ld_global_v4_pred(addr, ok)
            hi = ptx.ld_global_v4_pred(addr + 16, ok)
            f.append([ptx.f32_from_bits(w) for w in (*lo, *hi)])
        return f

    @cute.jit
    def load_fn(self, mFn: cute.Tensor, vcols: list, valid: list) -> list:
        """Every fn value this thread's columns take, [v][j][m][8] fp32, into registers (weights: before the wait)."""
        return [[self.fn_vector(mFn, v, j, vcols, vector_ok(valid, v)) for j in range(HC)] for v in range(self.vpt)]

    @cute.jit
    def partials(self, mFn: cute.Tensor, kept: list, vcols: list, valid: list, fn: list | None = None) -> list:
        """This thread's 4 dot products of `fn` with its values of R' (`kept`: per vector and stream, the 8 rounded
        values as 4 packed bf16 words) and their sum of squares, in the order vector, stream, element; `fn`: the
        weights load_fn holds in registers, or None to load them here (from L2, after `prefetch`)."""
        acc = [Float32(0.0) for _ in range(HC + 1)]
        for v in cutlass.range_constexpr(self.vpt):
            ok = vector_ok(valid, v)
            for j in cutlass.range_constexpr(HC):
                f = self.fn_vector(mFn, v, j, vcols, ok) if const_expr(fn is None) else fn[v][j]
                for e in cutlass.range_constexpr(VEC):
                    # A clamped duplicate vector (a tail thread's last) adds nothing: its weights loaded as zeros.
                    word = kept[v][j][e // 2]
                    x = ptx.bf16_lo(word) if e % 2 == 0 else ptx.bf16_hi(word)
                    if const_expr(valid[v] is not None):
                        x = Float32(cutlass.select_(ok, x, Float32(0.0)))
                    acc[HC] = ptx.mul_add_rn(x, x, acc[HC])
                    for m in cutlass.range_constexpr(HC):
                        acc[m] = ptx.mul_add_rn(f[m][e], x, acc[m])
        return acc

    @cute.jit
    def exchange(self, acc: list, sOwn: cute.Tensor, mbar: cute.Pointer | None, cta: Int32, stage: int, phase: Int32):
        """The row's totals of the 5 partial sums over every warp of its cluster, in slot order, on every thread."""
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        sums = [reduce.warp_sum(a) for a in acc]
        base = const_expr(stage * self.slots * SLOT)
        slot = cta * self.warps + warp
        if const_expr(self.use_cluster):
            if warp == 0:
                reduce.expect_bytes(mbar + stage, self.slots * (HC + 1) * 4)
            if lane < self.cluster_n:
                dst = sOwn.iterator + cute.assume(base + slot * SLOT, divby=4)  # 16-byte aligned: one push
                reduce.push(dst, (sums[0], sums[1], sums[2], sums[3]), mbar + stage, lane)
                reduce.push(dst + HC, sums[HC], mbar + stage, lane)
        else:
            if lane == 0:
                for n in cutlass.range_constexpr(HC + 1):
                    sOwn[base + slot * SLOT + n] = sums[n]
            cute.arch.barrier()
        if const_expr(self.use_cluster):
            reduce.wait_pushes(mbar + stage, phase, self.spin)
        totals = []
        for n in cutlass.range_constexpr(HC + 1):
            part = Float32(0.0)
            for i in cutlass.range_constexpr(cute.ceil_div(self.slots, 32)):
                if lane + i * 32 < self.slots:
                    part = part + sOwn[base + (lane + i * 32) * SLOT + n]
            totals.append(reduce.warp_sum(part))
        if const_expr(self.use_cluster):
            cute.arch.fence_view_async_shared()  # the peers' next pushes to this stage come through the async proxy
        return totals

    @cute.jit
    def pre(self, totals: list, mix: list) -> list:
        """CONTRACT §3 steps 1-2 on the row's totals: the coefficients kernel's operations, in its order."""
        r = ptx.rsqrt_approx(ptx.div_rn(totals[HC], Float32(self.K)) + mix[5])
        out = []
        for j in cutlass.range_constexpr(HC):
            z = totals[j] * r * mix[0] + mix[1 + j]
            out.append(ptx.rcp_approx(Float32(1.0) + ptx.exp_approx(-z)) + mix[6])
        return out

    @cute.jit
    def row_pre(
        self,
        mFn: cute.Tensor,
        mPre: cute.Tensor,
        mix: list,
        kept: list,
        vcols: list,
        valid: list,
        sOwn: cute.Tensor,
        mbar: cute.Pointer | None,
        row: Int32,
        cta: Int32,
        tidx: Int32,
        stage: int,
        phase: Int32,
        fn: list | None = None,
    ) -> list:
        """The pre of one row (every thread), also written to mPre[row] by the row's first thread; `fn` as partials'."""
        acc = self.partials(mFn, kept, vcols, valid, fn)
        totals = self.exchange(acc, sOwn, mbar, cta, stage, phase)
        pre = self.pre(totals, mix)
        if (cta == 0) & (tidx == 0):
            for j in cutlass.range_constexpr(HC):
                mPre[row, j] = pre[j]
        return pre
