"""Launches one shipped kernel for a profiler: warm-up calls, then one call between profiler start and stop.

The kernel is compiled, loaded and warmed up before cudaProfilerStart, and only the profiled call lies between
cudaProfilerStart and cudaProfilerStop (`profiles/profile_all.py` runs this under Nsight Compute for `make profile`).

python profiles/run_kernel.py --kernel boundary --variant bf16|mxfp8|fp8|aux|moe|residual --hidden 7168 --rows 16
python profiles/run_kernel.py --kernel final --rows 16          (Boundaries.final on the kernel path)
python profiles/run_kernel.py --kernel v4_final --rows 16       (V4Boundaries.final: the boundary computing hc_head)
python profiles/run_kernel.py --kernel coefficients --variant standard|inline|broadcast --rows 512
    [--knobs rows_per_tile=64 push_vec=True]   (CoefficientsConfig fields over the default config)
python profiles/run_kernel.py --kernel layer_input --rows 16    (the layer-input-only kernel)
python profiles/run_kernel.py --kernel peer --world 4 --protocol oneshot|twoshot --rows 16
    (SIMULATED ranks: W BoundaryAllReduce ranks on one GPU, every rank's call in one CUDA graph, replayed in the
    profiled region; profile it with ncu --graph-profiling graph, since kernel replay of single launches would run
    each rank alone and its exchange would wait)
python profiles/run_kernel.py --kernel peer --world 4 --protocol oneshot --rows 16 --replay-time 50
    (no profiler: the median of 50 calls timed by CUDA events; profile_all gives a graph this time, which ncu
    stretches)
python profiles/run_kernel.py --batch --kernel boundary --variant bf16 --rows 16 + --kernel final --rows 512 + ...
    (several single-rank items in one process, `+` between their arguments: every item is built, compiled and warmed
    up first; then each has a profiled range of its own that opens with one marker launch, torch.cuda._sleep(1),
    a kernel named at::cuda::...::spin_kernel, then the item's call; profile_all splits the report at the markers)
"""

from __future__ import annotations

import argparse
import ast
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cute_kernels.allreduce.protocol import PEER_WORLD_SIZES, PROTOCOLS  # noqa: E402  (constants: no torch)

BOUNDARY_VARIANTS = ("bf16", "mxfp8", "fp8", "aux", "moe", "residual")
COEFFICIENT_VARIANTS = ("standard", "inline", "broadcast")
LAYER_INPUT_VARIANTS = ("bf16", "mxfp8", "fp8")  # the layer-input kernel's outputs: bf16, + MXFP8 or FP8 1x128
OWN_PRE_VARIANTS = LAYER_INPUT_VARIANTS  # DeepSeek-V4's own-pre coefficients variant: its layer input's forms
VARIANTS = {
    "boundary": BOUNDARY_VARIANTS,
    "coefficients": COEFFICIENT_VARIANTS,
    "layer_input": LAYER_INPUT_VARIANTS,
    "own_pre": OWN_PRE_VARIANTS,
}
KERNELS = ("boundary", "final", "v4_final", "coefficients", "layer_input", "own_pre", "peer")
QUANT = {"bf16": None, "mxfp8": "mxfp8", "fp8": "fp8_1x128"}  # bench.kernels.fused_call's layer-input forms
EPS = 1e-6
MOE_TOP_K = 8  # experts per token of the MoE variant (DeepSeek-V3's)
PEER_TIMEOUT_US = 2_000_000  # a simulated rank that waits this long reports its peers missing (then this fails)
BATCH = "--batch"
SEPARATOR = "+"  # between the items of --batch
MARKER_CYCLES = 1  # torch.cuda._sleep's spin: the marker's own time does not matter, only its name

Call = Callable[[], object]


