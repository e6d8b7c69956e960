"""The peer all-reduce across real processes: one per GPU (when two or more GPUs are present), and two or four
sharing one GPU.

Each rank builds BoundaryAllReduce on its TP group: on a GPU each, NCCL and the "peer" path through symmetric
memory (unicast only); on one GPU, gloo (NCCL takes one rank per GPU) and the peer path through CUDA IPC. It runs
every mode at rows 1..512 against the reference computed from the gathered partials, checks that every rank got
the same bits, and runs a stalled rank, late ranks (host pauses, kernels ahead, a kernel compiled and launched
for the first time in the late process), a rank later than the timeout and a missing rank. NVLink multicast stays
off in every process.
"""

from __future__ import annotations

import os
import time
import traceback
from pathlib import Path

import pytest
import torch

from boundary.demo import file_rendezvous

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
MODES = ("partial", "shared", "moe", "residual-only", "mxfp8", "aux", "mailbox")


def _worker(rank: int, world: int, rendezvous: str, scenario: str, failures, one_gpu: bool) -> None:
    os.environ.update(NO_MULTICAST)
    try:
        import torch.distributed as dist

        from bench.allreduce import warmup_every_protocol
        from boundary import BoundaryAllReduce
        from tests import test_allreduce_gpu as sim

        torch.cuda.set_device(0 if one_gpu else rank)
        backend = "gloo" if one_gpu else "nccl"  # NCCL refuses two ranks on one GPU
        dist.init_process_group(backend, init_method=rendezvous, rank=rank, world_size=world)
        hidden = 4096
        ar = BoundaryAllReduce(hidden, group=dist.group.WORLD, max_rows=512, device="cuda", timeout_us=3_000_000)
        assert ar.path == "peer", f"expected the peer path, got {ar.path}"
        assert ar.workspace.ranks_per_device == (world if one_gpu else 1)
        warmup_every_protocol(ar, _variants())  # the plan forces each protocol, whatever the switch picks
        wire = "cpu" if one_gpu else "cuda"  # what the group's collectives take
        if scenario == "modes":
            # The switch's choice at every row count, and each protocol forced at a few (which side of the switch
            # a row count falls on depends on W and H: tuning.py).
            plan = [(rows, None) for rows in (1, 2, 7, 16, 17, 64, 65, 129, 300, 512)]
            plan += [(rows, protocol) for rows in (3, 200) for protocol in ("oneshot", "twoshot")]
            for rows, protocol in plan:
                for mode in MODES:
                    inputs = sim.make_inputs(world, rows, hidden, mode, seed=rows)  # the same on every rank
                    launched = time.monotonic_ns()
                    with sim.forcing([ar], protocol):
                        res = sim.call(ar, inputs[rank], mode)
                    torch.cuda.synchronize()
                    mine = torch.cat([t.reshape(-1).view(torch.uint8) for t in res.tensors()]).to(wire)
                    everyone = [torch.empty_like(mine) for _ in range(world)]
                    dist.all_gather(everyone, mine)
                    differ = [r for r, e in enumerate(everyone) if not torch.equal(e, everyone[0])]
                    failure = (
                        f"bytes differ from rank 0's on ranks {differ}" if differ else _check(sim, res, inputs, mode)
                    )
                    _settle(ar, world, f"rows {rows} {mode} {protocol}", launched, failure)
            ar.check()
        elif scenario == "stall":
            for rows in (4, 300):
                if rank == world - 1:
                    torch.cuda._sleep(50_000_000)  # ~25 ms of device time before its push
                _exact_call(sim, ar, world, rows, hidden, seed=rows)
            ar.check()
        elif scenario == "lateness":
            # Every rank in turn is late by a host pause or a sleep kernel ahead on its stream, 0.1 to 500 ms, then
            # once by compiling a kernel and launching it for the first time (its module loads in this process's
            # context while the peers' boundaries spin in theirs): every rank exact, every check() clean.
            from tests.tiny_kernel import compile_tiny

            plan = [(kind, ms) for kind in ("host", "sleep") for ms in (0.1, 5.0, 50.0, 500.0)] + [("first launch", 0)]
            for k, (kind, ms) in enumerate(plan):
                late = k % world
                dist.barrier()
                if rank == late:
                    if kind == "host":
                        time.sleep(ms / 1000)
                    elif kind == "sleep":
                        torch.cuda._sleep(int(ms * 1_000_000))  # ~0.5-1 ms per million cycles
                    else:
                        x = torch.zeros(4, 256 + 8 * (os.getpid() % 4096), dtype=torch.bfloat16, device="cuda")
                        y = torch.empty_like(x)
                        compile_tiny(x.shape[1], arch=ar.arch)(x, y, 1.0)
                _exact_call(sim, ar, world, 4 + k, hidden, seed=50 + k)
            ar.check()
        elif scenario == "late":
            # The last rank comes after its peers gave up: they report it, every rank resets (the reset
            # waits for the late kernels, so no late push lands after the re-arm), the next call is exact.
            inputs = sim.make_inputs(world, 8, hidden, "partial", seed=2)
            if rank == world - 1:
                time.sleep(4.5)
            sim.call(ar, inputs[rank], "partial")
            torch.cuda.synchronize()
            if rank != world - 1:
                _assert_reported(ar, world - 1)
            ar.reset()
            for seed in range(3):
                _exact_call(sim, ar, world, 8, hidden, seed=10 + seed)
            ar.check()
        elif scenario == "missing":
            inputs = sim.make_inputs(world, 8, hidden, "partial", seed=1)
            if rank != world - 1:
                sim.call(ar, inputs[rank], "partial")
                torch.cuda.synchronize()
                _assert_reported(ar, world - 1)
            dist.barrier()
            ar.reset()
            _exact_call(sim, ar, world, 8, hidden, seed=1)
            ar.check()
        dist.destroy_process_group()
    except Exception:
        failures.append(f"rank {rank}: {traceback.format_exc()}")
        raise


