"""The GPU benchmark: the fused kernels against the unfused chains and the copy bandwidth, one run.

Writes a table to stdout and `bench/results/<gpu>-<date>.json` plus PNG plots of microseconds
against rows. GPU time is a CUDA graph of back-to-back calls on rotating inputs after an L2
flush, median of replays, per call (see bench/timing.py).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from bench import chains
from bench.timing import GraphTimer, host_us_per_call
from boundary import BoundaryAllReduce, Fp8GroupActivation, QuantizedActivation, reference
from boundary.reference import FP8_GROUP, fp8_group_scale_rows, mxfp8_scale_bytes
from boundary.types import FP8_GROUP_QUANT_KEY, MXFP8_QUANT_KEY
from cute_kernels import coefficients as ck
from cute_kernels.boundary import api as boundary_api

CALLS_PER_GRAPH = 20
RESULTS = Path(__file__).resolve().parent / "results"


# What `make bench` measures by default (a few minutes on a fresh H200, compiles included) and what --full adds: every
# part is in both; --full widens the shapes. An option given on the command line wins over either.
DEFAULTS = dict(
    hidden=[4096, 7168],
    rows=[1, 16, 128, 512],
    world=[2, 4, 8],
    step_rows=[1, 16, 128],
    step_hidden=[7168],
    step_tp=[1, 2],
    step_compile_rows=[1, 16],
    step_compile_tp=[1],
)
FULL = dict(
    hidden=[4096, 5120, 7168],
    rows=[1, 4, 16, 64, 128, 256, 512],
    world=[2, 4, 8],
    step_rows=[1, 4, 16, 64, 128, 512],
    step_hidden=[5120, 7168],
    step_tp=[1, 2, 4, 8],
    step_compile_rows=None,  # every step row
    step_compile_tp=None,  # every step TP
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The benchmark's command line."""
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    p.add_argument(
        "--full",
        action="store_true",
        help="the full sweep (3 H x 7 row counts, the step at 6 row counts, H 5120 and 7168, TP 1-8, the compile "
        "baseline at every step shape): about 20-30 minutes on an H200, most of it torch.compile; the default is a few "
        "representative shapes of every part",
    )
    p.add_argument("--hidden", type=int, nargs="+", help=f"default {DEFAULTS['hidden']}, --full {FULL['hidden']}")
    p.add_argument("--rows", type=int, nargs="+", help=f"default {DEFAULTS['rows']}, --full {FULL['rows']}")
    p.add_argument(
        "--parts",
        nargs="+",
        default=["boundary", "host", "allreduce", "coefficients", "step"],
        choices=["boundary", "host", "allreduce", "coefficients", "step"],
        help="what to measure",
    )
    p.add_argument("--world", type=int, nargs="+", help="world sizes of the allreduce part")
    p.add_argument(
        "--step-rows", type=int, nargs="+", help=f"default {DEFAULTS['step_rows']}, --full {FULL['step_rows']}"
    )
    p.add_argument(
        "--step-hidden",
        type=int,
        nargs="+",
        help=f"hidden sizes of the decode step: default {DEFAULTS['step_hidden']}, --full {FULL['step_hidden']}",
    )
    p.add_argument("--step-layers", type=int, default=4, help="layers of the toy decode step (Engram on layer 1)")
    p.add_argument(
        "--tilelang-json",
        type=Path,
        help="the TileLang step baseline's rows (python -m bench.tilelang_step, run in its own process): a step column",
    )
    p.add_argument(
        "--tilelang-path",
        type=Path,
        default=os.environ.get("MHC_TILELANG_PATH") or None,
        help="a folder holding tile_kernels and tilelang (e.g. the unpacked pack-tilelang bundle): the step part runs "
        "bench.tilelang_step there in its own process first and adds its column (default: $MHC_TILELANG_PATH)",
    )
    p.add_argument(
        "--step-tp",
        type=int,
        nargs="+",
        choices=[1, 2, 4, 8],
        help=f"TP sizes of the step: default {DEFAULTS['step_tp']}, --full {FULL['step_tp']}",
    )
    p.add_argument(
        "--step-compile-rows",
        type=int,
        nargs="+",
        help="the step rows whose static torch.compile baseline is measured (37-73 s of compile each on an H200): "
        f"default {DEFAULTS['step_compile_rows']}, --full every step row",
    )
    p.add_argument(
        "--step-compile-tp",
        type=int,
        nargs="+",
        help=f"the step TP sizes that get the compile baseline: default {DEFAULTS['step_compile_tp']}, --full every one",
    )
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile baselines")
    p.add_argument("--replays", type=int, default=7)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    for name, value in (FULL if args.full else DEFAULTS).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.step_compile_rows is None:
        args.step_compile_rows = list(args.step_rows)
    if args.step_compile_tp is None:
        args.step_compile_tp = list(args.step_tp)
    if args.tilelang_path is not None and args.tilelang_json is not None:
        p.error("give --tilelang-path (measure TileLang now) or --tilelang-json (rows measured before), not both")
    if args.tilelang_path is not None and not (args.tilelang_path / "tile_kernels").is_dir():
        p.error(f"--tilelang-path {args.tilelang_path} holds no tile_kernels package")
    return args