def knob(text: str) -> tuple[str, object]:
    """One `field=value` of --knobs: the value as a Python literal, else as a string (the field is checked later)."""
    field, sep, value = text.partition("=")
    if not sep or not field:
        raise argparse.ArgumentTypeError(f"expected FIELD=VALUE, got {text!r}")
    try:
        return field, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return field, value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, with the options that apply to one kernel only checked against --kernel."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kernel", choices=KERNELS, required=True)
    p.add_argument(
        "--variant",
        help=f"boundary: one of {BOUNDARY_VARIANTS}; coefficients: one of {COEFFICIENT_VARIANTS}; layer_input: one of "
        f"{LAYER_INPUT_VARIANTS}",
    )
    p.add_argument("--hidden", type=int, default=7168, help="hidden size H (default 7168)")
    p.add_argument("--rows", type=int, default=16, help="rows of the call (default 16)")
    p.add_argument("--calls", type=int, default=3, help="warm-up calls before the profiled one")
    p.add_argument("--knobs", type=knob, nargs="*", default=[], help="coefficients: config fields, e.g. push_vec=True")
    p.add_argument("--world", type=int, choices=PEER_WORLD_SIZES, help="peer: simulated ranks (W), 4 unless given")
    p.add_argument("--protocol", choices=PROTOCOLS, help="peer: the exchange every call is forced to take")
    p.add_argument(
        "--replay-time",
        type=int,
        metavar="N",
        help="no profiler range: time N calls (peer: N replays of its graph) by CUDA events, each after an L2 flush, and "
        "print their median",
    )
    args = p.parse_args(argv)
    if args.replay_time is not None and args.replay_time < 1:
        p.error(f"--replay-time needs at least 1 call, got {args.replay_time}")
    if args.kernel in VARIANTS:
        args.variant = args.variant or VARIANTS[args.kernel][0]
        if args.variant not in VARIANTS[args.kernel]:
            p.error(f"--variant of --kernel {args.kernel} must be one of {VARIANTS[args.kernel]}, got {args.variant!r}")
    elif args.variant is not None:
        p.error(f"--variant applies to --kernel {' or '.join(VARIANTS)} only")
    if args.knobs and args.kernel != "coefficients":
        p.error("--knobs applies to --kernel coefficients only")
    if args.kernel != "peer":
        if args.protocol is not None or args.world is not None:
            p.error("--world and --protocol apply to --kernel peer only")
    elif args.protocol is None:
        p.error(f"--kernel peer needs --protocol ({' or '.join(PROTOCOLS)})")
    else:
        args.world = 4 if args.world is None else args.world
    return args


def parse_batch(argv: list[str]) -> list[argparse.Namespace]:
    """The items of `--batch ITEM + ITEM ...`, each parsed as a one-item command line; peer items are refused (they
    take graph profiling, one process each)."""
    items: list[list[str]] = [[]]
    for arg in argv:
        if arg == SEPARATOR:
            items.append([])
        else:
            items[-1].append(arg)
    if any(not item for item in items):
        raise SystemExit(f"run_kernel: {BATCH} needs one item's arguments before, between and after each {SEPARATOR!r}")
    parsed = [parse_args(item) for item in items]
    if any(args.kernel == "peer" for args in parsed):
        raise SystemExit(f"run_kernel: --kernel peer takes graph profiling, one process each: not in {BATCH}")
    if any(args.replay_time for args in parsed):
        raise SystemExit(f"run_kernel: --replay-time times one item alone: not in {BATCH}")
    return parsed


