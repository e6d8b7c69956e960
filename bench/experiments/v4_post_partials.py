"""Experiment (#47): DeepSeek-V4's seam at one rank in two launches, the post feeding the projection from registers.

Shipped (main, 2026-12-04) at one rank: the residual-only fused boundary writes R' = bf16(post * y + sum_k comb[k, j] * R[k]), then the
coefficients kernel's own-pre variant reads R' back, projects it (partials) and a finish kernel (one CTA per row) sums
the partials, runs Sinkhorn and writes the layer input collapsed with that pre: three launches from 2 rows, two at 1.

Here the first launch is the projection's partials grid (about 128 CTAs, each a K slice of every row) computing the
A-fragment words of R' itself, from y, R and the carried post / comb of its columns, storing them as R' and
multiplying them at once: the words the shipped partials kernel loads, so the same partial sums in the same order.
The second launch is the shipped finish kernel unchanged. So the outputs (R', post, comb, pre, the layer input and
its quantized form) must equal the shipped seam's bit for bit (the run prints the bytes that differ, per output); each stream's columns are read by the four K slices that make its 4 new
streams (4x the streams' reads, from L2 after the first).

    python -m bench.experiments.v4_post_partials [--hidden 4096 7168] [--rows 1 4 16] [--quant none mxfp8 ...]

What it decides: whether the V4 seam at <= 16 rows should take this form (the #47 target: <= 5 us).
Not shipped; W = 1 (no peers), a ready partial (no shared addend).
"""

from __future__ import annotations

import argparse
import functools
from typing import Any

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch
from cutlass import BFloat16, Float32, Int32, Int64, const_expr

from cute_kernels import ptx as prim
from cute_kernels.coefficients.api import _fake_quantized
from cute_kernels.coefficients.config import CLUSTER, HC, MIX, NV
from cute_kernels.coefficients.kernel import OWN, CoefficientsKernel
from cute_kernels.coefficients.layer_input import QUANT_FORMS
from cute_kernels.coefficients.tuning import SPLIT_P
from cute_kernels.compile import compile_kernel, fake_stream, fake_tensor