def boundary_inputs(rows: int, hidden: int, device: torch.device, seed: int) -> dict[str, torch.Tensor]:
    """One set of inputs and preallocated outputs for a W = 1 boundary."""
    g = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device=device)

    return dict(
        x=randn(rows, hidden).to(torch.bfloat16),
        residual=randn(rows, 4, hidden).to(torch.bfloat16),
        post=torch.rand(rows, 4, generator=g, device=device) * 2,
        comb=torch.softmax(randn(rows, 4, 4), -1),
        pre=torch.rand(rows, 4, generator=g, device=device),
        norm_weight=(1 + 0.1 * randn(hidden)).to(torch.bfloat16),
        new_residual=torch.empty(rows, 4, hidden, dtype=torch.bfloat16, device=device),
        out=torch.empty(rows, hidden, dtype=torch.bfloat16, device=device),
        mxfp8_data=torch.empty(rows, hidden, dtype=torch.float8_e4m3fn, device=device),
        mxfp8_scale=torch.empty(mxfp8_scale_bytes(rows, hidden), dtype=torch.uint8, device=device),
        fp8_data=torch.empty(rows, hidden, dtype=torch.float8_e4m3fn, device=device),
        fp8_scale=torch.empty(hidden // FP8_GROUP, fp8_group_scale_rows(rows), device=device),
    )


def quantized_bytes(rows: int, hidden: int, quant: str | None) -> int:
    """The bytes a layer-input form adds to a boundary: e4m3 data and its scales."""
    if quant is None:
        return 0
    if quant == "mxfp8":
        return rows * hidden + mxfp8_scale_bytes(rows, hidden)
    return rows * hidden + hidden // FP8_GROUP * fp8_group_scale_rows(rows) * 4


def boundary_bytes(rows: int, hidden: int, quant: str | None) -> int:
    """The fewest bytes a W = 1 boundary moves: partial, streams in and out, layer input (+ its `quant` form)."""
    n = rows * hidden
    return 2 * n + 8 * n + 8 * n + 2 * n + 2 * hidden + rows * (4 + 16 + 4) * 4 + quantized_bytes(rows, hidden, quant)


QUANTS = (None, "mxfp8", "fp8_1x128")  # the layer-input forms the boundary table times


def fused_call(inp: dict[str, torch.Tensor], arch: str, quant: str | None):
    """A closure running the fused kernel's entry (no host checks: those are the public API's) on one input set,
    writing the layer input in the form `quant` too (QUANTS)."""
    mx, fp8 = quant == "mxfp8", quant == "fp8_1x128"
    variant = boundary_api.BoundaryVariant("x", mxfp8=mx, fp8=quant if fp8 else None)

    def call() -> None:
        boundary_api.fused_boundary(
            variant,
            residual=inp["residual"],
            post=inp["post"],
            comb=inp["comb"],
            pre=inp["pre"],
            norm_weight=inp["norm_weight"],
            norm_eps=1e-20,
            x=inp["x"],
            new_residual=inp["new_residual"],
            out=inp["out"],
            mxfp8_data=inp["mxfp8_data"] if mx else None,
            mxfp8_scale=inp["mxfp8_scale"] if mx else None,
            fp8_data=inp["fp8_data"] if fp8 else None,
            fp8_scale=inp["fp8_scale"] if fp8 else None,
            arch=arch,
        )

    return call


def public_call(ar: BoundaryAllReduce, inp: dict[str, Any], quant: str | None):
    """A closure running the public BoundaryAllReduce call (what an engine calls) on one input set, writing the
    layer input in the form `quant` too. The call's outputs are kept in the set until the next call on it, so that
    the calls of one graph write memory of their own, as the kernel entry's preallocated outputs and a quantized
    form's buffers are: released at once, they would take the same memory call after call and be written hot in L2
    (at H 4096 x 512 rows 1.1 us less than the kernel entry, which made the quantized forms look dearer)."""
    shape = inp["x"].shape
    mx = QuantizedActivation(inp["mxfp8_data"], inp["mxfp8_scale"], torch.bfloat16, shape, MXFP8_QUANT_KEY)
    fp8 = Fp8GroupActivation(inp["fp8_data"], inp["fp8_scale"], torch.bfloat16, shape, FP8_GROUP_QUANT_KEY, False)
    args = (inp["x"], inp["residual"], inp["post"], inp["comb"], inp["pre"], inp["norm_weight"], 1e-20)

    def call() -> None:
        inp["public_outputs"] = None
        inp["public_outputs"] = ar(
            *args, mx if quant == "mxfp8" else None, fp8_out=fp8 if quant == "fp8_1x128" else None
        )

    return call


def post_only_then_norm_call(ar: BoundaryAllReduce, inp: dict[str, Any]):
    """A closure running what `Boundaries.final` replaces (CONTRACT §4c): the residual-only boundary (public call),
    then the collapse and the final RMSNorm as torch ops."""

    def call() -> torch.Tensor:
        inp["chain_outputs"] = None  # kept until the set's next call, as public_call keeps its outputs
        new, _ = ar(inp["x"], inp["residual"], inp["post"], inp["comb"], None, None, 0.0, None)
        h = reference.rms_norm(reference.collapse(new, inp["pre"]), inp["norm_weight"], 1e-20)
        inp["chain_outputs"] = new, h
        return h

    return call


def chain_call(fn: Any, inp: dict[str, torch.Tensor]):
    """A closure running an unfused chain on one input set."""
    return lambda: fn(inp["x"], inp["residual"], inp["post"], inp["comb"], inp["pre"], inp["norm_weight"], 1e-20)


def bench_boundary(args: argparse.Namespace, arch: str, timer: GraphTimer, copy_bw: float) -> list[dict]:
    """The fused boundary against the eager and compiled chains, per (H, rows)."""
    device = timer.device
    compiled_chain = None if args.no_compile else chains.compiled(chains.boundary_chain)
    rows_list = sorted(args.rows)
    out = []
    shapes = [(h, r) for h in args.hidden for r in rows_list]
    for hidden, rows in tqdm(shapes, desc="boundary", unit="shape"):
        sets = [boundary_inputs(rows, hidden, device, seed) for seed in range(CALLS_PER_GRAPH)]
        row: dict[str, Any] = {"H": hidden, "rows": rows}
        ar = BoundaryAllReduce(hidden, max_rows=rows, device=device)
        for quant in QUANTS:
            suffix = "" if quant is None else f"_{quant}"
            row[f"fused{suffix}_us"] = timer.per_call_us([fused_call(s, arch, quant) for s in sets])
            row[f"api{suffix}_us"] = timer.per_call_us([public_call(ar, s, quant) for s in sets])
            row[f"adds{suffix}_us_at_copy"] = quantized_bytes(rows, hidden, quant) / copy_bw * 1e6
        row["fused_latency_us"] = timer.per_call_us([fused_call(sets[0], arch, None)])
        # Boundaries.final is the public call with the final norm's weight (api_us); what it replaces:
        row["post_only_collapse_norm_us"] = timer.per_call_us([post_only_then_norm_call(ar, s) for s in sets])
        row["final_gain"] = row["post_only_collapse_norm_us"] / row["api_us"]
        row["eager_chain_us"] = timer.per_call_us([chain_call(chains.boundary_chain, s) for s in sets])
        if compiled_chain is not None:
            row["compile_chain_us"] = timer.per_call_us([chain_call(compiled_chain, s) for s in sets])
        row["host_fused_us"] = host_us_per_call(fused_call(sets[0], arch, None))
        s0 = sets[0]
        row["host_boundary_all_reduce_us"] = host_us_per_call(
            lambda ar=ar, s0=s0: ar(
                s0["x"], s0["residual"], s0["post"], s0["comb"], s0["pre"], s0["norm_weight"], 1e-20, None
            )
        )
        row["path"] = ar.path
        for key, quant in (("fused_us", None), ("fused_mxfp8_us", "mxfp8"), ("fused_fp8_1x128_us", "fp8_1x128")):
            bw = boundary_bytes(rows, hidden, quant) / (row[key] * 1e-6)
            row[key.replace("_us", "_GBps")] = bw / 1e9
            row[key.replace("_us", "_pct_copy")] = 100 * bw / copy_bw
        row["eager_ratio"] = row["eager_chain_us"] / row["fused_us"]
        if "compile_chain_us" in row:
            row["compile_ratio"] = row["compile_chain_us"] / row["fused_us"]
        out.append(row)
        del sets
        torch.cuda.empty_cache()
    return out


def coefficient_inputs(
    rows: int, hidden: int, device: torch.device, seed: int, workspace: ck.CoefficientsWorkspace | None = None
) -> dict[str, Any]:
    """One set of inputs (with its own fn, so that fn is read cold) and outputs for the coefficients."""
    g = torch.Generator(device=device).manual_seed(seed)
    fn = torch.randn(24, 4 * hidden, generator=g, device=device) * 1e-2
    return dict(
        streams=torch.randn(rows, 4, hidden, generator=g, device=device).to(torch.bfloat16),
        fn=fn,
        fn_broadcast=fn.view(24, 4, hidden).sum(1).contiguous(),
        scale=torch.full((3,), 0.5, device=device),
        base=torch.randn(24, generator=g, device=device) * 0.5,
        norm_weight=(1 + 0.1 * torch.randn(hidden, generator=g, device=device)).to(torch.bfloat16),
        pre_mix=torch.rand(rows, 4, generator=g, device=device),
        post=torch.empty(rows, 4, device=device),
        comb=torch.empty(rows, 4, 4, device=device),
        pre=torch.empty(rows, 4, device=device),
        layer_input=torch.empty(rows, hidden, dtype=torch.bfloat16, device=device),
        workspace=workspace if workspace is not None else ck.CoefficientsWorkspace(hidden, max(rows, 16), device),
    )


def coefficients_call(
    inp: dict[str, Any],
    arch: str,
    variant: str = "standard",
    config: ck.CoefficientsConfig | None = None,
    sinkhorn_repeat: int = 20,
):
    """A closure running the coefficients kernel (standard, broadcast or inline) on one input set (default config
    unless `config`)."""
    broadcast, inline = variant == "broadcast", variant == "inline"
    x = inp["streams"][:, 0].contiguous() if broadcast else inp["streams"]

    def call() -> None:
        ck.mhc_coefficients(
            x,
            inp["fn_broadcast"] if broadcast else inp["fn"],
            inp["scale"],
            inp["base"],
            rms_eps=1e-20,
            pre_eps=1e-6,
            sinkhorn_eps=1e-6,
            post_mult=2.0,
            sinkhorn_repeat=sinkhorn_repeat,
            broadcast=broadcast,
            workspace=inp["workspace"],
            post_out=inp["post"],
            comb_out=inp["comb"],
            pre_out=inp["pre"],
            pre_mix=inp["pre_mix"] if inline else None,
            norm_weight=inp["norm_weight"] if inline else None,
            norm_eps=1e-20 if inline else None,
            layer_input_out=inp["layer_input"] if inline else None,
            arch=arch,
            config=config,
        )

    return call


def coefficients_bytes(rows: int, hidden: int, variant: str) -> int:
    """The fewest bytes the coefficients move: fn, the projection input, the outputs (+ the layer input)."""
    width = hidden if variant == "broadcast" else 4 * hidden
    total = 24 * width * 4 + rows * width * 2 + rows * 24 * 4 + 27 * 4
    if variant == "inline":
        total += rows * hidden * 2 + hidden * 2
    return total


def bench_coefficients(args: argparse.Namespace, arch: str, timer: GraphTimer, copy_bw: float) -> list[dict]:
    """The coefficients kernel against the eager and compiled chains and the floor, per (H, rows)."""
    device = timer.device
    compiled_chain = None if args.no_compile else chains.compiled(chains.coefficients_chain)
    out = []
    shapes = [(h, r) for h in args.hidden for r in sorted(args.rows)]
    for hidden, rows in tqdm(shapes, desc="coefficients", unit="shape"):
        ws = ck.CoefficientsWorkspace(hidden, max(rows, 16), device)
        sets = [coefficient_inputs(rows, hidden, device, seed, ws) for seed in range(CALLS_PER_GRAPH)]
        row: dict[str, Any] = {"H": hidden, "rows": rows}
        for variant in ("standard", "broadcast", "inline"):
            us = timer.per_call_us([coefficients_call(s, arch, variant) for s in sets])
            row[f"{variant}_us"] = us
            row[f"{variant}_floor_us"] = coefficients_bytes(rows, hidden, variant) / copy_bw * 1e6
        chain = lambda fn, s: lambda: fn(s["streams"], s["fn"], s["scale"], s["base"])  # noqa: E731
        row["eager_chain_us"] = timer.per_call_us([chain(chains.coefficients_chain, s) for s in sets])
        if compiled_chain is not None:
            row["compile_chain_us"] = timer.per_call_us([chain(compiled_chain, s) for s in sets])
        row["floor_ratio"] = row["standard_us"] / row["standard_floor_us"]
        row["eager_ratio"] = row["eager_chain_us"] / row["standard_us"]
        if "compile_chain_us" in row:
            row["compile_ratio"] = row["compile_chain_us"] / row["standard_us"]
        out.append(row)
        del sets
        torch.cuda.empty_cache()
    return out


def print_coefficients(rows: list[dict]) -> None:
    """The coefficients table."""
    print("\nmHC coefficients (mhc_pre_delayed), GPU us per call, fn read cold")
    head = (
        f"{'H':>5} {'rows':>4} | {'std':>6} {'bcast':>6} {'inline':>6} | {'floor':>6} {'x floor':>7} | "
        f"{'eager':>7} {'compile':>8} | {'x eager':>7} {'x comp':>7}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r['H']:>5} {r['rows']:>4} | {r['standard_us']:6.2f} {r['broadcast_us']:6.2f} {r['inline_us']:6.2f} | "
            f"{r['standard_floor_us']:6.2f} {r['floor_ratio']:7.2f} | {r['eager_chain_us']:7.2f} "
            f"{r.get('compile_chain_us', float('nan')):8.2f} | {r['eager_ratio']:7.1f} "
            f"{r.get('compile_ratio', float('nan')):7.1f}"
        )


def print_boundary(rows: list[dict], copy_bw: float) -> None:
    """The boundary table."""
    print(
        f"\nfused boundary (W=1, bf16 partial in, bf16 out), GPU us per call; copy bandwidth {copy_bw / 1e12:.2f} TB/s"
    )
    head = (
        f"{'H':>5} {'rows':>4} | {'fused':>7} {'+mxfp8':>7} {'+fp8':>7} {'1-call':>7} | {'api':>7} "
        f"{'+mxfp8':>7} {'+fp8':>7} | {'eager':>7} {'compile':>8} | {'x eager':>7} {'x comp':>7} | "
        f"{'GB/s':>6} {'%copy':>6} | {'host us':>7}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        comp = r.get("compile_chain_us", float("nan"))
        ratio = r.get("compile_ratio", float("nan"))
        print(
            f"{r['H']:>5} {r['rows']:>4} | {r['fused_us']:7.2f} {r['fused_mxfp8_us']:7.2f} "
            f"{r['fused_fp8_1x128_us']:7.2f} {r['fused_latency_us']:7.2f} | {r['api_us']:7.2f} {r['api_mxfp8_us']:7.2f} "
            f"{r['api_fp8_1x128_us']:7.2f} | {r['eager_chain_us']:7.2f} {comp:8.2f} | {r['eager_ratio']:7.1f} "
            f"{ratio:7.1f} | {r['fused_GBps']:6.0f} {r['fused_pct_copy']:6.1f} | {r['host_fused_us']:7.1f}"
        )
    print("final boundary (one launch: the public call with the final norm) against post_only + collapse + norm")
    for r in rows:
        print(
            f"  H {r['H']:>5} rows {r['rows']:>4}: {r['api_us']:6.2f} us against {r['post_only_collapse_norm_us']:6.2f} us"
            f" ({r['final_gain']:.2f}x)"
        )
    print("FP8 1x128 against bf16 only (fused): us added, and the bytes it adds at copy bandwidth")
    for r in rows:
        added = r["fused_fp8_1x128_us"] - r["fused_us"]
        print(
            f"  H {r['H']:>5} rows {r['rows']:>4}: +{added:5.2f} us (MXFP8 +{r['fused_mxfp8_us'] - r['fused_us']:5.2f}),"
            f" bytes at copy {r['adds_fp8_1x128_us_at_copy']:5.2f} us"
        )


def plot(rows: list[dict], path: Path) -> None:
    """Microseconds against rows, one panel per H."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hiddens = sorted({r["H"] for r in rows})
    fig, axes = plt.subplots(1, len(hiddens), figsize=(5 * len(hiddens), 4), squeeze=False)
    for ax, hidden in zip(axes[0], hiddens):
        sel = [r for r in rows if r["H"] == hidden]
        xs = [r["rows"] for r in sel]
        for key, label in (
            ("fused_us", "fused"),
            ("fused_mxfp8_us", "fused + MXFP8"),
            ("fused_fp8_1x128_us", "fused + FP8 1x128"),
            ("eager_chain_us", "torch eager chain"),
            ("compile_chain_us", "torch.compile chain"),
        ):
            if key in sel[0]:
                ax.plot(xs, [r[key] for r in sel], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("rows")
        ax.set_ylabel("us per call (GPU time)")
        ax.set_title(f"H = {hidden}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def warm_kernels(args: argparse.Namespace, arch: str, device: torch.device) -> None:
    """Compile (in parallel, once per host) and load the one-rank kernels the parts launch, before any is timed: the
    boundary with bf16, MXFP8 and FP8 1x128 layer inputs and the coefficients, at every hidden size of the run."""
    from boundary import mhc
    from cute_kernels.compile import warmup

    hiddens = set(args.hidden) if set(args.parts) - {"step"} else set()
    hiddens |= set(args.step_hidden) if "step" in args.parts else set()
    rows = max(args.rows + args.step_rows)
    variants = boundary_api.engine_variants(("mxfp8", "fp8_1x128"))
    jobs = []
    for hidden in sorted(hiddens):
        jobs += boundary_api.warmup_jobs(hidden, arch=arch, variants=variants)
        jobs += mhc.warmup_jobs(hidden, arch, min(rows, mhc.kernel_row_limit(hidden)))
    warmup(jobs, desc=f"bench kernels H={sorted(hiddens)} {arch}", device=device)


def run_parts(
    args: argparse.Namespace, arch: str, timer: GraphTimer, copy_bw: float, results: dict[str, Any], stem: str
) -> None:
    """Measure the selected parts into `results`, printing each part's table when it is done (the step's: by main)."""
    device = timer.device
    warm_kernels(args, arch, device)
    if "boundary" in args.parts:
        results["boundary"] = bench_boundary(args, arch, timer, copy_bw)
        print_boundary(results["boundary"], copy_bw)
        plot(results["boundary"], args.out / f"{stem}-boundary.png")
    if "host" in args.parts:
        from bench import host

        results["host"] = host.bench_host(args, lambda rows, hidden: boundary_inputs(rows, hidden, device, seed=0))
        host.print_host(results["host"])
    if "allreduce" in args.parts:
        from bench import allreduce

        label, rows = allreduce.measure(
            args, arch, timer, copy_bw, lambda label: args.out / f"{stem}-allreduce-{label}.png"
        )
        results[f"allreduce_{label}"] = rows
    if "coefficients" in args.parts:
        results["coefficients"] = bench_coefficients(args, arch, timer, copy_bw)
        print_coefficients(results["coefficients"])
    if "step" in args.parts:
        from bench import step

        step.bench_step(args, timer, results.setdefault("step", []))


def main(argv: list[str] | None, *, arch: str) -> int:
    """Run the selected parts and write the results."""
    args = parse_args(argv)
    device = torch.device("cuda", torch.cuda.current_device())
    name = torch.cuda.get_device_name(device)
    timer = GraphTimer(device, replays=args.replays)
    copy_bw = timer.copy_bandwidth()
    print(f"{name} ({arch}), torch {torch.__version__}, copy bandwidth {copy_bw / 1e12:.2f} TB/s")
    results: dict[str, Any] = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "gpu": name,
        "arch": arch,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "copy_bandwidth_Bps": copy_bw,
        "calls_per_graph": CALLS_PER_GRAPH,
        "replays": args.replays,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"{re.sub(r'[^A-Za-z0-9]+', '-', name).strip('-').lower()}-{dt.date.today().isoformat()}"
    try:
        run_parts(args, arch, timer, copy_bw, results, stem)
    except BaseException as exc:
        results["incomplete"] = f"stopped by {type(exc).__name__}: {exc}"
        raise
    finally:  # an interrupted run (Ctrl-C, a time limit's SIGINT) still writes and prints what it measured
        path = args.out / f"{stem}.json"
        path.write_text(json.dumps(results, indent=1))
        if results.get("step"):
            from bench import step

            step.print_step(results["step"])
            step.plot_step(results["step"], args.out / f"{stem}-step.png")  # after the JSON: a plot cannot lose it
        print(f"\nwrote {path}" + (" (incomplete: the run was stopped)" if "incomplete" in results else ""))
    stalled = [r for r in results.get("step", []) if "stalled" in r]
    if stalled:
        print(f"make bench: {len(stalled)} simulated step row(s) STALLED (a boundary gave up waiting); see the table")
        return 1
    return 0
