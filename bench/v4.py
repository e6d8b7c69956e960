"""The DeepSeek-V4 boundary (#47): `V4Boundaries.sublayer` (the post with the carried mixes, the mixes of the new
streams, the own-pre collapse and norm) per call, with its FP8 1x128 form, against the torch chain eager and compiled
and the copy-bandwidth floor, per (H, rows); GPU time as the other parts (bench/timing.py).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from bench import chains
from bench.kernels import CALLS_PER_GRAPH
from bench.timing import GraphTimer
from boundary import BoundaryAllReduce, BoundaryState, DecodeStep, V4Boundaries
from boundary.toy import ToyConfig, ToyModel


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


def _ours(b: V4Boundaries, layer: Any, inp: dict[str, Any], step: DecodeStep, quantize: str | bool):
    """A closure making one V4 boundary call on an input set (its outputs kept until the set's next call)."""

    def call() -> None:
        inp["outputs"] = None
        state = BoundaryState(inp["residual"], inp["post"], inp["comb"], None, pending=inp["y"])  # type: ignore[arg-type]
        inp["outputs"] = b.sublayer(layer, False, state, step, quantize=quantize)

    return call


def _chain(fn: Any, layer: Any, inp: dict[str, Any]):
    """A closure running the torch chain on an input set."""
    args = (inp["y"], inp["residual"], inp["post"], inp["comb"], layer.hc_attn_fn, layer.hc_attn_scale)
    return lambda: fn(*args, layer.hc_attn_base, layer.attn_norm.weight, layer.attn_norm.variance_epsilon)


def tilelang_rows(args: argparse.Namespace) -> dict[tuple[int, int], float]:
    """DeepSeek's TileLang V4 chain per (H, rows), us per call, from bench.tilelang_step --boundary in a process of
    its own (its tvm-ffi differs from CuTe DSL's), with `args.tilelang_path` first on its path; raises with its
    output if it measures nothing."""
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(args.tilelang_path), str(root)]))
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "tilelang-v4.json"
        command = [sys.executable, "-m", "bench.tilelang_step", "--boundary", "--out", str(out)]
        command += ["--step-hidden", *map(str, args.hidden), "--step-rows", *map(str, args.rows)]
        command += ["--replays", str(args.replays)]
        print(f"TileLang V4 chain: its own process, tile_kernels from {args.tilelang_path}", flush=True)
        done = subprocess.run(command, env=env, cwd=root, stdout=subprocess.PIPE, text=True)
        if done.returncode != 0 or not out.exists():
            raise RuntimeError(
                f"bench.tilelang_step --boundary failed (exit {done.returncode}):\n{done.stdout[-3000:]}"
            )
        rows = json.loads(out.read_text())["rows"]
    return {(r["H"], r["rows"]): r["tilelang_us"] for r in rows if "tilelang_us" in r}


def bench_v4(args: argparse.Namespace, timer: GraphTimer, copy_bw: float) -> list[dict]:
    """µs per V4 boundary call against DeepSeek's TileLang chain (with --tilelang-path), the eager and compiled
    chains and the floor, per (H, rows)."""
    device = timer.device
    tilelang = tilelang_rows(args) if getattr(args, "tilelang_path", None) is not None else {}
    compiled_chain = None if args.no_compile else chains.compiled(chains.v4_chain)
    out = []
    for hidden, rows in tqdm(
        [(h, r) for h in args.hidden for r in sorted(args.rows)], desc="V4 boundary", unit="shape"
    ):
        layer = ToyModel(ToyConfig(hidden_size=hidden, num_layers=1, vocab=16), device=device).layers[0]
        b = V4Boundaries(BoundaryAllReduce(hidden, max_rows=rows, device=device))
        step = DecodeStep(rows=rows, side_stream=False)
        sets = [_inputs(rows, hidden, device, seed) for seed in range(CALLS_PER_GRAPH)]
        row: dict[str, Any] = {"H": hidden, "rows": rows}
        row["ours_us"] = timer.per_call_us([_ours(b, layer, s, step, False) for s in sets])
        row["ours_fp8_1x128_us"] = timer.per_call_us([_ours(b, layer, s, step, "fp8_1x128") for s in sets])
        row["eager_us"] = timer.per_call_us([_chain(chains.v4_chain, layer, s) for s in sets])
        if compiled_chain is not None:
            row["compile_us"] = timer.per_call_us([_chain(compiled_chain, layer, s) for s in sets])
            row["x_compile"] = row["compile_us"] / row["ours_us"]
        row["x_eager"] = row["eager_us"] / row["ours_us"]
        if (hidden, rows) in tilelang:
            row["tilelang_us"] = tilelang[hidden, rows]
            row["x_tilelang"] = row["tilelang_us"] / row["ours_us"]
        row["floor_us"] = v4_bytes(rows, hidden) / copy_bw * 1e6
        row["x_floor"] = row["ours_us"] / row["floor_us"]
        out.append(row)
        del sets
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def print_v4(rows: list[dict]) -> None:
    """The V4 boundary table."""
    nan = float("nan")
    print("\nDeepSeek-V4 boundary (V4Boundaries.sublayer: post, mixes of R', own-pre collapse, norm), GPU us per call")
    head = (
        f"{'H':>5} {'rows':>4} | {'ours':>7} {'+fp8':>7} | {'TileLang':>8} {'eager':>8} {'compile':>8} | "
        f"{'x TL':>5} {'x eager':>7} {'x comp':>6} | {'floor':>6} {'x floor':>7}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r['H']:>5} {r['rows']:>4} | {r['ours_us']:7.2f} {r['ours_fp8_1x128_us'] - r['ours_us']:+7.2f} | "
            f"{r.get('tilelang_us', nan):8.2f} {r['eager_us']:8.1f} {r.get('compile_us', nan):8.1f} | "
            f"{r.get('x_tilelang', nan):5.1f} {r['x_eager']:7.1f} {r.get('x_compile', nan):6.1f} "
            f"| {r['floor_us']:6.2f} {r['x_floor']:7.2f}"
        )
    print(
        "ours: the residual-only fused boundary, the coefficients of R' and the layer-input kernel (three kernels; the "
        "two-launch fused V4 kernel is not built); +fp8: the FP8 1x128 form beside bf16 (torch ops today); TileLang: "
        "DeepSeek's mhc_post_fwd + TF32 projection + mhc_pre_big_fuse_fwd + RMSNorm (bench.tilelang_step --boundary, "
        "its own process; with --tilelang-path); eager / "
        "compile: the same boundary as torch ops (bench.chains.v4_chain; compiled once with dynamic shapes); floor: "
        "partial, streams in and out, layer input and fn at copy bandwidth"
    )