class PostPartialsKernel:
    """The V4 seam at one rank: the post and the projection's partials in one launch, then the own-pre finish."""

    def __init__(self, H: int, sinkhorn_repeat: int = 20, quant: str | None = None) -> None:
        self.H = H
        config = SPLIT_P.config(H, False)  # the shipped own-pre partials config at 2-40 rows: every config's bits
        assert not config.stage_rows
        self.base = CoefficientsKernel(
            H, variant="standard", layer_input=OWN, sinkhorn_repeat=sinkhorn_repeat, config=config, quant=quant
        )
        self.proj = self.base.projection
        self.epilogue = self.base.epilogue

    @cute.jit
    def __call__(
        self,
        mY: cute.Tensor,  # [T, H] bf16 partial (W = 1: the sublayer's output)
        mR: cute.Tensor,  # [T, 4, H] bf16 streams
        mPostIn: cute.Tensor,  # [T, 4] fp32 carried post
        mCombIn: cute.Tensor,  # [T, 4, 4] fp32 carried comb [src, dst]
        mNewR: cute.Tensor,  # [T, 4, H] bf16 new streams (out)
        mFn: cute.Tensor,  # [24, 4H] fp32
        mScale: cute.Tensor,  # [3] fp32
        mBase: cute.Tensor,  # [24] fp32
        mPost: cute.Tensor,  # [T, 4] fp32 next post (out)
        mComb: cute.Tensor,  # [T, 4, 4] fp32 next comb (out)
        mPre: cute.Tensor,  # [T, 4] fp32 pre (out)
        mRank: cute.Tensor,  # [>= 8G, >= T, 25] fp32 workspace
        mW: cute.Tensor,  # [H] bf16 norm weight
        mOut: cute.Tensor,  # [T, H] bf16 layer input (out)
        mQ: cute.Tensor | None,  # [T, H] e4m3 (with quant)
        mQScale: cute.Tensor | None,  # its scales (CONTRACT §4 / §4b layouts)
        rms_eps: Float32,
        pre_eps: Float32,
        sinkhorn_eps: Float32,
        post_mult: Float32,
        norm_eps: Float32,
        stream: cuda.CUstream,
    ):
        rows = mY.shape[0]
        self.post_kernel(mY, mR, mPostIn, mCombIn, mNewR, mFn, mRank).launch(
            grid=[CLUSTER, self.base.grid_clusters(rows), 1],
            block=[self.proj.threads, 1, 1],
            stream=stream,
            use_pdl=True,
        )
        finish = (mScale, mBase, mPost, mComb, mPre, mRank, rms_eps, pre_eps, sinkhorn_eps, post_mult)
        self.epilogue.own_finish_kernel(*finish, mNewR, mW, mOut, mQ, mQScale, norm_eps).launch(
            grid=[rows, 1, 1],
            block=[self.epilogue.finish_threads, 1, 1],
            stream=stream,
            use_pdl=True,
        )

    @cute.kernel
    def post_kernel(
        self,
        mY: cute.Tensor,
        mR: cute.Tensor,
        mPostIn: cute.Tensor,
        mCombIn: cute.Tensor,
        mNewR: cute.Tensor,
        mFn: cute.Tensor,
        mRank: cute.Tensor,
    ):
        """ProjectionRole.partials_cta (without staged rows) with the rows' words made here: post_rows."""
        proj = self.proj
        rank, cluster, _ = cute.arch.block_idx()
        smem = cutlass.memory.SmemAllocator()
        sum_words = const_expr(proj.warps * proj.batch_rows * NV)
        sSums = smem.allocate_tensor(Float32, cute.make_layout(proj.sum_buffers * sum_words), byte_alignment=16)
        warp, lane, split, tile, group, row0, tile_rows, col = proj.cta_coords(mR, rank, cluster)
        slot = group * CLUSTER + rank
        fn = proj.load_fn(mFn, col, lane)
        cute.arch.griddepcontrol_wait()
        words = self.post_rows(mY, mR, mPostIn, mCombIn, mNewR, row0, col, lane, split)
        hi, lo = proj.split_fn(fn)
        for b in cutlass.range_constexpr(proj.batches):
            batch_row0 = b * proj.batch_rows
            sWarp = cute.make_tensor(sSums.iterator + (b % proj.sum_buffers) * sum_words, cute.make_layout(sum_words))
            proj.project_batch(words, hi, lo, sWarp, tile_rows - batch_row0, warp, lane, split)
            if const_expr(b == proj.batches - 1):
                cute.arch.griddepcontrol_launch_dependents()
            cute.arch.sync_threads()
            rows_here = cutlass.max(cutlass.min(tile_rows - batch_row0, proj.batch_rows), 0)
            proj.store_sums(sWarp, mRank, slot, row0 + batch_row0, rows_here)
            if const_expr(b < proj.batches - 1):
                words = self.post_rows(
                    mY, mR, mPostIn, mCombIn, mNewR, row0 + batch_row0 + proj.batch_rows, col, lane, split
                )
                if const_expr(proj.sum_buffers == 1):
                    cute.arch.sync_threads()

    @cute.jit
    def post_rows(
        self,
        mY: cute.Tensor,
        mR: cute.Tensor,
        mPostIn: cute.Tensor,
        mCombIn: cute.Tensor,
        mNewR: cute.Tensor,
        batch_row: Int32,
        col: Int32,
        lane: Int32,
        split,
    ) -> list:
        """load_rows' words of R' (this lane's 8 columns of stream j = col // H, rows g and g + 8 of each m-tile),
        made from y, R and the carried mixes with the boundary's operations in its order, and stored as R' (rows
        past the end make the last row's words, unstored)."""
        proj = self.proj
        H = const_expr(self.H)
        rows = mY.shape[0]
        j = col // H
        c = col - j * H
        out = []
        for i in cutlass.range_constexpr(proj.mtiles_per_warp):
            halves = []
            for half in cutlass.range_constexpr(2):
                mt = split * proj.mtiles_per_warp + i
                r = batch_row + mt * 16 + half * 8 + lane // 4
                row = cutlass.min(r, rows - 1)
                y = prim.ld_v4_i32(mY.iterator + (row * H + c))
                streams = [prim.ld_v4_i32(mR.iterator + (row * (HC * H) + k * H + c)) for k in range(HC)]
                post = mPostIn[row, j]
                comb = [mCombIn[row, k, j] for k in range(HC)]
                words = []
                for p in cutlass.range_constexpr(4):
                    pair = []
                    for h in cutlass.range_constexpr(2):
                        unpack = prim.bf16_lo if h == 0 else prim.bf16_hi
                        # EpilogueRole.compute_row's order and roundings: post*y, then + comb[k,j]*R[k], k in order.
                        acc = prim.mul_rn(post, unpack(cutlass.Uint32(y[p])))
                        for k in cutlass.range_constexpr(HC):
                            acc = prim.mul_add_rn(comb[k], unpack(cutlass.Uint32(streams[k][p])), acc)
                        pair.append(acc)
                    words.append(prim.cvt_bf16x2(pair[0], pair[1]))
                if r < rows:
                    addr = mNewR.iterator.toint() + Int64(row * (HC * H) + j * H + c) * 2
                    prim.st_global_v4_b32(addr, words[0], words[1], words[2], words[3])
                halves.append(tuple(Int32(w) for w in words))
            out.append(halves)
        return out


