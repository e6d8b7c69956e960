"""The benchmark's kernel parts: the one-rank boundary (its quantized forms and the final boundary) and the
coefficients, each against the unfused chains and the copy bandwidth; their inputs, calls, tables and plots.

GPU time is a CUDA graph of back-to-back calls on rotating inputs after an L2 flush, median of replays, per call (see
bench/timing.py). `bench/run.py` runs them with the other parts.
"""

from __future__ import annotations

import argparse
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
    form: str = "standard",
    config: ck.CoefficientsConfig | None = None,
    sinkhorn_repeat: int = 20,
    quant: tuple[str, Any] | None = None,
):
    """A closure running the coefficients kernel's variant of one tuning form (ck.FORM_VARIANTS: standard, broadcast,
    inline or own) on one input set (default config unless `config`); `quant`: the own form's (form, quantized
    layer input) beside bf16."""
    variant = ck.FORM_VARIANTS[form]
    broadcast, inline, own = variant.broadcast, variant.inline, variant.collapse == "own"
    q_form, q = quant if quant is not None else (None, None)
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
            pre_mix=inp["pre_mix"] if inline and not own else None,
            norm_weight=inp["norm_weight"] if inline else None,
            norm_eps=1e-20 if inline else None,
            layer_input_out=inp["layer_input"] if inline else None,
            own_pre=own,
            quant=q_form,
            quant_data=None if q is None else q.data,
            quant_scale=None if q is None else q.scale,
            arch=arch,
            config=config,
        )

    return call


def coefficients_bytes(rows: int, hidden: int, form: str) -> int:
    """The fewest bytes the coefficients move: fn, the projection input, the outputs (+ the layer input)."""
    variant = ck.FORM_VARIANTS[form]
    width = hidden if variant.broadcast else 4 * hidden
    total = 24 * width * 4 + rows * width * 2 + rows * 24 * 4 + 27 * 4
    if variant.inline:
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
        for form in ("standard", "broadcast", "inline"):
            us = timer.per_call_us([coefficients_call(s, arch, form) for s in sets])
            row[f"{form}_us"] = us
            row[f"{form}_floor_us"] = coefficients_bytes(rows, hidden, form) / copy_bw * 1e6
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