def boundary_call(variant: str, rows: int, hidden: int, device: Any, arch: str) -> Call:
    """The one-rank fused boundary's entry (no host checks) in one variant: bf16 only, +MXFP8, +FP8 1x128 (fp32
    scales), +aux, the MoE finalize (top-8 combine of gemm2_permuted plus the shared expert), or residual-only."""
    import torch

    from bench.kernels import boundary_inputs, fused_call
    from cute_kernels.allreduce.protocol import ERROR_WORDS
    from cute_kernels.boundary import api

    inp = boundary_inputs(rows, hidden, device, 0)
    if variant in QUANT:
        return fused_call(inp, arch, QUANT[variant])
    kwargs: dict[str, Any] = dict(
        residual=inp["residual"],
        post=inp["post"],
        comb=inp["comb"],
        pre=inp["pre"],
        norm_weight=inp["norm_weight"],
        norm_eps=EPS,
        x=inp["x"],
        new_residual=inp["new_residual"],
        out=inp["out"],
        arch=arch,
    )
    if variant == "aux":
        kwargs["aux"] = torch.empty_like(inp["x"])
    elif variant == "residual":
        kwargs.update(pre=None, norm_weight=None, out=None)
    else:  # moe
        g = torch.Generator(device=device).manual_seed(1)
        permuted = rows * MOE_TOP_K
        gemm2 = torch.randn(permuted, hidden, generator=g, device=device).to(torch.bfloat16)
        weights = torch.rand(rows, MOE_TOP_K, generator=g, device=device) / MOE_TOP_K
        idx = torch.randperm(permuted, generator=g, device=device).view(rows, MOE_TOP_K).to(torch.int32)
        kwargs.update(
            x=None,
            moe=(gemm2, weights, idx),
            shared=torch.randn(rows, hidden, generator=g, device=device).to(torch.bfloat16),
            error=torch.zeros(ERROR_WORDS, dtype=torch.int32, device=device),
        )
    variant = api.BoundaryVariant(
        "moe" if "moe" in kwargs else "x", "shared" in kwargs, kwargs["pre"] is not None, aux="aux" in kwargs
    )
    return lambda: api.fused_boundary(variant, **kwargs)


def final_call(rows: int, hidden: int, device: Any) -> Call:
    """Boundaries.final on a W = 1 BoundaryAllReduce (the kernel path): the fused boundary with the final norm."""
    from bench.kernels import boundary_inputs
    from boundary import Boundaries, BoundaryAllReduce, BoundaryState

    inp = boundary_inputs(rows, hidden, device, 0)
    ar = BoundaryAllReduce(hidden, max_rows=rows, device=device)
    if ar.path != "kernel":
        raise SystemExit(f"run_kernel: the W = 1 BoundaryAllReduce took the {ar.path!r} path, not 'kernel'")
    boundaries = Boundaries(ar)
    state = BoundaryState(inp["residual"], inp["post"], inp["comb"], inp["pre"])

    def call() -> None:
        state.pending = inp["x"]  # final consumes it
        boundaries.final(state, inp["norm_weight"], EPS)

    return call


def v4_final_call(rows: int, hidden: int, device: Any) -> Call:
    """V4Boundaries.final on a W = 1 BoundaryAllReduce (the kernel path): the fused boundary that computes hc_head's
    weights from its new streams, then the collapse and the final norm (one launch)."""
    from types import SimpleNamespace

    import torch

    from bench.kernels import boundary_inputs
    from boundary import BoundaryAllReduce, BoundaryState, V4Boundaries

    inp = boundary_inputs(rows, hidden, device, 0)
    ar = BoundaryAllReduce(hidden, max_rows=rows, device=device)
    if ar.path != "kernel":
        raise SystemExit(f"run_kernel: the W = 1 BoundaryAllReduce took the {ar.path!r} path, not 'kernel'")
    g = torch.Generator(device=device).manual_seed(2)
    head = SimpleNamespace(
        hc_head_fn=torch.randn(4, 4 * hidden, generator=g, device=device) * 1e-2,
        hc_head_scale=torch.full((1,), 0.5, device=device),
        hc_head_base=torch.randn(4, generator=g, device=device),
        rms_norm_eps=EPS,
        hc_eps=EPS,
    )
    boundaries = V4Boundaries(ar)
    state = BoundaryState(inp["residual"], inp["post"], inp["comb"], None)

    def call() -> None:
        state.pending = inp["x"]  # final consumes it
        boundaries.final(state, head, inp["norm_weight"], EPS)

    return call


def coefficients_call(
    variant: str, knobs: list[tuple[str, object]], rows: int, hidden: int, device: Any, arch: str
) -> Call:
    """The coefficients kernel (one launch, or two with schedule "partials"): the standard projection, the inline
    form (with the layer input) or the broadcast form (first layer), on the shipped config unless `knobs`."""
    from dataclasses import replace

    from bench.kernels import coefficient_inputs
    from bench.kernels import coefficients_call as bench_call
    from cute_kernels.coefficients import FORM_VARIANTS, CoefficientsConfig, coefficients_config

    config = None
    if knobs:
        unknown = [field for field, _ in knobs if field not in CoefficientsConfig.__dataclass_fields__]
        if unknown:
            raise SystemExit(f"run_kernel: --knobs {unknown} are not CoefficientsConfig fields")
        default = coefficients_config(hidden, FORM_VARIANTS[variant], rows, arch=arch)
        config = replace(default, **dict(knobs))
    return bench_call(coefficient_inputs(rows, hidden, device, 0), arch, variant, config)


