"""A/B timing of the coefficients kernel's configs, fn cold: `python -m bench.experiments.coefficients_ab` (2-3 min).

For each H and row count, 20 input sets (each with its own fn, streams and pre-mix) are run back to
back in one CUDA graph; a 256 MiB buffer is zeroed before each replay (L2 flush), and the time is
the median over replays / 20 (bench/timing.py). Columns: the standard projection, the broadcast
(first layer) projection, the inline form (projection + layer input) and the layer-input-only
kernel, each under the configs below; `*` marks the shipped default for that row count. Every
config is a setting of the shipped knobs at H's split along K, so it shares the default's reduction
order (the GPU tests check the bits): any of them may become the default, or be picked per row
count. The configs are compiled first in parallel processes (--jobs) into the disk cache.
`--quick`: standard and inline at H 7168 and 4096 only (about 1 min). Writes
bench/results/coefficients-ab-<gpu>-<date>.json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import json
import multiprocessing
import os
import re
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import torch

from bench.kernels import coefficient_inputs
from bench.timing import GraphTimer
from boundary.types import empty_layer_input_form
from cute_kernels.coefficients import (
    FORM_VARIANTS,
    SENTINEL,
    CoefficientsConfig,
    CoefficientsVariant,
    CoefficientsWorkspace,
    api,
    tuning,
)

SETS = 20
RESULTS = Path(__file__).resolve().parents[1] / "results"
EPS = dict(rms_eps=1e-20, pre_eps=1e-6, sinkhorn_eps=1e-6, post_mult=2.0, sinkhorn_repeat=20)


def projection_configs(H: int, broadcast: bool) -> dict[str, CoefficientsConfig]:
    """The projection alternatives: tile height (tm), 16-byte DSMEM pushes (vec), warps split over the
    m-tiles (rsN), launch bound of N CTAs per SM with the largest shared memory carveout (mbN).
    "partials" labels run the two-launch schedule (tiles up to 512 rows), "staged" ones that schedule
    with the rows staged in shared memory (config.stage_rows), "ringN" ones staged through a ring of N
    batch slots (config.stage_depth), "sb2" ones with two buffers of warp sums (config.sum_buffers). The
    defaults (tuning.default_bands) are among them, by form, H and row count."""
    f = functools.partial(CoefficientsConfig.for_shape, H, broadcast)
    cfgs = {
        "tm16": f(16),
        "tm32": f(32),
        "tm32 vec": f(32, push_vec=True),
        "tm32 vec rs2": f(32, push_vec=True, row_split=2),
        "tm32 vec mb4": f(32, push_vec=True, min_blocks=4),
        "tm64": f(64),
        "tm64 vec": f(64, push_vec=True),
        "tm64 vec mb3": f(64, push_vec=True, min_blocks=3),
        "tm16 partials": f(16, schedule="partials"),
        "split partials": f(32, row_split=2, schedule="partials"),
        "tm32 partials": f(32, schedule="partials"),
        "tm64 partials": f(64, schedule="partials"),
        "tm64 mb3 partials": f(64, min_blocks=3, schedule="partials"),
        "tm128 partials": f(128, schedule="partials"),
        "tm16 staged": f(16, stage_rows=True, schedule="partials"),
        "split staged": f(32, row_split=2, stage_rows=True, schedule="partials"),
        "tm32 staged": f(32, stage_rows=True, schedule="partials"),
        "tm64 staged": f(64, stage_rows=True, schedule="partials"),
        "tm64 mb3 staged": f(64, min_blocks=3, stage_rows=True, schedule="partials"),
        "tm128 staged": f(128, stage_rows=True, schedule="partials"),
        "tm128 rs2 staged": f(128, row_split=2, stage_rows=True, schedule="partials"),
        "tm128 rs4 staged": f(128, row_split=4, stage_rows=True, schedule="partials"),
        "tm256 staged": f(256, stage_rows=True, schedule="partials"),
        "tm256 rs2 staged": f(256, row_split=2, stage_rows=True, schedule="partials"),
        "tm128 rs2 partials": f(128, row_split=2, schedule="partials"),
        "tm512 rs2 ring2": f(512, row_split=2, stage_rows=True, stage_depth=2, schedule="partials"),
        "tm512 rs4 ring2": f(512, row_split=4, stage_rows=True, stage_depth=2, schedule="partials"),
        "tm512 rs2 ring3": f(512, row_split=2, stage_rows=True, stage_depth=3, schedule="partials"),
        "tm512 rs4 ring3": f(512, row_split=4, stage_rows=True, stage_depth=3, schedule="partials"),
        "tm512 ring4": f(512, stage_rows=True, stage_depth=4, schedule="partials"),
        "tm256 rs2 ring2": f(256, row_split=2, stage_rows=True, stage_depth=2, schedule="partials"),
        "tm256 rs4 ring2": f(256, row_split=4, stage_rows=True, stage_depth=2, schedule="partials"),
        "tm256 ring2 mb2": f(256, min_blocks=2, stage_rows=True, stage_depth=2, schedule="partials"),
        "tm256 rs2 ring3": f(256, row_split=2, stage_rows=True, stage_depth=3, schedule="partials"),
        "tm512 rs2 ring2 sb2": f(512, row_split=2, stage_rows=True, stage_depth=2, sum_buffers=2, schedule="partials"),
        "tm512 rs4 ring2 sb2": f(512, row_split=4, stage_rows=True, stage_depth=2, sum_buffers=2, schedule="partials"),
        "tm512 rs4 ring3 sb2": f(512, row_split=4, stage_rows=True, stage_depth=3, sum_buffers=2, schedule="partials"),
        "tm256 rs4 ring2 sb2": f(256, row_split=4, stage_rows=True, stage_depth=2, sum_buffers=2, schedule="partials"),
        "tm128 rs2 sb2 partials": f(128, row_split=2, sum_buffers=2, schedule="partials"),
        "tm128 sb2 partials": f(128, sum_buffers=2, schedule="partials"),
        "tm256 partials": f(256, schedule="partials"),
        "tm256 rs2 partials": f(256, row_split=2, schedule="partials"),
        "tm256 rs4 partials": f(256, row_split=4, schedule="partials"),
        "tm64 vec mb4": f(64, push_vec=True, min_blocks=4),
        "tm64 vec rs2 mb2": f(64, push_vec=True, row_split=2, min_blocks=2),
        "tm128 vec": f(128, push_vec=True),
        "tm128 vec rs2 mb2": f(128, push_vec=True, row_split=2, min_blocks=2),
    }
    return cfgs


def inline_configs(H: int) -> dict[str, CoefficientsConfig]:
    """The inline alternatives (layer-input clusters after each tile's projection clusters): the defaults
    (tm32, tm32 vec, the partials tiles) and the projection knobs that look best for the standard projection."""
    f = functools.partial(CoefficientsConfig.for_shape, H, False)

    return {
        "tm32": f(32),
        "tm32 vec": f(32, push_vec=True),
        "tm32 vec rs2": f(32, push_vec=True, row_split=2),
        "tm64": f(64),
        "tm64 vec": f(64, push_vec=True),
        "tm64 vec mb4": f(64, push_vec=True, min_blocks=4),
        "tm64 vec rs2 mb2": f(64, push_vec=True, row_split=2, min_blocks=2),
        "tm128 vec rs2 mb2": f(128, push_vec=True, row_split=2, min_blocks=2),
        "split partials": f(32, row_split=2, schedule="partials"),
        "tm32 partials": f(32, schedule="partials"),
        "tm64 partials": f(64, schedule="partials"),
    }


def own_configs(H: int) -> dict[str, CoefficientsConfig]:
    """DeepSeek-V4's own-pre alternatives (the finishing CTAs collapse their rows): tiles of 16-64 rows, 16-byte
    pushes, two or four warps per chunk (more layer-input workers); the partials schedule (its finish kernel, one CTA
    per row, collapses) for comparison, though it is two launches."""
    f = functools.partial(CoefficientsConfig.for_shape, H, False)
    return {
        "tm16": f(16),
        "tm32": f(32),
        "tm32 vec": f(32, push_vec=True),
        "tm32 vec rs2": f(32, push_vec=True, row_split=2),
        "tm64 vec": f(64, push_vec=True),
        "tm64 vec rs2": f(64, push_vec=True, row_split=2),
        "tm64 vec rs4": f(64, push_vec=True, row_split=4),
        "split partials": f(32, row_split=2, schedule="partials"),
        "tm16 partials": f(16, schedule="partials"),
        "tm64 partials": f(64, schedule="partials"),
        "tm256 rs4 ring2 sb2": f(256, row_split=4, stage_rows=True, stage_depth=2, sum_buffers=2, schedule="partials"),
        "tm512 rs4 ring2 sb2": f(512, row_split=4, stage_rows=True, stage_depth=2, sum_buffers=2, schedule="partials"),
    }


def mark_default(
    cfgs: dict[str, CoefficientsConfig], H: int, broadcast: bool, rows: int, arch: str, inline: bool = False, own=False
) -> dict:
    """The same configs, with `*` after the label of the one the defaults pick for `rows` rows."""
    variant = CoefficientsVariant.own() if own else CoefficientsVariant.of(broadcast, inline, carried=True)
    default = tuning.coefficients_config(H, variant, rows, arch=arch)
    return {f"{label}*" if cfg == default else label: cfg for label, cfg in cfgs.items()}


def selected(cfgs: dict[str, CoefficientsConfig], only: list[str] | None) -> dict[str, CoefficientsConfig]:
    """The configs whose labels `only` names (all when None)."""
    return cfgs if only is None else {label: cfg for label, cfg in cfgs.items() if label in only}


def variant_configs(H: int, variant: str, only: list[str] | None) -> dict[str, CoefficientsConfig]:
    """The configs timed for one projection variant (standard, broadcast, inline or own)."""
    if variant == "own":
        return selected(own_configs(H), only)
    cfgs = inline_configs(H) if variant == "inline" else projection_configs(H, variant == "broadcast")
    return selected(cfgs, only)


def precompile(hidden: list[int], variants: list[str], arch: str, jobs: int, only: list[str] | None) -> None:
    """Compile every config in `jobs` processes, so the timing loop loads them from the disk cache."""
    from cute_kernels.compile import disk_cache_enabled

    keys = set()
    for H in hidden:
        for variant in variants:
            if variant in ("input-only", "own-quant"):  # the shipped configs: compiled at their first call
                continue
            form = FORM_VARIANTS[variant]
            keys.update((H, form, EPS["sinkhorn_repeat"], c) for c in variant_configs(H, variant, only).values())
    if jobs <= 1 or not disk_cache_enabled():
        return
    t0 = time.time()
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        list(pool.map(_compile_key, sorted(keys, key=repr), [arch] * len(keys)))
    print(f"compiled {len(keys)} configs in {time.time() - t0:.0f} s ({jobs} processes)", flush=True)


def _compile_key(key: tuple, arch: str) -> None:
    api.compile_coefficients(*key, arch=arch)


INPUT_ONLY_MODES = {"carried*": "carried", "one-hot*": "one_hot"}  # the layer-input-only kernel's two modes


def make_sets(rows: int, H: int, device: torch.device) -> tuple[list[dict[str, Any]], CoefficientsWorkspace]:
    """SETS input sets with their own fn, streams and pre-mix, and outputs; one workspace (the calls run in turn)."""
    ws = CoefficientsWorkspace(H, max(rows, 16), device)
    sets = [coefficient_inputs(rows, H, device, seed, ws) for seed in range(SETS)]
    for s in sets:
        s["embedding"] = s["streams"][:, 0].contiguous()
    return sets, ws


def projection_call(
    s: dict,
    ws: CoefficientsWorkspace,
    arch: str,
    variant: str,
    config: CoefficientsConfig | None,
    quant: str | None = None,
):
    """One set's coefficients call of `variant` at `config` (None: the shipped one); own with `quant`: its layer input
    also in that quantized form."""
    broadcast, inline, own = variant == "broadcast", variant == "inline", variant == "own"
    rows, H = s["streams"].shape[0], s["streams"].shape[-1]
    quantized = empty_layer_input_form(quant, rows, H, s["streams"].device)

    def call() -> None:
        api.mhc_coefficients(
            s["embedding"] if broadcast else s["streams"],
            s["fn_broadcast"] if broadcast else s["fn"],
            s["scale"],
            s["base"],
            **EPS,
            broadcast=broadcast,
            workspace=ws,
            post_out=s["post"],
            comb_out=s["comb"],
            pre_out=s["pre"],
            pre_mix=s["pre_mix"] if inline else None,
            norm_weight=s["norm_weight"] if inline or own else None,
            norm_eps=1e-20 if inline or own else None,
            layer_input_out=s["layer_input"] if inline or own else None,
            own_pre=own,
            quant=quant,
            quant_data=None if quantized is None else quantized.data,
            quant_scale=None if quantized is None else quantized.scale,
            arch=arch,
            config=config,
        )

    return call


OWN_QUANT_FORMS = {"bf16*": None, "mxfp8*": "mxfp8", "fp8*": "fp8_1x128", "fp8 ue8m0*": "fp8_1x128_ue8m0"}


def input_only_call(s: dict, arch: str, mode: str):
    def call() -> None:
        api.mhc_layer_input(
            s["streams"],
            s["pre_mix"] if mode == "carried" else None,
            s["norm_weight"],
            1e-20,
            s["layer_input"],
            arch=arch,
        )

    return call


def floor_us(rows: int, H: int, variant: str, bandwidth: float) -> float:
    """Bytes that must move over the copy bandwidth: fn, the projection input and the outputs; the
    streams once and the layer input for the inline form; streams, pre-mix and layer input alone."""
    if variant == "input-only":
        total = rows * (4 * H * 2 + 16 + H * 2) + H * 2
    else:
        width = H if variant == "broadcast" else 4 * H
        total = 24 * width * 4 + rows * (width * 2 + 24 * 4)
        if variant in ("inline", "own", "own-quant"):
            total += rows * (H * 2 + 16) + H * 2
    return total / bandwidth * 1e6


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.experiments.coefficients_ab", description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, nargs="+", default=[4096, 5120, 7168])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64, 256, 512])
    p.add_argument("--replays", type=int, default=7)
    p.add_argument(
        "--only",
        nargs="+",
        default=["standard", "broadcast", "inline", "input-only"],
        choices=["standard", "broadcast", "inline", "input-only", "own", "own-quant"],
        help="own-quant: the own-pre variant at its shipped config in bf16 and each quantized form",
    )
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--quick", action="store_true", help="only standard and inline at H 7168 and 4096")
    p.add_argument(
        "--configs",
        nargs="+",
        default=None,
        metavar="LABEL",
        help="time only these config labels (e.g. 'tm32' 'tm32 vec rs2'); default all",
    )
    p.add_argument("--jobs", type=int, default=min(12, os.cpu_count() or 1), help="compile processes (1 = none)")
    args = p.parse_args(argv)
    if args.quick:
        args.hidden, args.only = [7168, 4096], ["standard", "inline"]
    if args.configs is not None:  # a typo fails before any GPU work
        projections = [v for v in args.only if v not in ("input-only", "own-quant")]
        known = {label for H in args.hidden for v in projections for label in variant_configs(H, v, None)}
        if set(args.configs) - known:
            p.error(f"unknown config labels {sorted(set(args.configs) - known)}; known: {sorted(known)}")

    from cute_kernels.compile import arch_for_device

    device = torch.device("cuda", torch.cuda.current_device())
    arch = arch_for_device(device)
    name = torch.cuda.get_device_name(device)
    timer = GraphTimer(device, replays=args.replays)
    bandwidth = timer.copy_bandwidth()
    print(
        f"{name} ({arch}), copy bandwidth {bandwidth / 1e12:.2f} TB/s; us per call, fn cold, "
        f"{SETS} input sets per graph, median of {args.replays} replays",
        flush=True,
    )
    precompile(args.hidden, args.only, arch, args.jobs, args.configs)
    t0 = time.time()
    results = []
    for H in args.hidden:
        for rows in sorted(args.rows):
            sets, ws = make_sets(rows, H, device)
            row: dict[str, Any] = {"H": H, "rows": rows}
            for variant in args.only:
                if variant == "input-only":
                    alts = {
                        label: [input_only_call(s, arch, mode) for s in sets]
                        for label, mode in INPUT_ONLY_MODES.items()
                    }
                elif variant == "own-quant":
                    alts = {
                        label: [projection_call(s, ws, arch, "own", None, quant) for s in sets]
                        for label, quant in OWN_QUANT_FORMS.items()
                    }
                else:
                    broadcast = variant == "broadcast"
                    cfgs = mark_default(
                        variant_configs(H, variant, args.configs),
                        H,
                        broadcast,
                        rows,
                        arch,
                        variant == "inline",
                        variant == "own",
                    )
                    alts = {
                        label: [projection_call(s, ws, arch, variant, cfg) for s in sets] for label, cfg in cfgs.items()
                    }
                times = {label: timer.per_call_us(calls) for label, calls in alts.items()}
                row[variant] = times
                row[f"{variant}_floor_us"] = floor_us(rows, H, variant, bandwidth)
                cells = "  ".join(f"{label} {us:5.2f}" for label, us in times.items())
                print(
                    f"H {H:>5} rows {rows:>3} {variant:<10} floor {row[f'{variant}_floor_us']:5.2f} | {cells}",
                    flush=True,
                )
            torch.cuda.synchronize()
            assert int(ws.counters.abs().sum()) == 0 and bool((ws.partials.view(torch.int32) == SENTINEL).all())
            results.append(row)
            del sets, ws
            torch.cuda.empty_cache()
    print(f"done in {time.time() - t0:.0f} s")
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"coefficients-ab-{re.sub(r'[^A-Za-z0-9]+', '-', name).strip('-').lower()}-{dt.date.today().isoformat()}"
    path = args.out / f"{stem}.json"
    path.write_text(
        json.dumps({"gpu": name, "arch": arch, "copy_bandwidth_Bps": bandwidth, "results": results}, indent=1)
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
