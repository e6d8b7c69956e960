"""A/B timing of the coefficients kernel's configs, fn cold: `python -m bench.coefficients_ab` (about 2-3 min).

For each H and row count, 20 input sets (each with its own fn, streams and pre-mix) are run back to
back in one CUDA graph; a 256 MiB buffer is zeroed before each replay (L2 flush), and the time is
the median over replays / 20 (bench/timing.py). Columns: the standard projection, the broadcast
(first layer) projection, the inline form (projection + layer input) and the layer-input-only
kernel, each under the configs below; `*` marks the shipped default for that row count. Every
projection config but the fma and w8 ones shares the default's reduction order (the GPU tests
check the bits), so any of them may become the default, or be picked per row count. The fma configs (the
projection as fp32 FMAs on the CUDA cores instead of tensor-core MMAs, config.projection) do NOT
share the default's bits: they measure the alternative and cannot be swapped in. The configs are
compiled first in parallel processes (--jobs) into the disk cache. `--quick`: standard and inline
at H 7168 and 4096 only (about 1 min). Writes bench/results/coefficients-ab-<gpu>-<date>.json.
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
from cute_kernels import coefficients_kernel as ck

SETS = 20
RESULTS = Path(__file__).resolve().parent / "results"
EPS = dict(rms_eps=1e-20, pre_eps=1e-6, sinkhorn_eps=1e-6, post_mult=2.0, sinkhorn_repeat=20)


def _knobs(**knobs: Any) -> dict[str, Any]:
    """The ticket handoff and the default Sinkhorn unroll, unless `knobs` say otherwise."""
    return {"sinkhorn_unroll": ck.DEFAULT_SINKHORN_UNROLL, "handoff": "ticket", **knobs}


def _config(H: int, broadcast: bool, tm: int, **knobs: Any) -> ck.CoefficientsConfig:
    """A config of row tile tm (the default split of H) with _knobs(knobs)."""
    return ck.CoefficientsConfig.for_shape(H, broadcast, tm, **_knobs(**knobs))


def _wide_config(H: int, broadcast: bool, tm: int, **knobs: Any) -> ck.CoefficientsConfig | None:
    """The same with 8 warps (256 columns) per CTA and so fewer groups, where the width allows it: other
    (warps, groups), so other bits than the default split."""
    chunks = ck.projection_width(H, broadcast) // ck.CHUNK
    if chunks % (ck.CLUSTER * 8):
        return None
    return ck.CoefficientsConfig(tm, 8, chunks // (ck.CLUSTER * 8), **_knobs(**knobs))


def projection_configs(H: int, broadcast: bool) -> dict[str, ck.CoefficientsConfig]:
    """The projection alternatives, all with the ticket handoff: tile height (tm), 16-byte DSMEM pushes
    (vec), warps split over the m-tiles (rsN), launch bound of N CTAs per SM with the largest shared
    memory carveout (mbN), prefetch of the next batch (pf), the projection on the CUDA cores (fma, other
    bits: for A/B only), Sinkhorn repeats per epilogue loop iteration (uN, default 4), lanes per row
    for comb (clN), and 8 warps per CTA with fewer groups (w8, where that is not the default split:
    other bits, so only ever a new default split for every row count of that H). "partials" labels run
    the two-launch schedule (tiles up to 512 rows), "staged" ones that schedule with the rows staged in
    shared memory (config.stage_rows), "ringN" ones staged through a ring of N batch slots
    (config.stage_depth), "sb2" ones with two buffers of warp sums (config.sum_buffers). The defaults (coefficients_kernel.default_bands) are among them,
    by form, H and row count."""
    f = functools.partial(_config, H, broadcast)
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
        "tm128 pf partials": f(128, prefetch=True, schedule="partials"),
        "tm128 pf rs2 partials": f(128, prefetch=True, row_split=2, schedule="partials"),
        "tm256 pf partials": f(256, prefetch=True, schedule="partials"),
        "tm256 pf rs2 partials": f(256, prefetch=True, row_split=2, schedule="partials"),
        "tm256 pf rs4 partials": f(256, prefetch=True, row_split=4, schedule="partials"),
        "tm512 pf rs2 partials": f(512, prefetch=True, row_split=2, schedule="partials"),
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
        "tm128 pf vec": f(128, prefetch=True, push_vec=True),
        "tm128 pf vec rs2 mb2": f(128, prefetch=True, push_vec=True, row_split=2, min_blocks=2),
        "tm128 pf vec rs4": f(128, prefetch=True, push_vec=True, row_split=4),
        "tm32 fma": f(32, projection="fma"),
        "tm64 fma": f(64, projection="fma"),
        "tm32 u1": f(32, sinkhorn_unroll=1),
        "tm32 u8": f(32, sinkhorn_unroll=8),
        "tm32 cl2": f(32, comb_lanes=2),
        "tm32 cl4": f(32, comb_lanes=4),
    }
    wide = functools.partial(_wide_config, H, broadcast)
    for label, cfg in {
        "w8 tm16": wide(16),
        "w8 tm32": wide(32),
        "w8 tm32 vec rs2": wide(32, push_vec=True, row_split=2),
        "w8 tm64": wide(64),
    }.items():
        if cfg is not None and (cfg.warps, cfg.groups) != (cfgs["tm32"].warps, cfgs["tm32"].groups):
            cfgs[label] = cfg
    return cfgs


def inline_configs(H: int) -> dict[str, ck.CoefficientsConfig]:
    """The inline alternatives (interleaved layer-input clusters, ticket handoff): the defaults (tm32,
    tm32 vec rs2, tm64 vec) and the projection knobs that look best for the standard projection."""
    f = functools.partial(_config, H, False)

    return {
        "tm32": f(32),
        "tm32 vec": f(32, push_vec=True),
        "tm32 vec rs2": f(32, push_vec=True, row_split=2),
        "tm64": f(64),
        "tm64 vec": f(64, push_vec=True),
        "tm64 vec mb4": f(64, push_vec=True, min_blocks=4),
        "tm64 vec rs2 mb2": f(64, push_vec=True, row_split=2, min_blocks=2),
        "tm128 pf vec rs2 mb2": f(128, prefetch=True, push_vec=True, row_split=2, min_blocks=2),
        "split partials": f(32, row_split=2, schedule="partials"),
        "tm32 partials": f(32, schedule="partials"),
        "tm64 partials": f(64, schedule="partials"),
    }


def mark_default(
    cfgs: dict[str, ck.CoefficientsConfig], H: int, broadcast: bool, rows: int, inline: bool = False
) -> dict:
    """The same configs, with `*` after the label of the one the defaults pick for `rows` rows."""
    default = ck.default_config(H, broadcast, rows, inline)
    return {f"{label}*" if cfg == default else label: cfg for label, cfg in cfgs.items()}


def selected(cfgs: dict[str, ck.CoefficientsConfig], only: list[str] | None) -> dict[str, ck.CoefficientsConfig]:
    """The configs whose labels `only` names (all when None)."""
    return cfgs if only is None else {label: cfg for label, cfg in cfgs.items() if label in only}


def variant_configs(H: int, variant: str, only: list[str] | None) -> dict[str, ck.CoefficientsConfig]:
    """The configs timed for one projection variant (standard, broadcast or inline)."""
    cfgs = inline_configs(H) if variant == "inline" else projection_configs(H, variant == "broadcast")
    return selected(cfgs, only)


def precompile(hidden: list[int], variants: list[str], arch: str, jobs: int, only: list[str] | None) -> None:
    """Compile every config in `jobs` processes, so the timing loop loads them from the disk cache."""
    from cute_kernels.compile import disk_cache_enabled

    keys = set()
    for H in hidden:
        for variant in variants:
            if variant == "input-only":
                continue
            broadcast = variant == "broadcast"
            cfgs = variant_configs(H, variant, only)
            mode = "carried" if variant == "inline" else "none"
            keys.update(
                (H, "broadcast" if broadcast else "standard", mode, EPS["sinkhorn_repeat"], c) for c in cfgs.values()
            )
    if jobs <= 1 or not disk_cache_enabled():
        return
    t0 = time.time()
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        list(pool.map(_compile_key, sorted(keys, key=repr), [arch] * len(keys)))
    print(f"compiled {len(keys)} configs in {time.time() - t0:.0f} s ({jobs} processes)", flush=True)


def _compile_key(key: tuple, arch: str) -> None:
    ck.compile_coefficients(*key, arch=arch)


def input_only_configs() -> dict[str, tuple[str, ck.LayerInputConfig]]:
    """The layer-input-only alternatives: (mode, config)."""
    return {
        "carried*": ("carried", ck.LayerInputConfig()),
        "carried w4": ("carried", ck.LayerInputConfig(warps=4)),
        "carried 1 row": ("carried", ck.LayerInputConfig(norm_rows=1)),
        "one-hot*": ("one_hot", ck.LayerInputConfig()),
    }


def make_sets(rows: int, H: int, device: torch.device) -> tuple[list[dict[str, Any]], ck.CoefficientsWorkspace]:
    """SETS input sets with their own fn, streams and pre-mix, and outputs; one workspace (the calls run in turn)."""
    ws = ck.CoefficientsWorkspace(H, max(rows, 16), device)
    sets = [coefficient_inputs(rows, H, device, seed, ws) for seed in range(SETS)]
    for s in sets:
        s["embedding"] = s["streams"][:, 0].contiguous()
    return sets, ws


def projection_call(s: dict, ws: ck.CoefficientsWorkspace, arch: str, variant: str, config: ck.CoefficientsConfig):
    broadcast, inline = variant == "broadcast", variant == "inline"

    def call() -> None:
        ck.mhc_coefficients(
            s["embedding"] if broadcast else s["streams"], s["fn_broadcast"] if broadcast else s["fn"], s["scale"],
            s["base"],
            **EPS, broadcast=broadcast, workspace=ws, post_out=s["post"], comb_out=s["comb"], pre_out=s["pre"],
            pre_mix=s["pre_mix"] if inline else None, norm_weight=s["norm_weight"] if inline else None,
            norm_eps=1e-20 if inline else None, layer_input_out=s["layer_input"] if inline else None, arch=arch,
            config=config, validate=False,
        )  # fmt: skip

    return call


def input_only_call(s: dict, arch: str, mode: str, config: ck.LayerInputConfig):
    def call() -> None:
        ck.mhc_layer_input(s["streams"], s["pre_mix"] if mode == "carried" else None, s["norm_weight"], 1e-20,
                           s["layer_input"], arch=arch, config=config, validate=False)  # fmt: skip

    return call


def floor_us(rows: int, H: int, variant: str, bandwidth: float) -> float:
    """Bytes that must move over the copy bandwidth: fn, the projection input and the outputs; the
    streams once and the layer input for the inline form; streams, pre-mix and layer input alone."""
    if variant == "input-only":
        total = rows * (4 * H * 2 + 16 + H * 2) + H * 2
    else:
        width = H if variant == "broadcast" else 4 * H
        total = 24 * width * 4 + rows * (width * 2 + 24 * 4)
        if variant == "inline":
            total += rows * (H * 2 + 16) + H * 2
    return total / bandwidth * 1e6


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.coefficients_ab", description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, nargs="+", default=[4096, 5120, 7168])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64, 256, 512])
    p.add_argument("--replays", type=int, default=7)
    p.add_argument("--only", nargs="+", default=["standard", "broadcast", "inline", "input-only"],
                   choices=["standard", "broadcast", "inline", "input-only"])  # fmt: skip
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--quick", action="store_true", help="only standard and inline at H 7168 and 4096")
    p.add_argument("--configs", nargs="+", default=None, metavar="LABEL",
                   help="time only these config labels (e.g. 'tm32' 'tm32 vec rs2'); default all")  # fmt: skip
    p.add_argument("--jobs", type=int, default=min(12, os.cpu_count() or 1), help="compile processes (1 = none)")
    args = p.parse_args(argv)
    if args.quick:
        args.hidden, args.only = [7168, 4096], ["standard", "inline"]
    if args.configs is not None:  # a typo fails before any GPU work
        projections = [v for v in args.only if v != "input-only"]
        known = {label for H in args.hidden for v in projections for label in variant_configs(H, v, None)}
        if set(args.configs) - known:
            p.error(f"unknown config labels {sorted(set(args.configs) - known)}; known: {sorted(known)}")

    from cute_kernels.compile import arch_for_device

    device = torch.device("cuda", torch.cuda.current_device())
    arch = arch_for_device(device)
    name = torch.cuda.get_device_name(device)
    timer = GraphTimer(device, replays=args.replays)
    bandwidth = timer.copy_bandwidth()
    print(f"{name} ({arch}), copy bandwidth {bandwidth / 1e12:.2f} TB/s; us per call, fn cold, "
          f"{SETS} input sets per graph, median of {args.replays} replays", flush=True)  # fmt: skip
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
                        label: [input_only_call(s, arch, mode, cfg) for s in sets]
                        for label, (mode, cfg) in input_only_configs().items()
                    }
                else:
                    broadcast = variant == "broadcast"
                    cfgs = mark_default(
                        variant_configs(H, variant, args.configs), H, broadcast, rows, variant == "inline"
                    )
                    alts = {
                        label: [projection_call(s, ws, arch, variant, cfg) for s in sets] for label, cfg in cfgs.items()
                    }
                times = {label: timer.per_call_us(calls) for label, calls in alts.items()}
                row[variant] = times
                row[f"{variant}_floor_us"] = floor_us(rows, H, variant, bandwidth)
                cells = "  ".join(f"{label} {us:5.2f}" for label, us in times.items())
                print(f"H {H:>5} rows {rows:>3} {variant:<10} floor {row[f'{variant}_floor_us']:5.2f} | {cells}",
                      flush=True)  # fmt: skip
            torch.cuda.synchronize()
            assert int(ws.counters.abs().sum()) == 0 and bool((ws.partials.view(torch.int32) == ck.SENTINEL).all())
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