def _exact_call(sim, ar, world: int, rows: int, hidden: int, *, seed: int) -> None:
    """One partial boundary of this rank (inputs made the same on every rank), held to the reference."""
    inputs = sim.make_inputs(world, rows, hidden, "partial", seed=seed)
    launched = time.monotonic_ns()
    res = sim.call(ar, inputs[ar.rank], "partial")
    torch.cuda.synchronize()
    _settle(ar, world, f"rows {rows}", launched, _check(sim, res, inputs, "partial"))


def _check(sim, res, inputs, mode: str) -> str | None:
    """sim.check's failure message (None: exact)."""
    try:
        sim.check([res], inputs, mode)
    except AssertionError as exc:  # its asserts are not rewritten in a spawned worker: some have no message
        line = traceback.extract_tb(exc.__traceback__)[-1]
        return (str(exc) or f"assert at {Path(line.filename).name}:{line.lineno}")[:400]
    return None


def _settle(ar, world: int, what: str, launched: int, failure: str | None) -> None:
    """Every rank's outcome of one call, gathered (so the ranks also leave it together: a rank's first float64 check,
    which loads cuBLAS, makes no rank start the next call late): where any failed, every rank raises, naming each
    rank's failure, its error word (a wait that gave up, a bad MoE index) and how much later than the first its call
    was launched."""
    import torch.distributed as dist

    try:
        ar.check()
        word = "clean"
    except (RuntimeError, ValueError) as exc:
        word = str(exc)
    reports = [None] * world
    dist.all_gather_object(reports, (failure, word, launched))
    if any(f is not None or w != "clean" for f, w, _ in reports):  # a word set on exact outputs fails as well
        first = min(report[2] for report in reports)
        raise AssertionError(
            f"{what}: "
            + "; ".join(
                f"rank {r}: {'exact' if f is None else f} (error word: {w}; launched {(t - first) / 1e6:.1f} ms after "
                "the first)"
                for r, (f, w, t) in enumerate(reports)
            )
        )


def _assert_reported(ar, rank: int) -> None:
    """check() raises, naming `rank` among the ranks this one gave up on."""
    try:
        ar.check()
    except RuntimeError as exc:
        assert f"[{rank}]" in str(exc) or f", {rank}]" in str(exc), str(exc)
    else:
        raise AssertionError(f"rank {rank} was not reported")


def _spawn(placement: tuple[int, bool], scenario: str) -> None:
    import torch.multiprocessing as mp

    world, one_gpu = placement
    _compile_first(world, one_gpu)
    ctx = mp.get_context("spawn")
    failures = ctx.Manager().list()
    with file_rendezvous() as rendezvous:
        mp.start_processes(
            _worker,
            args=(world, rendezvous, scenario, failures, one_gpu),
            nprocs=world,
            join=True,
            start_method="spawn",
        )
    assert not failures, "\n".join(failures)


def _variants() -> list:
    """The fused-boundary variants the scenarios call (MODES)."""
    from tests import test_allreduce_gpu as sim

    return sorted({sim._variant(mode) for mode in MODES})


def _compile_first(world: int, one_gpu: bool) -> None:
    """Compile what every rank's warmup needs here, once, so that the ranks only load it from the disk cache."""
    from cute_kernels.allreduce.protocol import PROTOCOLS
    from cute_kernels.boundary import api
    from cute_kernels.compile import arch_for_device, warmup

    arch = arch_for_device(torch.device("cuda"))
    jobs = api.warmup_jobs(
        4096,
        arch=arch,
        world_size=world,
        ranks_per_device=world if one_gpu else 1,
        variants=_variants(),
        protocols=PROTOCOLS,
    )
    warmup(jobs, progress=False)


def _placements() -> list[tuple[int, bool]]:
    """(world size, all on one GPU): 2 and 4 processes on GPU 0, and one process per GPU where there are enough."""
    return [(2, True), (4, True)] + [(w, False) for w in (2, 4, 8) if w <= torch.cuda.device_count()]


def _name(placement: tuple[int, bool]) -> str:
    return f"W{placement[0]}-{'one-gpu' if placement[1] else 'gpu-each'}"


@pytest.mark.parametrize("placement", _placements(), ids=_name)
def test_every_mode_on_every_rank(placement: tuple[int, bool]) -> None:
    _spawn(placement, "modes")


@pytest.mark.parametrize("placement", _placements(), ids=_name)
def test_a_stalled_rank(placement: tuple[int, bool]) -> None:
    _spawn(placement, "stall")


@pytest.mark.parametrize("placement", _placements(), ids=_name)
def test_late_ranks_are_exact(placement: tuple[int, bool]) -> None:
    _spawn(placement, "lateness")


@pytest.mark.parametrize("placement", _placements(), ids=_name)
def test_a_missing_rank_is_named(placement: tuple[int, bool]) -> None:
    _spawn(placement, "missing")


@pytest.mark.parametrize("placement", _placements(), ids=_name)
def test_a_rank_later_than_the_timeout(placement: tuple[int, bool]) -> None:
    _spawn(placement, "late")
