"""The FP8 1x128 writer with a predicted group amax, against the shipped one, in one run: `python -m bench.experiments.fp8_spec_ab`.

The shipped writer reduces each group's amax over its 16 lanes (two `redux.sync`) after `inv` arrives, then derives
the scale and its reciprocal, one step after the other, then stores: perf-log v28 took that chain for what the FP8
form adds at few rows. Forms:

- `spec` (exact): while the RMS sums cross the cluster, each group reduces max |c*w| (fp32, exact for bf16 c and w),
  so that after `inv` the predicted amax is bf16(max|c*w| * inv), one multiply; its scale (the reciprocal's MUFU on
  the quotient's first step, beside its correction) and bytes are stored at once (at addresses made as `early`). Then every lane votes whether its
  own max |out| is <= the prediction and whether it equals it; where every lane agrees and some lane of each group
  equals it, the prediction was the group's amax; otherwise (near a bf16 rounding boundary, NaN, Inf, eps = 0) the
  group reduces as the shipped writer does and stores again (a thread's later store to an address wins).
- `early` (exact): the shipped writer whose addresses and last-row store choice are made before the RMS wait, not
  after the values (the parameters they read come from the constant bank, whose tail misses ncu counts).
- `spec miss` (exact): `spec` whose every prediction is off by one: the fallback's bytes and cost.
- ablations (wrong bytes, timed only): `floor` no amax and no scale (1 / sf = 1), `noscale` no scale store,
  `nodata` no data store.

Each candidate's bytes are checked against the shipped writer's first (data, every scale, the padding, over a
poisoned buffer, with a NaN, an Inf, an all-zero group), then bf16 only, the shipped writer and the candidates are
timed as bench/timing.py times (a CUDA graph of 20 calls on rotating inputs, L2 flushed, median of replays), in
interleaved rounds.
"""

from __future__ import annotations

import argparse
import statistics

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Boolean, Float32, Int32, Int64, Uint32, const_expr
from cutlass.cutlass_dsl import dsl_user_op

from bench.kernels import boundary_inputs
from bench.timing import GraphTimer
from cute_kernels import E4M3_MAX, VEC, ptx
from cute_kernels.boundary import api
from cute_kernels.boundary.config import default_config
from cute_kernels.boundary.epilogue import Epilogue, unpack
from cute_kernels.boundary.kernel import FusedBoundaryKernel
from cute_kernels.compile import arch_for_device
from cute_kernels.quant import FP8_GROUP_AMAX_FLOOR, FP8_GROUP_LANES, Fp8GroupWriter, amax_over_e4m3_max

CANDIDATES = ("early", "spec", "spec miss")  # exact: their bytes are checked
ABLATIONS = ("floor", "noscale", "nodata")  # not exact: timed only
FORMS = ("bf16", "fp8", *ABLATIONS, *CANDIDATES)
SETS = 20  # input sets per graph, as bench/timing.py


@dsl_user_op
def st_global_b32_pred(addr: Int64, val: Uint32, pred: Boolean, *, loc=None, ip=None) -> None:
    """Store one 32-bit word when `pred`."""
    cute.arch.inline_ptx(
        "st.global.b32 [{$r0}], {$r1};",
        read_only_args=[Int64(addr), Uint32(val)],
        predicate=Boolean(pred),
        loc=loc,
        ip=ip,
    )


@dsl_user_op
def st_global_v2_pred(addr: Int64, lo: Uint32, hi: Uint32, pred: Boolean, *, loc=None, ip=None) -> None:
    """Store two 32-bit words (8-byte aligned) when `pred`."""
    cute.arch.inline_ptx(
        "st.global.v2.b32 [{$r0}], {{$r1}, {$r2}};",
        read_only_args=[Int64(addr), Uint32(lo), Uint32(hi)],
        predicate=Boolean(pred),
        loc=loc,
        ip=ip,
    )


