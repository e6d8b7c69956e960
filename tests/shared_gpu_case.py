"""One fresh process of the shared-GPU test (CONTRACT §7): W simulated ranks run the toy decode step eagerly, their
coefficients on side streams unless `--inline`, under a given CUDA_DEVICE_MAX_CONNECTIONS. The sublayers are fixed
outputs (bench.step.boundaries_only) unless `--sublayers gemm` (the toy's GEMMs) or `--sublayers sleep` (a one-SM
kernel of about a GEMM's time before each fixed output).

The ranks' boundaries wait on one GPU until every peer's has started; with grids as large as fit (v23), and with 2
CTAs per SM, steps stalled to the timeout, staged kernels and unstaged ones alike (v25: a late rank's kernels before
its boundary need room beside the peers' waiting CTAs). `--shared-ctas-per-sm 4`
sizes the grids as v23 did (4 CTAs per SM among all ranks; the negative control); by default they take the shipped
budget (`SHARED_GPU_CTAS_PER_SM`).

`python -m tests.shared_gpu_case --connections 32` prints one JSON line: per step, whether any rank's boundary gave
up waiting (and which ranks each waited for), how many ranks' outputs differ from rank 0's, and the host's time to
issue every rank's step.
"""

from __future__ import annotations

import argparse
import json
import os
import time

SLEEP_CYCLES = 20_000  # about 10 us at the H200's clocks: a small GEMM's time


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--connections", type=int, required=True)
    parser.add_argument("--world", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument(
        "--sublayers",
        choices=("fixed", "sleep", "gemm"),
        default="fixed",
        help="fixed outputs; fixed outputs after a one-CTA sleep kernel of about a GEMM's time; the toy's GEMMs",
    )
    parser.add_argument(
        "--no-gemm-workspace",
        action="store_true",
        help="cuBLAS without a workspace (no split-K / stream-K GEMMs, whose CTAs may wait for each other)",
    )
    parser.add_argument("--hidden", type=int, default=5120)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--inline", action="store_true", help="the coefficients inline (no side streams)")
    parser.add_argument(
        "--shared-ctas-per-sm",
        type=int,
        help="the CTAs per SM the ranks' waiting grids may take together (default: the shipped "
        "SHARED_GPU_CTAS_PER_SM; 4, v23's budget, is the negative control)",
    )
    args = parser.parse_args()
    os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = str(args.connections)  # before anything initialises CUDA
    os.environ["CUDA_MODULE_LOADING"] = "EAGER"
    if args.no_gemm_workspace:  # read at torch's first cuBLAS call
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":0:0"
        os.environ["CUBLASLT_WORKSPACE_SIZE"] = "0"

    import torch

    from cute_kernels.boundary import config

    if args.shared_ctas_per_sm is not None:  # before any launch shape is computed (default_config is cached)
        config.SHARED_GPU_CTAS_PER_SM = args.shared_ctas_per_sm

    from bench.step import boundaries_only
    from boundary import Boundaries, BoundaryAllReduce, DecodeStep
    from boundary.toy import ToyConfig, ToyModel, compare, decode_step, random_tokens

    hidden, rows, world = args.hidden, args.rows, args.world
    ranks = BoundaryAllReduce.simulated(hidden, world, max_rows=max(8, rows), device="cuda", timeout_us=200_000)
    ranks[0].warmup(progress=False, quantize=("mxfp8",))
    models = [
        ToyModel(ToyConfig(hidden_size=hidden, num_layers=3), rank=r, world_size=world, device="cuda")
        for r in range(world)
    ]
    free = []
    for ar, model in zip(ranks, models):  # every GEMM shape once, before any boundary spins (cuBLAS loads lazily)
        with torch.cuda.stream(ar.stream):
            free.append(boundaries_only(model, rows))
    torch.cuda.synchronize()
    if args.sublayers == "sleep":  # work of a GEMM's length that needs one SM, not the whole GPU
        for model in free:
            attention, moe = model.attention, model.moe
            model.attention = lambda layer, x, f=attention: (torch.cuda._sleep(SLEEP_CYCLES), f(layer, x))[1]
            model.moe = lambda layer, x, f=moe: (torch.cuda._sleep(SLEEP_CYCLES), f(layer, x))[1]
    if args.sublayers != "gemm":
        models = free
    boundaries = [Boundaries(ar) for ar in ranks]
    step = DecodeStep(rows=rows, side_stream=not args.inline)
    results = []
    for index in range(args.steps):
        tokens = random_tokens(models[0], rows, index)
        calls = [lambda ar, t=tokens: decode_step(models[ar.rank], boundaries[ar.rank], t, step)] * world
        start = time.perf_counter()
        outs = BoundaryAllReduce.run_simulated(ranks, calls)
        issued_ms = (time.perf_counter() - start) * 1e3
        torch.cuda.synchronize()
        stalled, waiting = False, []
        for ar in ranks:
            try:
                ar.check()
            except RuntimeError as exc:
                stalled = True
                waiting.append(f"{ar.rank}: {str(exc).split('waiting for ')[-1][:40]}")
        differ = sum(not compare(outs[r], outs[0])["bitwise"] for r in range(1, world))
        results.append(
            {"stalled": stalled, "ranks_differing": differ, "issued_ms": round(issued_ms, 1), "waiting": waiting}
        )
        if stalled:
            for ar in ranks:
                ar.reset()
            torch.cuda.synchronize()
    case = {k: getattr(args, k) for k in ("connections", "sublayers", "world", "hidden", "rows", "inline")}
    print(json.dumps(case | {"shared_ctas_per_sm": config.SHARED_GPU_CTAS_PER_SM, "steps": results}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