@functools.cache
def compile_post_partials(H: int, sinkhorn_repeat: int = 20, quant: str | None = None, arch: str = "sm_90a") -> Any:
    """The compiled experiment kernel at hidden size H with the quantized form `quant` (None: bf16 alone); the row
    count and the workspace stay dynamic."""
    kernel = PostPartialsKernel(H, sinkhorn_repeat, quant)
    T = cute.sym_int()
    q, q_scale = _fake_quantized(H, quant, T)
    f32 = lambda shape, d=1: fake_tensor(Float32, shape, divisibility=d)  # noqa: E731
    args = (
        fake_tensor(BFloat16, (T, H), divisibility=8),
        fake_tensor(BFloat16, (T, HC, H), divisibility=8),
        f32((T, HC)),
        f32((T, HC, HC)),
        fake_tensor(BFloat16, (T, HC, H), divisibility=8),
        f32((MIX, HC * H), 4),
        f32((3,)),
        f32((MIX,)),
        f32((T, HC)),
        f32((T, HC, HC)),
        f32((T, HC)),
        f32((cute.sym_int(), cute.sym_int(), NV)),
        fake_tensor(BFloat16, (H,), divisibility=8),
        fake_tensor(BFloat16, (T, H), divisibility=8),
        q,
        q_scale,
        Float32(0.0),
        Float32(0.0),
        Float32(0.0),
        Float32(0.0),
        Float32(0.0),
    )
    return compile_kernel(kernel, *args, fake_stream(), arch=arch)


