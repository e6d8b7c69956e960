"""One fresh process of the lateness matrix's first-launch cells (CONTRACT §7): simulated ranks warmed up, then,
one trial each, the late rank launches a kernel for the first time in the process ahead of its boundary.

`python -m tests.late_rank_case --world 4 --late 3 --loading eager` prints one JSON line: per kind, "" when every
rank was clean and exact, else what went wrong. `--loading lazy` is the negative control (CUDA's default).
Kinds (default: sleep, compile, alloc): "sleep" (torch's sleep kernel), "compile" (a CuTe DSL kernel compiled on the
late rank's host before its boundary, launched only after it), "alloc" (torch's caching allocator asking CUDA for new
device memory on the late rank's stream), and "gemm": a cuBLAS kernel's first launch, into an output allocated
beforehand, after a warm-up GEMM of another shape on the late rank's stream made the cuBLAS handle and that stream's
workspace. cuBLAS loads its kernel at that launch whatever CUDA_MODULE_LOADING says, which stalls the spinning peers
(measured 30 of 30, CONTRACT §7): the hazard a warm-up step that runs every GEMM shape once removes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--late", type=int, required=True, help="the late rank")
    parser.add_argument("--loading", choices=("eager", "lazy"), required=True)
    parser.add_argument("--lateness-ms", type=float, default=50.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--kinds", nargs="+", default=["sleep", "compile", "alloc"], choices=["sleep", "gemm", "compile", "alloc"]
    )
    args = parser.parse_args()
    os.environ["CUDA_MODULE_LOADING"] = args.loading.upper()  # before anything initialises CUDA

    import torch

    from boundary import BoundaryAllReduce
    from cute_kernels.boundary import api
    from cute_kernels.compile import lazy_module_loading, warmup
    from tests import late_rank
    from tests.tiny_kernel import compile_tiny

    ranks = BoundaryAllReduce.simulated(
        late_rank.HIDDEN, args.world, max_rows=64, device="cuda", timeout_us=late_rank.TIMEOUT_US
    )
    assert lazy_module_loading() == (args.loading == "lazy"), "CUDA_MODULE_LOADING did not take effect"
    # The one variant these trials launch: a bf16 partial, one-shot (a process's warmup() loads all of them).
    jobs = api.warmup_jobs(
        late_rank.HIDDEN,
        arch=ranks[0].arch,
        world_size=args.world,
        ranks_per_device=args.world,
        variants=[api.BoundaryVariant()],
        protocols=("oneshot",),
    )
    warmup(jobs, progress=False, device=ranks[0].device)
    ms = args.lateness_ms
    clock_khz = sm_clock_khz()  # read from the driver: calibrating would launch the sleep kernel first
    a = torch.randn(4096, 4096, device="cuda").to(torch.bfloat16)  # randn and the cast: torch kernels, launched now
    c = torch.empty_like(a)
    # The engine's warm-up step: the first cuBLAS call on a stream makes the handle and that stream's workspace (device
    # allocations), which must come before any boundary spins (measured: otherwise it stalls the peers every time,
    # eager loading or not). The 4096^3 GEMM below is then the first launch of its kernel, on the late rank's stream.
    with torch.cuda.stream(ranks[args.late].stream):
        torch.matmul(a[:64, :64], a[:64, :64])
    torch.cuda.synchronize()

    def compile_late() -> None:
        # A width no earlier process compiled: the host-side compile is the lateness; its first launch comes later.
        compile_tiny(256 + 8 * (time.time_ns() % 100_003), arch=ranks[0].arch)

    def allocate_late() -> None:
        # A size no earlier call asked the caching allocator for: it asks CUDA for new memory.
        torch.empty((256 << 20) + 4096 * (time.time_ns() % 100_003), dtype=torch.uint8, device="cuda")
        time.sleep(ms / 1000)

    kinds = {
        "sleep": lambda: torch.cuda._sleep(int(ms * clock_khz)),
        "gemm": lambda: [torch.matmul(a, a, out=c) for _ in range(max(1, int(ms / 0.2)))],
        "compile": compile_late,
        "alloc": allocate_late,
    }
    result = {}
    for k, kind in enumerate(args.kinds):
        result[kind] = late_rank.trial(ranks, "oneshot", args.late, kinds[kind], seed=args.seed * 10 + k).error
    print(json.dumps(result))
    sys.stdout.flush()
    return 0


def sm_clock_khz() -> int:
    """The SM clock of GPU 0 in kHz, from the driver."""
    from cuda.bindings import runtime

    err, khz = runtime.cudaDeviceGetAttribute(runtime.cudaDeviceAttr.cudaDevAttrClockRate, 0)
    if err != runtime.cudaError_t.cudaSuccess:
        raise RuntimeError(f"cudaDeviceGetAttribute(clock rate) failed: {err}")
    return khz


if __name__ == "__main__":
    sys.exit(main())
