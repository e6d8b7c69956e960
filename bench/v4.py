"""The DeepSeek-V4 boundary (#47): `V4Boundaries.sublayer` (the post with the carried mixes, the mixes of the new
streams, the own-pre collapse and norm) per call, with its FP8 1x128 form, against the torch chain eager and compiled
and the copy-bandwidth floor, per (H, rows); GPU time as the other parts (bench/timing.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from tqdm import tqdm

from bench import chains, tilelang_step
from bench.kernels import CALLS_PER_GRAPH
from bench.timing import GraphTimer
from boundary import BoundaryAllReduce, BoundaryState, DecodeStep, V4Boundaries
from boundary.toy import ToyConfig, ToyLayer, ToyModel, ToyNorm


def v4_bytes(rows: int, hidden: int) -> int:
    """The fewest bytes a V4 boundary moves: the partial, the streams in and out, the layer input, fn once."""
    return rows * hidden * 2 * (1 + 4 + 4 + 1) + 24 * 4 * hidden * 4


def _inputs(rows: int, hidden: int, device: torch.device, seed: int) -> dict[str, torch.Tensor]:
    """One input set: a pending partial y and the streams with their carried mixes."""
    g = torch.Generator(device=device).manual_seed(seed)
    return dict(
        y=torch.randn(rows, hidden, generator=g, device=device).to(torch.bfloat16),
        residual=torch.randn(rows, 4, hidden, generator=g, device=device).to(torch.bfloat16),
        post=torch.rand(rows, 4, generator=g, device=device) * 2,
        comb=torch.softmax(torch.randn(rows, 4, 4, generator=g, device=device), -1),
    )


def own_weights(layer: ToyLayer, model: ToyModel, count: int) -> list[tuple[ToyLayer, SimpleNamespace]]:
    """`count` (layer, head) pairs, each with its own mHC weights drawn as the toy draws them: the sublayer's fn, scale,
    base and norm, and hc_head's with the final norm. Each call of a timed graph takes one, so that its weights come
    from HBM after the L2 flush, as a step's layers' do (TileLang's chain and the coefficients table are timed so too)."""
    hidden = model.config.hidden_size
    g = torch.Generator(device=model.device).manual_seed(12345)

    def randn(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device=model.device) * std

    def norm(eps: float) -> ToyNorm:
        return ToyNorm((1 + randn(hidden, std=0.1)).to(torch.bfloat16), eps)

    out = []
    for _ in range(count):
        own = dataclasses.replace(
            layer,
            hc_attn_fn=randn(24, 4 * hidden, std=0.01),
            hc_attn_scale=0.5 + randn(3, std=0.05),
            hc_attn_base=randn(24, std=0.5),
            attn_norm=norm(layer.attn_norm.variance_epsilon),
        )
        head = SimpleNamespace(
            hc_head_fn=randn(4, 4 * hidden, std=0.01),
            hc_head_scale=0.5 + randn(1, std=0.05),
            hc_head_base=randn(4, std=0.5),
            rms_norm_eps=model.rms_norm_eps,
            hc_eps=model.hc_eps,
            final_norm=norm(model.final_norm.variance_epsilon),
        )
        out.append((own, head))
    return out


def _ours(b: V4Boundaries, layer: Any, inp: dict[str, Any], step: DecodeStep, quantize: str | bool):
    """A closure making one V4 boundary call on an input set (its outputs kept until the set's next call)."""

    def call() -> None:
        inp["outputs"] = None
        state = BoundaryState(inp["residual"], inp["post"], inp["comb"], None, pending=inp["y"])  # type: ignore[arg-type]
        inp["outputs"] = b.sublayer(layer, False, state, step, quantize=quantize)

    return call


def _final(b: V4Boundaries, head: Any, inp: dict[str, Any]):
    """A closure making one V4 final call (the post, hc_head, the final norm) on an input set; `head` holds hc_head's
    weights and the final norm (a ToyModel, or one of own_weights')."""

    def call() -> None:
        inp["outputs"] = None
        state = BoundaryState(inp["residual"], inp["post"], inp["comb"], None, pending=inp["y"])  # type: ignore[arg-type]
        inp["outputs"] = b.final(state, head, head.final_norm)

    return call


def _chain(fn: Any, layer: Any, inp: dict[str, Any]):
    """A closure running the torch chain on an input set."""
    args = (inp["y"], inp["residual"], inp["post"], inp["comb"], layer.hc_attn_fn, layer.hc_attn_scale)
    return lambda: fn(*args, layer.hc_attn_base, layer.attn_norm.weight, layer.attn_norm.variance_epsilon)


def measured_tilelang(folder: Path) -> tuple[dict[tuple[int, int], float], list[dict[str, Any]]]:
    """tilelang_rows' answer from a run before (`--tilelang-v4`): its tilelang-v4.json and, if there, parity.pt."""
    rows = json.loads((folder / "tilelang-v4.json").read_text())["rows"]
    cases = folder / "parity.pt"
    parity = torch.load(cases) if cases.exists() else []
    return {(r["H"], r["rows"]): r["tilelang_us"] for r in rows if "tilelang_us" in r}, parity


def tilelang_rows(args: argparse.Namespace) -> tuple[dict[tuple[int, int], float], list[dict[str, Any]]]:
    """DeepSeek's TileLang V4 chain per (H, rows), us per call, and one boundary's inputs and outputs per shape (the
    parity cases), from bench.tilelang_step --boundary in a process of its own (its tvm-ffi differs from CuTe DSL's),
    with `args.tilelang_path` first on its path (or read from `args.tilelang_v4`); raises with its output if it
    measures nothing."""
    if args.tilelang_v4 is not None:
        return measured_tilelang(args.tilelang_v4)
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(args.tilelang_path), str(root)]))
    with tempfile.TemporaryDirectory() as tmp:
        out, cases = Path(tmp) / "tilelang-v4.json", Path(tmp) / "parity.pt"  # measured_tilelang's names
        command = [sys.executable, "-m", "bench.tilelang_step", "--boundary", "--out", str(out), "--parity", str(cases)]
        command += ["--step-hidden", *map(str, args.hidden), "--step-rows", *map(str, args.rows)]
        command += ["--replays", str(args.replays)]
        print(f"TileLang V4 chain: its own process, tile_kernels from {args.tilelang_path}", flush=True)
        done = subprocess.run(command, env=env, cwd=root, stdout=subprocess.PIPE, text=True)
        if done.returncode != 0 or not out.exists():
            raise RuntimeError(
                f"bench.tilelang_step --boundary failed (exit {done.returncode}):\n{done.stdout[-3000:]}"
            )
        return measured_tilelang(Path(tmp))


