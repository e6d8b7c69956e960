"""The peer all-reduce across real processes, one per GPU (runs by itself when two or more GPUs are present).

Every world size the machine allows: each rank builds BoundaryAllReduce on the NCCL TP group (the
"peer" path through symmetric memory, unicast only), runs every mode at rows 1..512 against the
reference computed from the gathered partials, checks that every rank got the same bits, and runs a
stalled rank and a missing rank. NVLink multicast stays off in every process.
"""

from __future__ import annotations

import os
import socket
import time
import traceback

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two or more GPUs (one process each)"),
]

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
MODES = ("partial", "shared", "moe", "residual-only", "mxfp8", "aux", "mailbox")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, scenario: str, failures) -> None:
    os.environ.update(NO_MULTICAST)
    try:
        import torch.distributed as dist

        from bench.allreduce import warmup_every_protocol
        from boundary import BoundaryAllReduce
        from tests import test_allreduce_gpu as sim

        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        hidden = 4096
        ar = BoundaryAllReduce(hidden, group=dist.group.WORLD, max_rows=512, device="cuda", timeout_us=3_000_000)
        assert ar.path == "peer", f"expected the peer path, got {ar.path}"
        warmup_every_protocol(ar)  # the plan forces each protocol, whatever the switch picks
        if scenario == "modes":
            # The switch's choice at every row count, and each protocol forced at a few (which side of the switch
            # a row count falls on depends on W and H: tuning.py).
            plan = [(rows, None) for rows in (1, 2, 7, 16, 17, 64, 65, 129, 300, 512)]
            plan += [(rows, protocol) for rows in (3, 200) for protocol in ("oneshot", "twoshot")]
            for rows, protocol in plan:
                for mode in MODES:
                    inputs = sim.make_inputs(world, rows, hidden, mode, seed=rows)  # the same on every rank
                    with sim.forcing([ar], protocol):
                        res = sim.call(ar, inputs[rank], mode)
                    torch.cuda.synchronize()
                    mine = torch.cat([t.reshape(-1).view(torch.uint8) for t in res.tensors()])
                    everyone = [torch.empty_like(mine) for _ in range(world)]
                    dist.all_gather(everyone, mine)
                    assert all(torch.equal(e, mine) for e in everyone), f"rows {rows} {mode} {protocol}: ranks differ"
                    sim.check([res], inputs, mode)
            ar.check()
        elif scenario == "stall":
            for rows in (4, 300):
                if rank == world - 1:
                    torch.cuda._sleep(50_000_000)  # ~25 ms of device time before its push
                _exact_call(sim, ar, world, rows, hidden, seed=rows)
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
    res = sim.call(ar, inputs[ar.rank], "partial")
    torch.cuda.synchronize()
    sim.check([res], inputs, "partial")


def _assert_reported(ar, rank: int) -> None:
    """check() raises, naming `rank` among the ranks this one gave up on."""
    try:
        ar.check()
    except RuntimeError as exc:
        assert f"[{rank}]" in str(exc) or f", {rank}]" in str(exc), str(exc)
    else:
        raise AssertionError(f"rank {rank} was not reported")


def _spawn(world: int, scenario: str) -> None:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    failures = ctx.Manager().list()
    mp.start_processes(_worker, args=(world, _free_port(), scenario, failures), nprocs=world, join=True,
                       start_method="spawn")  # fmt: skip
    assert not failures, "\n".join(failures)


def _worlds() -> list[int]:
    return [w for w in (2, 4, 8) if w <= torch.cuda.device_count()]


@pytest.mark.parametrize("world", _worlds())
def test_every_mode_on_every_rank(world: int) -> None:
    _spawn(world, "modes")


@pytest.mark.parametrize("world", _worlds())
def test_a_stalled_rank(world: int) -> None:
    _spawn(world, "stall")


@pytest.mark.parametrize("world", _worlds())
def test_a_missing_rank_is_named(world: int) -> None:
    _spawn(world, "missing")


@pytest.mark.parametrize("world", _worlds())
def test_a_rank_later_than_the_timeout(world: int) -> None:
    _spawn(world, "late")