def quantized_out(variant: str, rows: int, hidden: int, device: Any) -> tuple[str | None, Any]:
    """(the quantized form of a layer-input `variant`, an empty buffer for it or None)."""
    from boundary.types import empty_layer_input_form

    return QUANT[variant], empty_layer_input_form(QUANT[variant], rows, hidden, device)


def layer_input_call(variant: str, rows: int, hidden: int, device: Any, arch: str) -> Call:
    """The layer-input-only kernel (first layer, Engram seams, DeepSeek-V4's own pre): RMSNorm of the carried pre-mix
    collapse, with the MXFP8 or FP8 1x128 form beside it (`variant` "mxfp8" / "fp8")."""
    from bench.kernels import coefficient_inputs
    from cute_kernels.coefficients import mhc_layer_input

    inp = coefficient_inputs(rows, hidden, device, 0)
    quant, q = quantized_out(variant, rows, hidden, device)
    return lambda: mhc_layer_input(
        inp["streams"],
        inp["pre_mix"],
        inp["norm_weight"],
        EPS,
        inp["layer_input"],
        arch=arch,
        quant=quant,
        quant_data=None if q is None else q.data,
        quant_scale=None if q is None else q.scale,
    )


def own_pre_call(variant: str, rows: int, hidden: int, device: Any, arch: str) -> Call:
    """DeepSeek-V4's own-pre entry: the coefficients kernel's own-pre variant on its shipped config (one launch at 1
    row, two from 2), the layer input collapsed with the pre it computes, with the MXFP8 or FP8 1x128 form beside it
    (`variant` "mxfp8" / "fp8")."""
    from bench.kernels import coefficient_inputs
    from bench.kernels import coefficients_call as bench_call

    quant, q = quantized_out(variant, rows, hidden, device)
    inp = coefficient_inputs(rows, hidden, device, 0)
    return bench_call(inp, arch, "own", None, quant=None if quant is None else (quant, q))


def peer_call(world: int, protocol: str, rows: int, hidden: int, device: Any, arch: str) -> tuple[Call, list]:
    """SIMULATED: W ranks of BoundaryAllReduce.simulated on this GPU, every call forced to `protocol`, each rank's
    kernel compiled and loaded first; the call replays one CUDA graph of every rank's boundary (run_simulated: each
    on its rank's stream, forked from the capture stream and joined back), captured after one eager call. Also the
    ranks."""
    import torch

    from bench.kernels import boundary_inputs
    from boundary import BoundaryAllReduce
    from cute_kernels.boundary import api
    from cute_kernels.compile import warmup

    ranks = BoundaryAllReduce.simulated(
        hidden, world, max_rows=rows, device=device, timeout_us=PEER_TIMEOUT_US, protocol=protocol
    )
    jobs = api.warmup_jobs(
        hidden,
        arch=arch,
        world_size=world,
        ranks_per_device=ranks[0].workspace.ranks_per_device,
        variants=[api.BoundaryVariant()],
        protocols=(protocol,),
    )
    warmup(jobs, progress=False, desc="peer boundary kernels", device=device)
    sets = [boundary_inputs(rows, hidden, device, rank) for rank in range(world)]
    calls = [
        lambda ar, s=s: ar(s["x"], s["residual"], s["post"], s["comb"], s["pre"], s["norm_weight"], EPS, None)
        for s in sets
    ]
    BoundaryAllReduce.run_simulated(ranks, calls)  # eager first: what a first call allocates stays outside the graph
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        BoundaryAllReduce.run_simulated(ranks, calls)
    return graph.replay, ranks