class CandidateWriter(Fp8GroupWriter):
    """The FP8 1x128 writer with a predicted amax (`spec`), a parallel reciprocal (`prcp`), or both."""

    def __init__(self, H: int, *, spec: bool, prcp: bool, miss: bool = False, ablate: str | None = None) -> None:
        super().__init__(H, ue8m0=False)
        self.spec = spec
        self.prcp = prcp
        self.miss = miss
        self.ablate = ablate

    @cute.jit
    def hint(self, c: list, w: list) -> Uint32:
        """max |c * w| of the group (fp32 bits; exact for bf16 operands), on every lane of the group."""
        m = Uint32(0)
        for e in cutlass.range_constexpr(VEC):
            m = cutlass.max(m, ptx.f32_bits(ptx.mul_rn(c[e], w[e])) & Uint32(0x7FFFFFFF))
        low = cute.arch.lane_idx() < FP8_GROUP_LANES
        m_lo = cute.arch.warp_redux_sync(Uint32(cutlass.select_(low, m, Uint32(0))), "umax")
        m_hi = cute.arch.warp_redux_sync(Uint32(cutlass.select_(low, Uint32(0), m)), "umax")
        return Uint32(cutlass.select_(low, m_lo, m_hi))

    @cute.jit
    def scale(self, amax: Uint32) -> tuple:
        """(sf, 1 / sf); `prcp`: the reciprocal's MUFU on the quotient's first step, beside its correction."""
        if const_expr(not self.prcp):
            return Fp8GroupWriter.scale(self, amax)
        a = ptx.f32_from_bits(amax << 16)
        a = Float32(cutlass.select_(a < Float32(FP8_GROUP_AMAX_FLOOR), Float32(FP8_GROUP_AMAX_FLOOR), a))
        non_finite = amax >= Uint32(0x7F80)
        y0 = ptx.rcp_approx(ptx.mul_rn(a, Float32(1.0 / E4M3_MAX)))
        sf = amax_over_e4m3_max(a, non_finite)
        e = ptx.fma_rn(-sf, y0, Float32(1.0))
        inverse = Float32(cutlass.select_(non_finite, y0, ptx.fma_rn(y0, e, y0)))
        return sf, inverse

    @cute.jit
    def quantize_predicted(
        self,
        words: list,
        hint: Uint32,
        inv: Float32,
        place: tuple,
        valid: cutlass.Boolean | None,
    ):
        """quantize_vector with the amax predicted from `hint`, stored at once, then checked by two votes: where they
        disagree the group stores again from its reduced amax (a thread's later store to an address wins)."""
        pred = ptx.cvt_bf16x2(ptx.mul_rn(ptx.f32_from_bits(hint), inv), Float32(0.0)) & Uint32(0x7FFF)
        if const_expr(self.miss):
            pred = pred + Uint32(1)
        sf, inverse = self.scale(pred)
        q_lo, q_hi = self.encode(words, inverse)
        self.store_at(place, q_lo, q_hi, sf, valid)
        local = Uint32(0)
        for i in cutlass.range_constexpr(4):
            local = cutlass.max(local, words[i] & Uint32(0x7FFF), (words[i] >> 16) & Uint32(0x7FFF))
        below = Boolean(local <= pred)
        equal = Boolean(local == pred)
        if const_expr(valid is not None):
            below = Boolean(cutlass.select_(valid, below, Boolean(True)))
            equal = Boolean(cutlass.select_(valid, equal, Boolean(True)))
        every_below = cute.arch.vote_all_sync(below)
        hits = Uint32(cute.arch.vote_ballot_sync(equal))
        fast = every_below & ((hits & Uint32(0xFFFF)) != Uint32(0)) & ((hits >> 16) != Uint32(0))
        if not fast:
            sf2, inverse2 = self.scale(self.group_amax(words))
            q_lo2, q_hi2 = self.encode(words, inverse2)
            self.store_at(place, q_lo2, q_hi2, sf2, valid)

    @cute.jit
    def quantize_placed(self, words: list, place: tuple, valid: cutlass.Boolean | None):
        """The shipped writer's arithmetic, stored at `place`."""
        sf, inverse = self.scale(self.group_amax(words))
        q_lo, q_hi = self.encode(words, inverse)
        self.store_at(place, q_lo, q_hi, sf, valid)

    @cute.jit
    def place(self, mQ: cute.Tensor, mScale: cute.Tensor, row: Int32, rows: Int32, vcol: Int32) -> tuple:
        """(data address, scale address, and the predicates of the group's first lane's scale stores: the last row's
        scale and padding in 16 bytes, in 8, in 4 + 8 by its place in its chunk of 4, else the scale alone), made
        ahead of the values."""
        q_addr = mQ.iterator.toint() + (Int64(row) * self.H + Int64(vcol * VEC))
        padded = mScale.shape[1]
        scale_addr = mScale.iterator.toint() + (Int64(vcol // FP8_GROUP_LANES) * Int64(padded) + Int64(row)) * 4
        first = cute.arch.lane_idx() % FP8_GROUP_LANES == 0
        last = row == rows - 1
        at = row % 4
        wide = Boolean(first & last & (at == 0))
        word = Boolean(first & ((~last) | (at == 1) | (at == 3)))
        pad = Boolean(first & last & (at == 1))
        pair = Boolean(first & last & (at == 2))
        return q_addr, scale_addr, wide, word, pad, pair

    @cute.jit
    def store_at(self, place: tuple, q_lo: Uint32, q_hi: Uint32, sf: Float32, valid: cutlass.Boolean | None):
        """The data and scale stores at a precomputed `place`, unless `valid` is False."""
        if const_expr(valid is None):
            self.store_placed(place, q_lo, q_hi, ptx.f32_bits(sf))
        else:
            if valid:
                self.store_placed(place, q_lo, q_hi, ptx.f32_bits(sf))

    @cute.jit
    def store_placed(self, place: tuple, q_lo: Uint32, q_hi: Uint32, sf_bits: Uint32):
        """The data, then the scale stores under their predicates (no branch)."""
        q_addr, scale_addr, wide, word, pad, pair = place
        zero = Uint32(0)
        ptx.st_global_v2_b32(q_addr, q_lo, q_hi)
        ptx.st_global_v4_pred(scale_addr, sf_bits, zero, zero, zero, wide)
        st_global_b32_pred(scale_addr, sf_bits, word)
        st_global_v2_pred(scale_addr + 4, zero, zero, pad)
        st_global_v2_pred(scale_addr, sf_bits, zero, pair)

    @cute.jit
    def encode(self, words: list, inverse: Float32) -> tuple:
        """The 8 e4m3 bytes of a vector at 1 / sf = `inverse`, as two words."""
        q = []
        for i in cutlass.range_constexpr(8):
            x = ptx.bf16_lo(words[i // 2]) if i % 2 == 0 else ptx.bf16_hi(words[i // 2])
            q.append(ptx.mul_rn(x, inverse))
        return ptx.cvt_e4m3x4(q[0], q[1], q[2], q[3]), ptx.cvt_e4m3x4(q[4], q[5], q[6], q[7])

    @cute.jit
    def quantize_vector(self, words: list, mQ, mScale, row: Int32, rows: Int32, vcol: Int32, valid):
        """The shipped writer, or one of the ablations (`ablate`: "floor" no amax and no scale, sf = 1 / sf = 1;
        "noscale" no scale store; "nodata" no data store)."""
        if const_expr(self.ablate is None):
            Fp8GroupWriter.quantize_vector(self, words, mQ, mScale, row, rows, vcol, valid)
        else:
            sf, inverse = Float32(1.0), Float32(1.0)
            if const_expr(self.ablate != "floor"):
                sf, inverse = self.scale(self.group_amax(words))
            q_lo, q_hi = self.encode(words, inverse)
            self.write(q_lo, q_hi, sf, mQ, mScale, row, rows, vcol, valid)

    @cute.jit
    def store(self, q_addr, q_lo, q_hi, scale_addr, sf_bits, lane, row, rows):
        if const_expr(self.ablate != "nodata"):
            self.store_data(q_addr, q_lo, q_hi)
        if const_expr(self.ablate != "noscale"):
            self.store_scale(scale_addr, sf_bits, lane, row, rows)

    @cute.jit
    def write(self, q_lo, q_hi, sf, mQ, mScale, row, rows, vcol, valid):
        """The shipped writer's stores (quantize_vector's tail)."""
        q_addr = mQ.iterator.toint() + (Int64(row) * self.H + Int64(vcol * VEC))
        padded = mScale.shape[1]
        scale_addr = mScale.iterator.toint() + (Int64(vcol // FP8_GROUP_LANES) * Int64(padded) + Int64(row)) * 4
        lane = cute.arch.lane_idx()
        if const_expr(valid is None):
            self.store(q_addr, q_lo, q_hi, scale_addr, ptx.f32_bits(sf), lane, row, rows)
        else:
            if valid:
                self.store(q_addr, q_lo, q_hi, scale_addr, ptx.f32_bits(sf), lane, row, rows)


class CandidateEpilogue(Epilogue):
    """The epilogue whose FP8 writer takes its addresses (and with `spec` the group's hint) before the RMS wait."""

    @cute.jit
    def finish_row(self, ctx, row: Int32, rC: cute.Tensor, sumsq: Float32, stage: int, phase: Int32):
        vpt = const_expr(self.vpt)
        self.send_warp_sum(sumsq, ctx.sRed, ctx.mbar, ctx.cta, stage)
        hints = []
        places = []
        for v in cutlass.range_constexpr(vpt):
            places.append(self.fp8.place(ctx.mQ8, ctx.mScale8, row, ctx.rows, ctx.vcols[v]))
            if const_expr(self.fp8.spec):
                hints.append(self.fp8.hint([rC[v, e] for e in range(VEC)], self.weights(ctx, v)))
        total = self.gather_sum(ctx.sRed, ctx.mbar, stage, phase)
        inv = ptx.rsqrt_approx(ptx.div_rn(total, Float32(self.H)) + ctx.eps)
        for v in cutlass.range_constexpr(vpt):
            wf = self.weights(ctx, v)
            words = [ptx.cvt_bf16x2(rC[v, e] * inv * wf[e], rC[v, e + 1] * inv * wf[e + 1]) for e in range(0, VEC, 2)]
            self.store_words(words, cute.local_tile(ctx.mOut[row, None], (VEC,), (ctx.vcols[v],)), ctx.valid[v])
            if const_expr(self.fp8.spec):
                self.fp8.quantize_predicted(words, hints[v], inv, places[v], ctx.valid[v])
            else:
                self.fp8.quantize_placed(words, places[v], ctx.valid[v])

    @cute.jit
    def weights(self, ctx, v: int) -> list:
        """This thread's vector v of the norm weight, in fp32."""
        rw = cute.recast_tensor(ctx.rW[v, None], Uint32)
        packed = [ptx.opaque_u32(rw[i]) for i in range(VEC // 2)]
        return [unpack(packed, e) for e in range(VEC)]


def compiled(H: int, arch: str, form: str) -> object:
    """The one-rank kernel of `form` (FORMS)."""
    config = default_config(H, arch)
    v = api.BoundaryVariant(fp8=None if form == "bf16" else "fp8_1x128")
    if form in ("bf16", "fp8"):
        return api.compile_fused_boundary(H, *v, config, 1, "oneshot", arch=arch)
    kernel = FusedBoundaryKernel(H, config, fp8="fp8_1x128")
    spec = form.startswith("spec")
    if spec or form == "early":
        kernel.epilogue = CandidateEpilogue(
            H, config.cluster_n, config.threads, kernel.vpt, pre=True, mxfp8=False, aux=False, fp8="fp8_1x128"
        )
    ablate = form if form in ABLATIONS else None
    kernel.epilogue.fp8 = CandidateWriter(H, spec=spec, prcp=spec, miss=form.endswith("miss"), ablate=ablate)
    return api.compile_boundary_kernel(kernel, H, v, 1, arch=arch)


def call(fn: object, s: dict, form: str):
    """One call of a compiled kernel on the input set `s`: bf16 only, or with FP8 1x128."""
    fp8 = form != "bf16"
    args = api.launch_args(
        residual=s["residual"],
        post=s["post"],
        comb=s["comb"],
        pre=s["pre"],
        norm_weight=s["norm_weight"],
        x=s["x"],
        new_residual=s["new_residual"],
        out=s["out"],
        fp8_data=s["fp8_data"] if fp8 else None,
        fp8_scale=s["fp8_scale"] if fp8 else None,
        eps=1e-20,
    )
    return lambda: fn(*args)


def same_bytes(fns: dict, H: int, rows: int, device: torch.device, seed: int) -> list[str]:
    """The candidates whose FP8 bytes (data and every scale, padding too) differ from the shipped writer's."""
    s = boundary_inputs(rows, H, device, seed=seed)
    s["x"][0, :128] = float("nan")  # a NaN group, an Inf one, an all-zero one
    s["x"][-1, 128:256] = 0
    s["residual"][-1, :, 128:256] = 0
    s["x"][rows // 2, 256] = float("inf")
    got = {}
    for form in ("fp8", *CANDIDATES):
        s["fp8_data"].fill_(0x55)
        s["fp8_scale"].fill_(7.0)  # poison: the padding must be zeroed
        call(fns[form], s, form)()
        torch.cuda.synchronize()
        got[form] = (s["fp8_data"].view(torch.uint8).clone(), s["fp8_scale"].view(torch.int32).clone())
    return [f for f in CANDIDATES if not all(torch.equal(a, b) for a, b in zip(got["fp8"], got[f]))]


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.experiments.fp8_spec_ab", description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, nargs="+", default=[4096, 7168])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 5, 16, 128, 512])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--check-rows", type=int, nargs="+", default=[1, 2, 3, 5, 6, 16, 17, 64, 333, 512])
    args = p.parse_args()
    device = torch.device("cuda")
    arch = arch_for_device(device)
    timer = GraphTimer(device)
    print(f"{torch.cuda.get_device_name()}: us per call, {SETS} calls per graph, {args.rounds} interleaved rounds")
    for H in args.hidden:
        fns = {form: compiled(H, arch, form) for form in FORMS}
        for rows in args.check_rows:
            for seed in (7, 8):
                bad = same_bytes(fns, H, rows, device, seed)
                print(f"bytes H {H} rows {rows} seed {seed}: " + ("all equal" if not bad else f"DIFFER: {bad}"))
        print(
            f"{'H':>5} {'rows':>4} | "
            + " ".join(f"{f:>9}" for f in FORMS)
            + " | adds over bf16: "
            + " ".join(f"{f:>9}" for f in FORMS[1:])
        )
        for rows in args.rows:
            sets = [boundary_inputs(rows, H, device, seed) for seed in range(SETS)]
            us = {f: [] for f in FORMS}
            for _ in range(args.rounds):
                for f in FORMS:
                    us[f].append(timer.per_call_us([call(fns[f], s, f) for s in sets]))
            med = {f: statistics.median(v) for f, v in us.items()}
            adds = " ".join(f"{med[f] - med['bf16']:+9.3f}" for f in FORMS[1:])
            print(f"{H:>5} {rows:>4} | " + " ".join(f"{med[f]:9.3f}" for f in FORMS) + f" | {adds}", flush=True)
            for f in FORMS[1:]:
                print(f"      {f:>9} per round: " + " ".join(f"{a - b:+.3f}" for a, b in zip(us[f], us["bf16"])))


if __name__ == "__main__":
    main()