def measure(timer: Any, hidden: int, rows: int, quant: str | None) -> dict[str, Any]:
    """Bit equality with the shipped seam on every input set, then GPU us per call of both (same graph method);
    `quant`: the quantized layer input beside bf16 (a `quantize=` name, or None)."""
    from bench.kernels import CALLS_PER_GRAPH
    from bench.v4 import _inputs
    from boundary import BoundaryAllReduce, V4Boundaries, mhc
    from boundary.params import MHCParams
    from boundary.toy import ToyConfig, ToyModel
    from boundary.types import empty_layer_input_form
    from cute_kernels.coefficients.api import CoefficientsWorkspace

    device = timer.device
    model = ToyModel(ToyConfig(hidden_size=hidden, num_layers=1, vocab=16), device=device)
    layer = model.layers[0]
    b = V4Boundaries(BoundaryAllReduce(hidden, max_rows=rows, device=device))
    b.warmup(rows, quantize=() if quant is None else (quant,), progress=False)
    sets = [_inputs(rows, hidden, device, seed) for seed in range(CALLS_PER_GRAPH)]
    compiled = compile_post_partials(hidden, layer.hc_sinkhorn_iters, quant)
    weight, eps = layer.attn_norm.weight, layer.attn_norm.variance_epsilon

    def ours(inp: dict[str, Any]):
        ws = CoefficientsWorkspace(hidden, rows, device)
        f32 = lambda *shape: torch.empty(*shape, dtype=torch.float32, device=device)  # noqa: E731
        outs = dict(
            residual=torch.empty_like(inp["residual"]),
            post=f32(rows, HC),
            comb=f32(rows, HC, HC),
            pre=f32(rows, HC),
            layer_input=torch.empty(rows, hidden, dtype=torch.bfloat16, device=device),
        )
        q = empty_layer_input_form(quant, rows, hidden, device)
        if q is not None:
            outs["q_data"], outs["q_scale"] = q.data, q.scale
        inp["mine"] = outs

        def call() -> None:
            compiled(
                inp["y"],
                inp["residual"],
                inp["post"],
                inp["comb"],
                outs["residual"],
                layer.hc_attn_fn,
                layer.hc_attn_scale,
                layer.hc_attn_base,
                outs["post"],
                outs["comb"],
                outs["pre"],
                ws.rank_partials,
                weight,
                outs["layer_input"],
                outs.get("q_data"),
                outs.get("q_scale"),
                float(layer.rms_norm_eps),
                float(layer.hc_eps),
                float(layer.hc_eps),
                float(layer.hc_post_alpha),
                float(eps),
            )

        return call

    params = MHCParams(
        layer.hc_attn_fn,
        layer.hc_attn_scale,
        layer.hc_attn_base,
        layer.rms_norm_eps,
        layer.hc_eps,
        layer.hc_eps,
        layer.hc_post_alpha,
        layer.hc_sinkhorn_iters,
    )

    def three_launches(inp: dict[str, Any]):
        """The three-launch seam: the residual-only fused boundary, then the own-pre coefficients (one launch at 1 row,
        two from 2): V4Boundaries.sublayer's launches before the seam, without its host checks (a graph drops them)."""
        q = empty_layer_input_form(quant, rows, hidden, device)

        def call() -> None:
            new = mhc.mhc_post(inp["y"], inp["residual"], inp["post"], inp["comb"])
            inp["outputs"] = (new, *mhc.own_pre(new, params, weight, eps, quantized_out=q), q)

        return call

    shipped_calls = [three_launches(s) for s in sets]
    our_calls = [ours(s) for s in sets]
    for shipped, mine in zip(shipped_calls, our_calls):
        shipped()
        mine()
    torch.cuda.synchronize()
    differ = {}
    for inp in sets:
        new, post, comb, pre, layer_input, quantized = inp["outputs"]
        got = inp["mine"]
        want = dict(residual=new, post=post, comb=comb, pre=pre, layer_input=layer_input)
        if quantized is not None:
            want["q_data"], want["q_scale"] = quantized.data, quantized.scale
        for name, ref in want.items():
            a, b_ = got[name].reshape(-1).view(torch.uint8), ref.reshape(-1).view(torch.uint8)
            differ[name] = differ.get(name, 0) + int((a != b_).sum())  # bytes that differ
    return {
        "shipped": timer.per_call_us(shipped_calls),
        "post-partials": timer.per_call_us(our_calls),
        "differ": differ,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, nargs="+", default=[4096, 7168])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument(
        "--quant", nargs="+", default=["none"], choices=["none", *QUANT_FORMS], help="layer-input forms beside bf16"
    )
    ap.add_argument("--replays", type=int, default=7)
    ap.add_argument("--compile-only", action="store_true", help="compile for sm_90a and stop (no GPU needed)")
    args = ap.parse_args(argv)
    forms = [None if q == "none" else q for q in args.quant]
    if args.compile_only:
        for hidden in args.hidden:
            for quant in forms:
                compile_post_partials(hidden, quant=quant)
                print(f"compiled H={hidden} quant={quant}", flush=True)
        return
    from bench.timing import GraphTimer

    timer = GraphTimer(torch.device("cuda"), replays=args.replays)
    print(f"{'H':>5} {'rows':>4} {'quant':>15} | {'shipped':>8} {'post-partials':>13} | bytes that differ per output")
    for hidden in args.hidden:
        for quant in forms:
            for rows in args.rows:
                r = measure(timer, hidden, rows, quant)
                differ = " ".join(f"{name} {n}" for name, n in r["differ"].items())
                print(
                    f"{hidden:>5} {rows:>4} {quant or 'bf16':>15} | {r['shipped']:8.2f} {r['post-partials']:13.2f} | "
                    f"{differ}",
                    flush=True,
                )
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
