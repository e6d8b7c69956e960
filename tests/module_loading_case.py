"""Whether BoundaryAllReduce.warmup() has loaded the fused-boundary kernels onto the GPU, shown by what a load does: in
a fresh process with lazy module loading (CUDA's default), simulated ranks run one MoE boundary whose ranks launch
different variants (rank 0 without a shared output, rank 1 with one), rank 1 a few ms late. Its variant's first launch
comes while rank 0 spins; a load then would wait for that spinning grid, and rank 0 would give up on rank 1.

`python -m tests.module_loading_case --warmup` (warmup() first: the claim, no stall) or `--not-loaded` (the control:
the kernels compiled, and marked launched so that the NotLoadedError guard lets the call through, but never launched:
the stall) prints one JSON line: {"error": "" when every rank was clean and exact, else what went wrong}.

(Asking the driver instead, cuFuncIsLoaded on the kernel nodes of a captured graph, cannot tell: capturing a launch
loads its function, so even torch's never-launched sleep kernel read "loaded" there: measured on the H200.)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    how = parser.add_mutually_exclusive_group(required=True)
    how.add_argument("--warmup", action="store_true", help="BoundaryAllReduce.warmup() on the ranks first")
    how.add_argument("--not-loaded", action="store_true", help="the control: compiled, never launched")
    args = parser.parse_args()
    os.environ["CUDA_MODULE_LOADING"] = "LAZY"  # before anything initialises CUDA

    from boundary import BoundaryAllReduce
    from cute_kernels.boundary import api
    from cute_kernels.compile import lazy_module_loading, mark_launched
    from tests import late_rank

    world, rows = 2, late_rank.MODES["moe mixed shared"][1]
    ranks = BoundaryAllReduce.simulated(
        late_rank.HIDDEN, world, max_rows=64, device="cuda", timeout_us=late_rank.TIMEOUT_US
    )
    assert lazy_module_loading(), "CUDA_MODULE_LOADING=LAZY did not take effect"
    if args.warmup:
        ranks[0].warmup(progress=False)  # one context: what rank 0 loads, every rank has
    else:
        for shared in (False, True):
            fn = api.compiled_boundary(
                late_rank.HIDDEN,
                api.BoundaryVariant("moe", shared=shared),
                arch=ranks[0].arch,
                world_size=world,
                ranks_per_device=world,
                rows=rows,
            )
            mark_launched(fn)
    outcome = late_rank.trial(ranks, "moe mixed shared", 1, lambda: time.sleep(0.005), seed=3)
    print(json.dumps({"error": outcome.error}))
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