def float64_chain(inp: dict[str, torch.Tensor], eps: dict[str, float]) -> tuple[torch.Tensor, torch.Tensor]:
    """A parity case's V4 boundary in float64, rounded nowhere: R' and the layer input."""
    y, r = inp["x"][0].double(), inp["residual"][0].double()
    post, comb = inp["post"][0, :, :, 0].double(), inp["comb"][0].double()
    new = post[:, :, None] * y[:, None] + torch.einsum("tkj,tkh->tjh", comb, r)
    x = new.flatten(1)
    mixes = (x @ inp["fn"].double().t()) / torch.sqrt((x * x).mean(-1, keepdim=True) + eps["rms_eps"])
    pre = torch.sigmoid(mixes[:, :4] * float(inp["scale"][0]) + inp["base"][:4].double()) + eps["mhc_pre_eps"]
    c = (pre[:, :, None] * new).sum(1)
    return new, c / torch.sqrt((c * c).mean(-1, keepdim=True) + eps["rms_eps"]) * inp["norm_weight"].double()


def parity(case: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """Ours on a parity case's inputs against TileLang's outputs: the bf16 words that differ, and each one's largest
    error against the float64 value, relative to that value's largest magnitude."""
    eps, rows, hidden = case["eps"], case["rows"], case["H"]
    on = tilelang_step.parity_inputs(case, device)
    inp = {k: v.cpu() for k, v in on.items()}
    norm = SimpleNamespace(weight=on["norm_weight"], variance_epsilon=eps["rms_eps"])
    layer = SimpleNamespace(
        hc_mult=4,
        hc_attn_fn=on["fn"],
        hc_attn_scale=on["scale"],
        hc_attn_base=on["base"],
        attn_norm=norm,
        rms_norm_eps=eps["rms_eps"],
        hc_eps=eps["mhc_pre_eps"],
        hc_post_alpha=eps["mhc_post_mult_value"],
        hc_sinkhorn_iters=eps["sinkhorn_repeat"],
    )
    post = on["post"][0, :, :, 0].contiguous()
    state = BoundaryState(on["residual"][0].contiguous(), post, on["comb"][0].contiguous(), None, pending=on["x"][0])  # type: ignore[arg-type]
    b = V4Boundaries(BoundaryAllReduce(hidden, max_rows=rows, device=device))
    ours, layer_input, _ = b.sublayer(layer, False, state, DecodeStep(rows=rows, side_stream=False))
    new64, out64 = float64_chain(inp, eps)
    theirs = case["outputs"]

    def err(got: torch.Tensor, exact: torch.Tensor) -> float:
        return float((got.cpu().double() - exact).abs().max() / exact.abs().max())

    def differ(a: torch.Tensor, b: torch.Tensor) -> int:
        return int((a.cpu().view(torch.int16) != b.cpu().view(torch.int16)).sum())

    return {
        "parity_words": rows * hidden,
        "residual_words_differ": differ(ours.residual, theirs["new_residual"][0]),
        "layer_input_words_differ": differ(layer_input, theirs["layer_input"]),
        "ours_residual_err": err(ours.residual, new64),
        "tilelang_residual_err": err(theirs["new_residual"][0], new64),
        "ours_layer_input_err": err(layer_input, out64),
        "tilelang_layer_input_err": err(theirs["layer_input"], out64),
    }


def bench_v4(args: argparse.Namespace, timer: GraphTimer, copy_bw: float) -> list[dict]:
    """µs per V4 boundary call against DeepSeek's TileLang chain (with --tilelang-path), the eager and compiled
    chains and the floor, per (H, rows)."""
    device = timer.device
    measured = args.tilelang_path is not None or args.tilelang_v4 is not None
    tilelang, cases = tilelang_rows(args) if measured else ({}, [])
    parities = {(c["H"], c["rows"]): parity(c, device) for c in cases}
    compiled_chain = None if args.no_compile else chains.compiled(chains.v4_chain)
    out = []
    for hidden, rows in tqdm(
        [(h, r) for h in args.hidden for r in sorted(args.rows)], desc="V4 boundary", unit="shape"
    ):
        model = ToyModel(ToyConfig(hidden_size=hidden, num_layers=1, vocab=16), device=device)
        b = V4Boundaries(BoundaryAllReduce(hidden, max_rows=rows, device=device))
        step = DecodeStep(rows=rows, side_stream=False)
        sets = [_inputs(rows, hidden, device, seed) for seed in range(CALLS_PER_GRAPH)]
        # Each call its own weights (cold after the L2 flush, as TileLang's chain is timed).
        pairs = list(zip(own_weights(model.layers[0], model, len(sets)), sets, strict=True))
        row: dict[str, Any] = {"H": hidden, "rows": rows}
        row["ours_us"] = timer.per_call_us([_ours(b, w, s, step, False) for (w, _), s in pairs])
        row["ours_mxfp8_us"] = timer.per_call_us([_ours(b, w, s, step, "mxfp8") for (w, _), s in pairs])
        row["ours_fp8_1x128_us"] = timer.per_call_us([_ours(b, w, s, step, "fp8_1x128") for (w, _), s in pairs])
        row["final_us"] = timer.per_call_us([_final(b, head, s) for (_, head), s in pairs])
        # One layer's weights for every call (L2-warm after the first): the table's method before 2026-12-05.
        row["ours_warm_us"] = timer.per_call_us([_ours(b, model.layers[0], s, step, False) for s in sets])
        row["eager_us"] = timer.per_call_us([_chain(chains.v4_chain, w, s) for (w, _), s in pairs])
        if compiled_chain is not None:
            row["compile_us"] = timer.per_call_us([_chain(compiled_chain, w, s) for (w, _), s in pairs])
            row["x_compile"] = row["compile_us"] / row["ours_us"]
        row["x_eager"] = row["eager_us"] / row["ours_us"]
        if (hidden, rows) in tilelang:
            row["tilelang_us"] = tilelang[hidden, rows]
            row["x_tilelang"] = row["tilelang_us"] / row["ours_us"]
        row |= parities.get((hidden, rows), {})
        row["floor_us"] = v4_bytes(rows, hidden) / copy_bw * 1e6
        row["x_floor"] = row["ours_us"] / row["floor_us"]
        out.append(row)
        del sets, pairs
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def print_v4(rows: list[dict]) -> None:
    """The V4 boundary table."""
    nan = float("nan")
    print("\nDeepSeek-V4 boundary (V4Boundaries.sublayer: post, mixes of R', own-pre collapse, norm), GPU us per call")
    head = (
        f"{'H':>5} {'rows':>4} | {'ours':>7} {'warm':>6} {'+mxfp8':>7} {'+fp8':>7} {'final':>6} | {'TileLang':>8} "
        f"{'eager':>8} {'compile':>8} | "
        f"{'x TL':>5} {'x eager':>7} {'x comp':>6} | {'floor':>6} {'x floor':>7}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r['H']:>5} {r['rows']:>4} | {r['ours_us']:7.2f} {r.get('ours_warm_us', nan):6.2f} "
            f"{r['ours_mxfp8_us'] - r['ours_us']:+7.2f} "
            f"{r['ours_fp8_1x128_us'] - r['ours_us']:+7.2f} {r['final_us']:6.2f} | "
            f"{r.get('tilelang_us', nan):8.2f} {r['eager_us']:8.1f} {r.get('compile_us', nan):8.1f} | "
            f"{r.get('x_tilelang', nan):5.1f} {r['x_eager']:7.1f} {r.get('x_compile', nan):6.1f} "
            f"| {r['floor_us']:6.2f} {r['x_floor']:7.2f}"
        )
    print(
        "every call reads its own layer's weights (from HBM after the L2 flush, as TileLang's chain does); "
        "ours: the residual-only fused boundary, then the coefficients kernel's own-pre variant (the mixes of R' and "
        "the layer input collapsed with their pre by the CTAs that finish the rows: one launch at 1 row, the partials "
        "schedule's two from 2 rows); warm: ours with one layer's weights for every call (L2-warm after the first; "
        "the method before 2026-12-05); +mxfp8 / +fp8: the MXFP8 / FP8 1x128 form beside bf16 (written by those CTAs); "
        "final: V4Boundaries.final (up to 512 x 4096 elements one fused boundary that computes hc_head's weights from "
        "its new streams, then the collapse and the final norm; beyond, the residual-only boundary and one "
        "coefficients call); TileLang: "
        "DeepSeek's mhc_post_fwd + TF32 projection + mhc_pre_big_fuse_fwd + RMSNorm (bench.tilelang_step --boundary, "
        "its own process; with --tilelang-path); eager / "
        "compile: the same boundary as torch ops (bench.chains.v4_chain; compiled once with dynamic shapes); floor: "
        "partial, streams in and out, layer input and fn at copy bandwidth"
    )
    parity_rows = [r for r in rows if "parity_words" in r]
    if not parity_rows:
        return
    print("\nV4 parity with TileLang's chain on the same inputs: bf16 words that differ; largest error against float64")
    head = f"{'H':>5} {'rows':>4} | {'R diff':>8} {'x diff':>8} | {'R ours':>8} {'R TL':>8} | {'x ours':>8} {'x TL':>8}"
    print(head)
    print("-" * len(head))
    for r in parity_rows:
        words = r["parity_words"]
        print(
            f"{r['H']:>5} {r['rows']:>4} | {r['residual_words_differ'] / (4 * words):8.2%} "
            f"{r['layer_input_words_differ'] / words:8.2%} | {r['ours_residual_err']:8.1e} "
            f"{r['tilelang_residual_err']:8.1e} | {r['ours_layer_input_err']:8.1e} {r['tilelang_layer_input_err']:8.1e}"
        )
    print(
        "R: the new streams, x: the layer input; diff: the share of bf16 words that differ; ours / TL: max |value - "
        "float64| over max |float64| (TileLang's projection is TF32)"
    )
