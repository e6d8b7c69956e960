"""`make bench`'s run: the command line, the default and --full shapes, and the selected parts in one process.

Writes each part's table to stdout as it ends and `bench/results/<gpu>-<date>.json` plus PNG plots of microseconds
against rows.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import time
from pathlib import Path
from typing import Any

import torch

from bench import critical_path
from bench.kernels import (
    CALLS_PER_GRAPH,
    bench_boundary,
    bench_coefficients,
    boundary_inputs,
    plot,
    print_boundary,
    print_coefficients,
)
from bench.timing import GraphTimer
from cute_kernels.boundary import api as boundary_api

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
        "baseline at every step shape): about 15 and a half minutes on an H200 from cold caches (README), most of it "
        "torch.compile; the default is a few representative shapes of every part",
    )
    p.add_argument("--hidden", type=int, nargs="+", help=f"default {DEFAULTS['hidden']}, --full {FULL['hidden']}")
    p.add_argument("--rows", type=int, nargs="+", help=f"default {DEFAULTS['rows']}, --full {FULL['rows']}")
    p.add_argument(
        "--parts",
        nargs="+",
        default=["boundary", "host", "allreduce", "coefficients", "step", "v4"],
        choices=["boundary", "host", "allreduce", "coefficients", "step", "v4"],
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
        "--tilelang-v4",
        type=Path,
        help="a folder with the TileLang V4 chain's rows and parity cases measured before in its own process "
        "(python -m bench.tilelang_step --boundary --out DIR/tilelang-v4.json --parity DIR/parity.pt): the v4 "
        "part's column and parity table",
    )
    p.add_argument(
        "--tilelang-path",
        type=Path,
        default=os.environ.get("MHC_TILELANG_PATH") or None,
        help="a folder holding tile_kernels and tilelang (e.g. the unpacked pack-tilelang bundle): the step and v4 "
        "parts run bench.tilelang_step there in a process of its own first and add its column (default: "
        "$MHC_TILELANG_PATH)",
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
    if args.tilelang_path is not None and (args.tilelang_json is not None or args.tilelang_v4 is not None):
        p.error("give --tilelang-path (measure TileLang now) or --tilelang-json / --tilelang-v4 (measured before)")
    if args.tilelang_v4 is not None and not (args.tilelang_v4 / "tilelang-v4.json").is_file():
        p.error(f"--tilelang-v4 {args.tilelang_v4} holds no tilelang-v4.json")
    if args.tilelang_path is not None and not (args.tilelang_path / "tile_kernels").is_dir():
        p.error(f"--tilelang-path {args.tilelang_path} holds no tile_kernels package")
    return args


def warm_kernels(args: argparse.Namespace, arch: str, device: torch.device) -> None:
    """Compile (in parallel, once per host) and load the one-rank kernels the parts launch, before any is timed: the
    boundary with bf16, MXFP8 and FP8 1x128 layer inputs and the coefficients (and the V4 part's quantized layer
    inputs, hc_head's variant and the boundary that computes its own pre), at every hidden size of the run."""
    from boundary import mhc
    from cute_kernels.compile import warmup

    hiddens = set(args.hidden) if set(args.parts) - {"step"} else set()
    hiddens |= set(args.step_hidden) if "step" in args.parts else set()
    rows = max(args.rows + args.step_rows)
    v4 = "v4" in args.parts  # its layer input in both quantized forms, hc_head's weights, the own-pre boundary
    variants = boundary_api.engine_variants(("mxfp8", "fp8_1x128"))
    variants += boundary_api.own_pre_variants(()) if v4 else ()
    jobs = []
    for hidden in sorted(hiddens):
        jobs += boundary_api.warmup_jobs(hidden, arch=arch, variants=variants)
        limit = min(rows, mhc.kernel_row_limit(hidden))
        jobs += mhc.warmup_jobs(hidden, arch, limit, own_pre=v4, quantized=("mxfp8", "fp8_1x128"))
    warmup(jobs, desc=f"bench kernels H={sorted(hiddens)} {arch}", device=device)


class PartClock:
    """Wall seconds per stage of the run (the warm-up, each part) into results["elapsed_s"], each printed as it ends."""

    def __init__(self, results: dict[str, Any]) -> None:
        self.elapsed = results.setdefault("elapsed_s", {})
        self.start = time.perf_counter()
        self.last = self.start

    def done(self, stage: str) -> None:
        now = time.perf_counter()
        self.elapsed[stage] = round(now - self.last, 1)
        self.elapsed["total"] = round(now - self.start, 1)
        print(f"make bench: {stage} took {now - self.last:.0f} s ({now - self.start:.0f} s so far)", flush=True)
        self.last = now


def run_parts(
    args: argparse.Namespace, arch: str, timer: GraphTimer, copy_bw: float, results: dict[str, Any], stem: str
) -> None:
    """Measure the selected parts into `results`, printing each part's table when it is done (the step's: by main)
    and the wall time each stage took."""
    device = timer.device
    clock = PartClock(results)
    warm_kernels(args, arch, device)
    clock.done("kernel warm-up")
    if "boundary" in args.parts:
        results["boundary"] = bench_boundary(args, arch, timer, copy_bw)
        print_boundary(results["boundary"], copy_bw)
        plot(results["boundary"], args.out / f"{stem}-boundary.png")
        clock.done("boundary")
    if "host" in args.parts:
        from bench import host

        results["host"] = host.bench_host(args, lambda rows, hidden: boundary_inputs(rows, hidden, device, seed=0))
        host.print_host(results["host"])
        clock.done("host")
    if "allreduce" in args.parts:
        from bench import allreduce

        label, rows = allreduce.measure(
            args, arch, timer, copy_bw, lambda label: args.out / f"{stem}-allreduce-{label}.png"
        )
        results[f"allreduce_{label}"] = rows
        clock.done("allreduce")
    if "coefficients" in args.parts:
        results["coefficients"] = bench_coefficients(args, arch, timer, copy_bw)
        print_coefficients(results["coefficients"])
        clock.done("coefficients")
    if "step" in args.parts:
        from bench import step

        step.bench_step(args, timer, results.setdefault("step", []), lambda stage: clock.done(f"step, {stage}"))
        from bench import start_delay

        results["start_delay"] = start_delay.measure(device, arch)  # printed with the step's tables
        clock.done("step, start delay")
    if "v4" in args.parts:
        from bench import v4

        results["v4"] = v4.bench_v4(args, timer, copy_bw)
        v4.print_v4(results["v4"])
        clock.done("v4")


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
            critical_path.print_critical_path(results["step"])
            if results.get("start_delay"):
                from bench import start_delay

                start_delay.print_start_delays(results["start_delay"])
            step.plot_step(results["step"], args.out / f"{stem}-step.png")  # after the JSON: a plot cannot lose it
        print(f"\nwrote {path}" + (" (incomplete: the run was stopped)" if "incomplete" in results else ""))
    stalled = [r for r in results.get("step", []) if "stalled" in r]
    if stalled:
        print(f"make bench: {len(stalled)} simulated step row(s) STALLED (a boundary gave up waiting); see the table")
        return 1
    return 0
