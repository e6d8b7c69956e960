"""The shared-GPU grid budget against v23's, in one run: `python -m bench.experiments.shared_budget_ab` (a few min).

v24 sizes the grids of ranks sharing one GPU to one CTA per SM among them all (`SHARED_GPU_CTAS_PER_SM`, docs/PERF.md
decisions); v23's took as many as fit (4 per SM at W > 1). This times the shipped protocol's SIMULATED boundary (bf16
partial in, bf16 out) as `bench.allreduce` times it (every rank's calls back to back on its own stream, the marginal
per call between a 10- and a 40-call graph), under both budgets in interleaved rounds, and prints the change beside
each budget's cluster count: where both launch the same clusters the difference is the run's noise. #27's bound for
its work: +0.1 us at <= 16 rows, +2 % at 512 rows.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from bench.allreduce import CALLS_PER_GRAPH, CALLS_PER_LONG_GRAPH, rank_sets, simulated_sequence
from bench.timing import GraphTimer
from boundary import BoundaryAllReduce
from cute_kernels.boundary import api, config
from cute_kernels.compile import arch_for_device, warmup

BUDGETS = (4, 1)  # CTAs per SM among the ranks: v23's (every CTA that fits at the peer register budget), v24's
SHIPPED = config.SHARED_GPU_CTAS_PER_SM


def use_budget(per_sm: int) -> None:
    """Launch shapes from here on take `per_sm` CTAs per SM among ranks sharing a GPU."""
    config.SHARED_GPU_CTAS_PER_SM = per_sm
    config.default_config.cache_clear()


def main(argv: list[str] | None = None) -> int:
    """Warm up every variant under both budgets, then time each point under each, round by round."""
    p = argparse.ArgumentParser(
        prog="python -m bench.experiments.shared_budget_ab", description=__doc__.splitlines()[0]
    )
    p.add_argument("--world", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--hidden", type=int, nargs="+", default=[4096, 5120, 7168])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 512])
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args(argv)
    device = torch.device("cuda", torch.cuda.current_device())
    arch = arch_for_device(device)
    timer = GraphTimer(device)
    variant = [api.BoundaryVariant("x", False, True, False, False)]
    for per_sm in BUDGETS:  # each budget's launch shapes are their own compiled variants (staged or not)
        use_budget(per_sm)
        jobs = [
            job
            for w in args.world
            for h in args.hidden
            for job in api.warmup_jobs(h, arch=arch, world_size=w, ranks_per_device=w, variants=variant)
        ]
        warmup(jobs, desc=f"kernels at {per_sm} CTA(s) per SM", device=device)
    print(
        f"{torch.cuda.get_device_name(device)}: SIMULATED ranks, us per call (marginal, {CALLS_PER_GRAPH} to "
        f"{CALLS_PER_LONG_GRAPH} calls per rank), shipped protocol; clusters per rank at 4 / 1 CTA(s) per SM"
    )
    for world in args.world:
        for hidden in args.hidden:
            ranks = BoundaryAllReduce.simulated(hidden, world, max_rows=max(args.rows), device=device)
            for rows in sorted(args.rows):
                sets = rank_sets(world, rows, hidden, CALLS_PER_LONG_GRAPH, device)
                times: dict[int, list[float]] = {b: [] for b in BUDGETS}
                clusters = {}
                for _ in range(args.rounds):
                    for per_sm in BUDGETS:
                        use_budget(per_sm)
                        clusters[per_sm] = config.default_config(hidden, arch, world, world).clusters(rows)
                        steady, _ = timer.steady_per_call_us(
                            lambda n, ranks=ranks, sets=sets: [simulated_sequence(ranks, sets[:n])],
                            CALLS_PER_GRAPH,
                            CALLS_PER_LONG_GRAPH,
                        )
                        times[per_sm].append(steady)
                for ar in ranks:
                    ar.check()  # a wait that gave up makes the timings meaningless
                old, new = (statistics.median(times[b]) for b in BUDGETS)
                print(
                    f"W {world} H {hidden:>5} rows {rows:>4}: clusters {clusters[4]:>3} / {clusters[1]:>3}  "
                    f"{old:8.2f} -> {new:8.2f} us ({new - old:+.2f}, {100 * (new / old - 1):+.1f} %)",
                    flush=True,
                )
    use_budget(SHIPPED)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