def build(args: argparse.Namespace, device: Any, arch: str) -> tuple[Call, list]:
    """The closure of the profiled call, and the simulated ranks (none unless --kernel peer)."""
    if args.kernel == "boundary":
        return boundary_call(args.variant, args.rows, args.hidden, device, arch), []
    if args.kernel == "final":
        return final_call(args.rows, args.hidden, device), []
    if args.kernel == "v4_final":
        return v4_final_call(args.rows, args.hidden, device), []
    if args.kernel == "coefficients":
        return coefficients_call(args.variant, args.knobs, args.rows, args.hidden, device, arch), []
    if args.kernel == "layer_input":
        return layer_input_call(args.variant, args.rows, args.hidden, device, arch), []
    if args.kernel == "own_pre":
        return own_pre_call(args.variant, args.rows, args.hidden, device, arch), []
    return peer_call(args.world, args.protocol, args.rows, args.hidden, device, arch)


def label(args: argparse.Namespace) -> str:
    """What was profiled, in words."""
    what = args.kernel + (f" {args.variant}" if args.variant else "")
    if args.kernel == "peer":
        what += f" SIMULATED W={args.world} {args.protocol}"
    return f"{what} H={args.hidden} rows={args.rows}" + (f" knobs={dict(args.knobs)}" if args.knobs else "")


def profile_batch(batch: list[argparse.Namespace]) -> None:
    """Build and warm up every item, then profile each in a range of its own: the marker launch, then its call."""
    import torch

    from cute_kernels.compile import arch_for_device

    if not torch.cuda.is_available():
        raise SystemExit("run_kernel: no CUDA GPU here")
    device = torch.device("cuda", torch.cuda.current_device())
    arch = arch_for_device(device)
    calls = [build(args, device, arch)[0] for args in batch]
    torch.cuda._sleep(MARKER_CYCLES)  # the marker's module is loaded outside every profiled range
    for args, call in zip(batch, calls):
        for _ in range(args.calls):  # compile, load, allocate
            call()
    torch.cuda.synchronize()
    for call in calls:
        torch.cuda.profiler.start()
        torch.cuda._sleep(MARKER_CYCLES)
        call()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
    print(f"profiled {len(batch)} calls, each after a marker: " + "; ".join(label(args) for args in batch))


def profile_one(args: argparse.Namespace) -> None:
    """Build and warm up one item, then profile its call (no marker)."""
    if args.kernel == "peer":
        # Simulated ranks share one CUDA context: every kernel must be loaded before a boundary spins, so CUDA loads
        # modules eagerly (CONTRACT §7). Set before torch initialises CUDA; $CUDA_MODULE_LOADING wins.
        os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")  # no rank's kernel queued behind a spinning peer
    import torch

    from cute_kernels.compile import arch_for_device

    if not torch.cuda.is_available():
        raise SystemExit("run_kernel: no CUDA GPU here")
    device = torch.device("cuda", torch.cuda.current_device())
    call, ranks = build(args, device, arch_for_device(device))
    for _ in range(args.calls):  # compile, load, allocate
        call()
    torch.cuda.synchronize()
    for ar in ranks:
        ar.check()  # raises if a warm-up exchange timed out
    if args.replay_time:
        from bench.timing import L2_FLUSH_BYTES, event_us

        # L2 flushed before each call, as bench's GraphTimer and ncu's cache control do
        flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device=device)
        times_us = sorted(event_us(call, flush) for _ in range(args.replay_time))
        for ar in ranks:
            ar.check()  # a timed-out exchange would have timed a spin
        print(
            f"replay time: median {times_us[len(times_us) // 2]:.2f} us, min {times_us[0]:.2f}, max {times_us[-1]:.2f} "
            f"over {len(times_us)} calls: {label(args)}"
        )
        return
    torch.cuda.profiler.start()
    call()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    for ar in ranks:
        ar.check()  # a timed-out exchange would have profiled a spin, not the boundary
    print(f"profiled one call: {label(args)}")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == [BATCH]:
        profile_batch(parse_batch(argv[1:]))
    else:
        profile_one(parse_args(argv))


if __name__ == "__main__":
    main()
