"""The step part's torch.compile baselines compiled ahead, in processes of their own (#44).

Each worker builds the model and the chain the step part builds for one (hidden size, row count) and compiles it
once, which fills Inductor's on-disk caches (the FX graph, AOTAutograd and Triton caches, shared by the processes of
one user). The step part's own compiles of the same graphs then load from them instead of compiling: the cold
compiles run side by side, and the timed run pays a cache hit each. What is timed is unchanged: the same graphs,
compiled the same way (`dynamic=False`), replayed the same way.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import time
from collections.abc import Callable
from concurrent.futures import Executor, ProcessPoolExecutor, as_completed
from typing import NamedTuple

import torch
from tqdm import tqdm

MAX_WORKERS = 8
MIN_JOBS = 3


class Job(NamedTuple):
    """One baseline to compile ahead: the TP 1 step's (`kind` "tp1") or the simulated ranks' shared chain ("chain")."""

    kind: str
    hidden: int
    rows: int
    world: int


def jobs(args: argparse.Namespace) -> list[Job]:
    """The compiles the step part will make, in its order."""
    from bench.step import step_compiles

    if args.no_compile:
        return []
    out = [Job("tp1", h, r, 1) for h in args.step_hidden for r in sorted(args.step_rows) if step_compiles(args, 1, r)]
    for hidden in args.step_hidden:
        for rows in sorted(args.step_rows):
            worlds = [w for w in args.step_tp if w > 1 and step_compiles(args, w, rows)]
            if worlds:  # one chain per row count serves every W (CompiledChains)
                out.append(Job("chain", hidden, rows, worlds[0]))
    return out


def compile_one(job: Job, layers: int, max_rows: int, device_index: int) -> float:
    """Build the step part's graph of `job` and compile it (run once); the seconds it took."""
    from bench.step import CompiledChains, _compiled_call, boundaries_only
    from boundary import Boundaries, BoundaryAllReduce
    from boundary.toy import ToyConfig, ToyModel

    start = time.perf_counter()
    device = torch.device("cuda", device_index) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    config = ToyConfig(hidden_size=job.hidden, num_layers=layers)
    ref = Boundaries(BoundaryAllReduce(job.hidden, max_rows=max_rows, device=device, backend="reference"))
    if job.kind == "tp1":
        free = boundaries_only(ToyModel(config, device=device), job.rows)
        _compiled_call(free, ref, job.rows)()
    else:
        # Rank 0's call as the step part makes it: the shared chain and the rank's own compiled MoE finalize (whose
        # graph depends on the rows alone; left out, FULL's simulated TP compiled one per row count in turn).
        models = [
            boundaries_only(ToyModel(config, rank=r, world_size=job.world, device=device), job.rows)
            for r in range(job.world)
        ]
        CompiledChains(ref).rank_call(models, 0, job.rows)()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def _spawn_pool(workers: int) -> Executor:
    return ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))


def precompile(
    args: argparse.Namespace, device: torch.device, pool: Callable[[int], Executor] = _spawn_pool
) -> list[Job]:
    """Compile the step part's baselines ahead in parallel; the jobs that failed (the step part then compiles those
    itself, and says so here). Nothing runs for fewer than MIN_JOBS compiles (the default run's two: there the gain is
    at most one compile's time, not yet measured against the workers' start-up)."""
    todo = jobs(args)
    if len(todo) < MIN_JOBS:
        return []
    workers = min(len(todo), MAX_WORKERS, max(1, (os.cpu_count() or 2) // 2))
    start = time.perf_counter()
    failed: list[Job] = []
    index = device.index if device.index is not None else 0
    with pool(workers) as executor:
        futures = {executor.submit(compile_one, job, args.step_layers, max(args.step_rows), index): job for job in todo}
        bar = tqdm(
            as_completed(futures),
            total=len(todo),
            desc=f"step baselines: {len(todo)} torch.compile graphs ahead, {workers} processes",
            unit="graph",
        )
        for future in bar:
            job = futures[future]
            try:
                future.result()
            except Exception as exc:  # noqa: BLE001 - reported, and the step part compiles it itself
                failed.append(job)
                tqdm.write(
                    f"step baselines: compiling {job} ahead failed ({type(exc).__name__}: {exc}); "
                    "the step part compiles it itself"
                )
    tqdm.write(
        f"step baselines: {len(todo) - len(failed)} of {len(todo)} compiled ahead in "
        f"{time.perf_counter() - start:.0f} s ({workers} processes)"
    )
    return failed
