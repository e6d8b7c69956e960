"""A TP group's start-up on a cold kernel cache: its ranks' `warmup()` calls one after another, then all at once.

`python -m bench.experiments.warmup_group [--world 4] [--hidden 3072] [--max-rows 256]` spawns W processes, one TP
group (gloo; CUDA IPC where they share a GPU, one GPU each where there are enough), each building
`BoundaryAllReduce(H, group=..., max_rows=...)`. Two runs, each on a fresh cache folder:
- alone: rank 0 warms up first while the others wait; then the others warm up (they only load);
- together: every rank calls `warmup()` at the same moment, as an engine's workers do.
It prints each rank's seconds, the together / alone ratio, the compile processes each rank started and the kernels
left in the cache, and fails unless every kernel was compiled once on the host (one rank's compile processes, one
object per job).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def _rank(rank: int, world: int, args: argparse.Namespace, rendezvous: str, together: bool, results: Any) -> None:
    os.environ.update(NO_MULTICAST)
    import torch
    import torch.distributed as dist

    from boundary import BoundaryAllReduce
    from cute_kernels import compile as cc

    one_gpu = torch.cuda.device_count() < world
    torch.cuda.set_device(0 if one_gpu else rank)
    dist.init_process_group("gloo" if one_gpu else "nccl", init_method=rendezvous, rank=rank, world_size=world)
    ar = BoundaryAllReduce(args.hidden, group=dist.group.WORLD, max_rows=args.max_rows, device="cuda")
    dist.barrier()
    if not together and rank != 0:
        dist.barrier()  # rank 0 warms up alone first
    start = time.perf_counter()
    ar.warmup(progress=rank == 0)
    seconds = time.perf_counter() - start
    if not together and rank == 0:
        dist.barrier()
    dist.barrier()
    results.append(dict(rank=rank, seconds=seconds, compile_processes=cc.STATS.compile_processes, path=str(ar.path)))
    dist.destroy_process_group()


def run(args: argparse.Namespace, together: bool) -> tuple[list[dict], int]:
    """One group's warmups on a fresh cache folder: each rank's record, and the kernels left in the cache."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="mhc-warmup-group-") as tmp:
        os.environ["MHC_BOUNDARY_CACHE_DIR"] = str(Path(tmp) / "cache")  # the spawned ranks inherit it
        results = mp.get_context("spawn").Manager().list()
        rendezvous = f"file://{Path(tmp) / 'rendezvous'}"
        mp.spawn(_rank, args=(args.world, args, rendezvous, together, results), nprocs=args.world, join=True)
        objects = len(list((Path(tmp) / "cache").rglob("*.o")))
    return sorted(results, key=lambda r: r["rank"]), objects


def jobs_per_rank(args: argparse.Namespace) -> int:
    """How many kernels one rank's warmup() compiles or loads (the peer variants of W ranks on this host's GPUs)."""
    import torch

    from boundary import mhc
    from boundary.backend import kernel_arch
    from cute_kernels.boundary import api

    arch = kernel_arch(torch.device("cuda"), "auto")
    sharing = args.world if torch.cuda.device_count() < args.world else 1
    protocols = api.warmup_protocols(args.world, args.hidden, args.max_rows, None)
    boundary = api.warmup_jobs(
        args.hidden, arch=arch, world_size=args.world, ranks_per_device=sharing, protocols=protocols
    )
    return len(boundary) + len(mhc.warmup_jobs(args.hidden, arch, args.max_rows))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.experiments.warmup_group", description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=4, choices=[2, 4, 8])
    p.add_argument("--hidden", type=int, default=3072)
    p.add_argument("--max-rows", type=int, default=256)
    args = p.parse_args(argv)
    expected = jobs_per_rank(args)
    ok = True
    seconds = {}
    for together in (False, True):
        label = "together" if together else "alone"
        ranks, objects = run(args, together)
        seconds[label] = ranks[0]["seconds"] if not together else max(r["seconds"] for r in ranks)
        started = [r["compile_processes"] for r in ranks]
        print(
            f"{label:>8}: W {args.world} ({ranks[0]['path']}), H {args.hidden}, max_rows {args.max_rows}: seconds per "
            f"rank {[round(r['seconds'], 1) for r in ranks]}; compile processes started per rank {started}; "
            f"{objects} kernels in the cache, {expected} jobs per rank"
        )
        once = objects == expected and sum(1 for n in started if n) == 1
        ok &= once
        if not once:
            print(f"{label}: a kernel was compiled by more than one rank, or a job left no object", file=sys.stderr)
    ratio = seconds["together"] / seconds["alone"]
    print(
        f"together / alone (rank 0's cold warmup): {seconds['together']:.1f} / {seconds['alone']:.1f} s = {ratio:.2f}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
