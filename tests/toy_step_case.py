"""Whether a warmed-up TP group's decode step loads anything while its boundaries spin: in a fresh process (as `make
bench` runs it: CUDA loading modules eagerly), two simulated ranks warm up, then run the toy V4.1 step (boundaries
only, 1 and 4 rows, coefficients inline and on side streams), every rank's step issued before any is waited for. A
kernel the step obtains after warmup (compiled, or loaded from disk as a second object of a kernel warmup launched) is
loaded onto the GPU at its first launch, which waits for rank 0's spinning boundary: rank 0 gives up on rank 1.

`python -m tests.toy_step_case --warmup` (the claim: nothing obtained, no stall) or `--forget-layer-input` (the
control: warmup, then the layer-input kernels dropped from memory, so the step loads them again from disk) prints one
JSON line: {"obtained": kernels compiled or loaded after warmup, "error": "" when every rank was clean}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

HIDDEN = 1024
TIMEOUT_US = 2_000_000


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    how = parser.add_mutually_exclusive_group(required=True)
    how.add_argument("--warmup", action="store_true", help="warmup() on the ranks, then the steps")
    how.add_argument("--forget-layer-input", action="store_true", help="the control: warmup's layer inputs dropped")
    args = parser.parse_args()
    os.environ["CUDA_MODULE_LOADING"] = "EAGER"  # before anything initialises CUDA (make bench's setting)

    import torch

    from bench.step import boundaries_only
    from boundary import Boundaries, BoundaryAllReduce, DecodeStep
    from boundary.toy import ToyConfig, ToyModel, decode_step, random_tokens
    from cute_kernels import coefficients
    from cute_kernels import compile as cc

    world, rows_list = 2, (1, 4)
    ranks = BoundaryAllReduce.simulated(HIDDEN, world, max_rows=max(rows_list), device="cuda", timeout_us=TIMEOUT_US)
    ranks[0].warmup(progress=False, quantize=("mxfp8",))  # one context: what rank 0 loads, every rank has
    if args.forget_layer_input:
        coefficients.compile_layer_input.cache_clear()
    ours = [Boundaries(ar) for ar in ranks]
    config = ToyConfig(hidden_size=HIDDEN, num_layers=2)
    models = [ToyModel(config, rank=r, world_size=world, device="cuda") for r in range(world)]
    before = cc.STATS.compiles + cc.STATS.disk_hits
    errors = []
    for rows in rows_list:
        free = [boundaries_only(m, rows) for m in models]
        tokens = random_tokens(models[0], rows, 0)
        for side in (True, False):
            step = DecodeStep(rows=rows, side_stream=side)
            calls = [lambda ar, f=free, t=tokens, s=step: decode_step(f[ar.rank], ours[ar.rank], t, s)] * world
            BoundaryAllReduce.run_simulated(ranks, calls)
            torch.cuda.synchronize()
            for ar in ranks:
                try:
                    ar.check()
                except RuntimeError as exc:
                    errors.append(f"{rows} rows, side {side}: {exc}")
                    ar.reset()
    print(json.dumps({"obtained": cc.STATS.compiles + cc.STATS.disk_hits - before, "error": "; ".join(errors)}))
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
