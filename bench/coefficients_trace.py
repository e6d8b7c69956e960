"""Where the coefficients kernel spends its time: a phase timeline per CTA from a trace build.

python -m bench.coefficients_trace --hidden 7168 --rows 1 16 512

For each (H, rows): one call of the default config built with `trace=True` after an L2 flush (fn
cold, eager launch), and per phase (cute_kernels.coefficients_kernel.TRACE_PHASES) the time since
the first CTA started, over all CTAs and over the epilogue CTAs, plus the per-CTA phase durations
in SM cycles. Then the graph timing of the shipped kernel against one with a single Sinkhorn step
(what the 19 other steps cost). Writes the raw traces to bench/results/coefficients-trace-*.json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import re
import sys
from dataclasses import replace
from pathlib import Path

import torch

from bench.kernels import coefficient_inputs, coefficients_call
from bench.timing import GraphTimer
from cute_kernels import coefficients_kernel as ck

RESULTS = Path(__file__).resolve().parent / "results"


def quantiles(v: torch.Tensor) -> str:
    """min / median / max of a 1-D tensor, in the tensor's units."""
    if v.numel() == 0:
        return "        -"
    v = v.double()
    return f"{v.min():8.0f} {v.median():8.0f} {v.max():8.0f}"


def timeline(H: int, rows: int, device: torch.device, arch: str, flush: torch.Tensor, variant: str) -> dict:
    """One traced call: the per-CTA stamps, summarised on stdout and returned raw."""
    broadcast = variant == "broadcast"
    inp = coefficient_inputs(rows, H, device, 0)
    # The trace instruments the one-launch tile schedule (the partials schedule has no trace build).
    config = replace(ck.default_config(H, broadcast, rows), trace=True, schedule="tile")
    trace = torch.zeros(ck.trace_slots(rows, config, broadcast, False), dtype=torch.int64, device=device)
    call = coefficients_call(inp, arch, variant, config, 20, trace)
    for _ in range(3):
        call()
    trace.zero_()
    flush.zero_()
    torch.cuda.synchronize()
    call()
    torch.cuda.synchronize()
    t = trace.view(-1, ck.TRACE_SLOTS).cpu()
    t = t[t[:, 0] != 0]
    start = t[:, 0].min()
    consumer = t[:, ck.TRACE_CONSUMER] == 1
    print(f"\n{variant} H {H} rows {rows}: {t.shape[0]} CTAs on {t[:, ck.TRACE_SM].unique().numel()} SMs, "
          f"{int(consumer.sum())} ran the epilogue; config {config}")  # fmt: skip
    print(f"  {'phase':<13} {'ns since the first CTA: all CTAs (min med max)':>44}   {'epilogue CTAs':>26}"
          f"   {'cycles since the previous phase (min med max)':>40}")  # fmt: skip
    for p, name in enumerate(ck.TRACE_PHASES):
        seen = t[:, p] != 0
        rel = t[seen, p] - start
        relc = t[seen & consumer, p] - start
        cyc = t[seen, 8 + p] - t[seen, 8 + p - 1] if p else torch.zeros(0)
        print(f"  {name:<13} {quantiles(rel):>44}   {quantiles(relc):>26}   {quantiles(cyc):>40}")
    if consumer.any():
        c = t[consumer][:, ck.TRACE_COMB_SLOT : ck.TRACE_COMB_SLOT + len(ck.TRACE_COMB)]
        spans = {
            "softmax + first normalisation": c[:, 1] - c[:, 0],
            "Sinkhorn loop": c[:, 2] - c[:, 1],
            "comb stores": c[:, 3] - c[:, 2],
        }
        print("  comb epilogue of the first row, cycles (min med max): "
              + "; ".join(f"{k} {quantiles(v).strip()}" for k, v in spans.items()))  # fmt: skip
    end = t[consumer, 7].max() - start if consumer.any() else torch.tensor(0)
    print(f"  first CTA start to last epilogue end: {int(end)} ns")
    return {"H": H, "rows": rows, "variant": variant, "config": str(config), "trace": t.tolist()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.coefficients_trace", description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, nargs="+", default=[7168])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16, 512])
    p.add_argument("--replays", type=int, default=7)
    p.add_argument("--variant", nargs="+", default=["standard"], choices=["standard", "broadcast"])
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)

    from cute_kernels.compile import arch_for_device

    device = torch.device("cuda", torch.cuda.current_device())
    arch = arch_for_device(device)
    name = torch.cuda.get_device_name(device)
    timer = GraphTimer(device, replays=args.replays)
    runs = []
    for variant in args.variant:
        for H in args.hidden:
            for rows in args.rows:
                runs.append(timeline(H, rows, device, arch, timer.flush, variant))
    print("\nGraph timing, fn cold, us per call (4 input sets per graph): shipped kernel vs 1 Sinkhorn step")
    for variant in args.variant:
        for H in args.hidden:
            for rows in args.rows:
                sets = [coefficient_inputs(rows, H, device, seed) for seed in range(4)]
                config = ck.default_config(H, variant == "broadcast", rows)
                calls = {r: [coefficients_call(s, arch, variant, config, r) for s in sets] for r in (20, 1)}
                us = {r: timer.per_call_us(c) for r, c in calls.items()}
                print(f"  {variant} H {H} rows {rows:>4}: 20 steps {us[20]:6.2f}   1 step {us[1]:6.2f}   "
                      f"difference {us[20] - us[1]:5.2f}")  # fmt: skip
                runs.append(
                    {"H": H, "rows": rows, "variant": variant, "sinkhorn_20_us": us[20], "sinkhorn_1_us": us[1]}
                )
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"coefficients-trace-{re.sub(r'[^A-Za-z0-9]+', '-', name).strip('-').lower()}-{dt.date.today().isoformat()}"
    path = args.out / f"{stem}.json"
    path.write_text(json.dumps({"gpu": name, "arch": arch, "runs": runs}))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
