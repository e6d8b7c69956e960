"""A late rank never stalls its peers (CONTRACT §7): the lateness matrix on simulated ranks.

Every cell: one boundary of a protocol / schedule / MoE form at W 2, 4 and 8, its late rank first, in the middle
or last, made 0.1, 5, 50 or 500 ms late (a 2 s timeout) by a host pause, a kernel ahead on its stream (a sleep
kernel, real GEMMs), both, its first call after warmup(), or a compile on its host; every trial's check() must be
clean on every rank and its bits the rank-order sum's. The first-launch cells (a kernel launched for the first
time in the process) run in fresh processes, ten per cell, with the negative controls: lazy module loading
brings the stall back, and a rank absent past the timeout is reported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from bench.allreduce import warmup_every_protocol
from boundary import BoundaryAllReduce
from cute_kernels.compile import lazy_module_loading
from tests import late_rank
from tests.tiny_kernel import compile_tiny

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

ROOT = Path(__file__).resolve().parents[1]
WORLDS = (2, 4, 8)
FRESH_PROCESSES = 10  # per cell: a first launch happens once per process
# Where the matrix is written, for docs/PERF.md ($MHC_LATE_MATRIX_OUT), besides the assertion.
MATRIX_OUT = os.environ.get("MHC_LATE_MATRIX_OUT")


def _write(name: str, cells: dict) -> None:
    if MATRIX_OUT:
        Path(MATRIX_OUT).mkdir(parents=True, exist_ok=True)
        (Path(MATRIX_OUT) / f"{name}.json").write_text(json.dumps(cells, indent=1))


def _table(cells: dict[str, list]) -> str:
    def line(cell: str, trials: list) -> str:
        errors = [t[0] if isinstance(t, list) else t for t in trials]
        late = [t[1] for t in trials if isinstance(t, list)]
        most = f", late up to {max(late):.1f} ms" if late else ""
        return (
            f"{cell}: {len(trials)} trials, {sum(bool(e) for e in errors)} failed{most} {[e for e in errors if e][:2]}"
        )

    return "\n".join(line(cell, trials) for cell, trials in sorted(cells.items()))


@pytest.fixture(scope="module")
def ranks_by_world() -> dict[int, list[BoundaryAllReduce]]:
    assert not lazy_module_loading(), "the tests load CUDA modules eagerly (conftest)"
    out = {}
    for world in WORLDS:
        ranks = BoundaryAllReduce.simulated(
            late_rank.HIDDEN, world, max_rows=512, device="cuda", timeout_us=late_rank.TIMEOUT_US
        )
        warmup_every_protocol(ranks[0], late_rank.variants())  # every variant the modes call, both protocols, loaded
        out[world] = ranks
    return out


GEMM_CALIBRATION = 10  # GEMMs of the trial that times them beside the peers' waiting grids


def test_the_lateness_matrix(ranks_by_world: dict[int, list[BoundaryAllReduce]]) -> None:
    delays = late_rank.Delays.calibrate()
    timeout_ms = late_rank.TIMEOUT_US / 1000
    cells: dict[str, list] = defaultdict(list)
    short: list[str] = []
    seed = 0

    def record(world: int, mode: str, kind: str, ms: float, late: int, outcome: late_rank.Outcome) -> None:
        trial = [outcome.error, round(outcome.late_ms, 3)]
        if ms >= 5.0 and outcome.late_ms < 0.5 * ms:  # a delay maker that stopped delaying would pass every cell
            short.append(f"W{world} {mode} {kind} {ms:g} ms: the rank was {outcome.late_ms:.3f} ms late")
        where = "first" if late == 0 else "last" if late == world - 1 else "middle"
        cells_of = [f"W{world} {mode} {kind}", f"W{world} late rank {where}"] + ([f"W{world} {ms:g} ms"] if ms else [])
        for cell in cells_of:
            cells[cell].append(trial)

    for world, ranks in ranks_by_world.items():
        positions = (0, world // 2, world - 1)
        for mode in late_rank.MODES:
            # The GEMMs share the GPU with the peers' waiting grids, which take SMs from them: their rate there (this
            # mode's grids at this W) sets how many GEMMs make a lateness. The timing trial is a cell of its own.
            seed += 1
            timing = late_rank.trial(
                ranks, mode, world - 1, lambda: delays.gemms(GEMM_CALIBRATION * delays.gemm_ms), seed
            )
            record(world, mode, "gemm timing", 0.0, world - 1, timing)
            gemm_ms = delays.gemm_ms
            delays.gemm_ms = timing.late_ms / GEMM_CALIBRATION
            # Its first call after warmup() (the compile and the load were warmup's), then every kind and lateness,
            # the late rank's position cycling so that each kind meets all three.
            plan = [("first call", 5.0, positions[seed % 3])]
            plan += [
                (kind, ms, positions[(i + j) % 3])
                for i, kind in enumerate(late_rank.KINDS)
                for j, ms in enumerate(late_rank.LATENESS_MS)
            ]
            for kind, ms, late in plan:
                seed += 1
                make = (
                    (lambda ms=ms: delays.make("host", ms))
                    if kind == "first call"
                    else (lambda kind=kind, ms=ms: delays.make(kind, ms))
                )
                record(world, mode, kind, ms, late, late_rank.trial(ranks, mode, late, make, seed))
            delays.gemm_ms = gemm_ms
    # A first-call compile: the late rank compiles a kernel (its first launch after its boundary) while its peers wait.
    for world, ranks in ranks_by_world.items():
        for k in range(3):
            seed += 1
            width = 2048 + 8 * (seed + os.getpid() % 1000 * 64)
            late = (0, world // 2, world - 1)[k]
            outcome = late_rank.trial(
                ranks, "oneshot", late, lambda width=width, ar=ranks[0]: compile_tiny(width, arch=ar.arch), seed
            )
            record(world, "oneshot", "first-call compile", 0.0, late, outcome)
    _write("lateness_matrix", cells)
    past = {c: t for c, t in cells.items() if any(late_ms >= 0.9 * timeout_ms for _, late_ms in t)}
    assert not past, "trials later than the timeout allows (the lateness is not what the cell names):\n" + _table(past)
    assert not short, "trials less late than their cell names:\n" + "\n".join(short)
    failed = {c: t for c, t in cells.items() if any(error for error, _ in t)}
    assert not failed, "late ranks failed:\n" + _table(failed)


def _fresh(world: int, late: int, loading: str, seed: int, kinds: tuple[str, ...] = ()) -> dict[str, str]:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.late_rank_case",
            "--world",
            str(world),
            "--late",
            str(late),
            "--loading",
            loading,
            "--seed",
            str(seed),
        ]
        + (["--kinds", *kinds] if kinds else []),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_first_launches_in_fresh_processes_stall_no_rank() -> None:
    """Ten fresh processes per W, each launching torch's sleep kernel for the first time on its late rank, compiling a
    kernel there and allocating device memory there: with eager module loading no trial fails."""
    cells: dict[str, list[str]] = defaultdict(list)
    plan = [(world, (0, world // 2, world - 1)[k % 3], k) for world in WORLDS for k in range(FRESH_PROCESSES)]
    with ThreadPoolExecutor(4) as pool:  # four processes at a time share the GPU (its contexts time-slice)
        results = list(pool.map(lambda p: (p[0], _fresh(p[0], p[1], "eager", seed=p[2])), plan))
    for world, result in results:
        for kind, error in result.items():
            cells[f"W{world} first launch: {kind}"].append(error)
    _write("first_launch_eager", cells)
    failed = {c: r for c, r in cells.items() if any(r)}
    assert not failed, "first launches stalled ranks:\n" + _table(failed)


def test_a_cublas_kernels_first_launch_stalls_a_shared_context_even_with_eager_loading() -> None:
    """Why CONTRACT §7 asks ranks sharing a context to run every GEMM shape once before any boundary spins: cuBLAS
    loads a kernel at its first launch whatever CUDA_MODULE_LOADING says (its output allocated and its stream's
    workspace made beforehand), and that load waits for the peers' spinning grids (measured: 30 of 30 trials)."""
    errors = [_fresh(2, 1, "eager", seed=200 + k, kinds=("gemm",))["gemm"] for k in range(3)]
    _write("first_launch_cublas", {"W2 first launch: cuBLAS GEMM": errors})
    assert any(errors), (
        "a cuBLAS kernel's first launch stalled nothing: CONTRACT §7's warm-up rule rests on a stale fact"
    )
    assert all("gave up waiting" in e for e in errors if e), errors


def test_negative_control_lazy_loading_brings_the_stall_back() -> None:
    """The same first launches with CUDA's default lazy loading: a kernel loaded while a boundary spins stalls its
    peers to the timeout, in some process (once per process: at the first launch of a kernel not yet loaded)."""
    cells: dict[str, list[str]] = defaultdict(list)
    for k in range(3):
        for kind, error in _fresh(2, 1, "lazy", seed=100 + k).items():
            cells[f"W2 lazy first launch: {kind}"].append(error)
    _write("first_launch_lazy", cells)
    assert any(any(r) for r in cells.values()), "lazy loading stalled nothing: the fresh-process cells prove nothing"
    assert all("gave up waiting" in e for r in cells.values() for e in r if e), _table(cells)


def test_negative_control_a_rank_absent_past_the_timeout_is_reported() -> None:
    """A rank whose kernel ahead takes longer than the timeout is reported by every peer that waited for it."""
    world = 4
    ranks = BoundaryAllReduce.simulated(late_rank.HIDDEN, world, max_rows=64, device="cuda", timeout_us=50_000)
    warmup_every_protocol(ranks[0], late_rank.variants())
    delays = late_rank.Delays.calibrate()
    outcome = late_rank.trial(ranks, "oneshot", 2, lambda: delays.sleep(400.0), seed=7)
    assert outcome.late_ms > 50 and "gave up waiting for rank(s) [2]" in outcome.error, outcome
    assert late_rank.trial(ranks, "oneshot", 2, lambda: delays.sleep(5.0), seed=8).error == "", "after reset(): exact"


def _loading_case(flag: str) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "tests.module_loading_case", flag], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])["error"]


def test_warmup_loads_every_variant_onto_the_gpu() -> None:
    """In fresh processes with lazy loading, a rank launches its variant for the first time while its peer spins (a
    MoE boundary, the shared output on one rank only): after warmup() nothing stalls; the control, the same kernels
    compiled but never launched, stalls the peer to its timeout (the load waits for the spinning grid)."""
    states = {
        "after warmup()": [_loading_case("--warmup") for _ in range(2)],
        "control: never launched": [_loading_case("--not-loaded") for _ in range(2)],
    }
    _write("module_loading", states)
    assert states["after warmup()"] == ["", ""], states
    assert all("gave up waiting for rank(s) [1]" in e for e in states["control: never launched"]), states


def _toy_step_case(flag: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "tests.toy_step_case", flag], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_warmed_up_groups_decode_step_obtains_no_kernel_while_its_boundaries_spin() -> None:
    """In a fresh process, two simulated ranks warm up and run the toy decode step (1 and 4 rows, side streams on
    and off): the step obtains no kernel (none compiled, none loaded from disk) and no rank gives up. Each spelling of
    a compile call is one kernel (jit_cache's key): warmup's layer-input job and the call once spelled it two ways,
    and the call's second object loaded at its first launch while rank 0 spun. The control drops the layer-input
    kernels from memory after warmup: the step loads them from disk again, and rank 0 gives up on rank 1."""
    states = {"after warmup()": _toy_step_case("--warmup"), "control": _toy_step_case("--forget-layer-input")}
    _write("toy_step_loading", states)
    assert states["after warmup()"] == {"obtained": 0, "error": ""}, states
    control = states["control"]
    assert control["obtained"] > 0 and "gave up waiting for rank(s) [1]" in control["error"], states


def test_a_peer_kernel_never_loaded_raises_before_it_launches() -> None:
    """Simulated ranks share one context: a peer call of a variant warmup() never loaded raises NotLoadedError,
    naming warmup() and the variant, before anything launches (H 1536: no other test compiles it)."""
    from cute_kernels.boundary.api import NotLoadedError

    hidden, world = 1536, 2
    ranks = BoundaryAllReduce.simulated(hidden, world, max_rows=16, device="cuda", timeout_us=late_rank.TIMEOUT_US)
    inputs = sim_inputs = late_rank.sim.make_inputs(world, 4, hidden, "partial", seed=3)
    with pytest.raises(NotLoadedError, match=r"H=1536 x pre W=2 oneshot was never loaded .* call warmup\(\)"):
        late_rank.sim.call(ranks[0], inputs[0], "partial")
    torch.cuda.synchronize()
    assert int(ranks[0].workspace.state[0]) == 0, "nothing launched: the call counter never moved"
    for ar in ranks:
        ar.warmup(progress=False)
    outputs = BoundaryAllReduce.run_simulated(
        ranks, [lambda ar: late_rank.sim.call(ar, sim_inputs[ar.rank], "partial")] * world
    )
    torch.cuda.synchronize()
    late_rank.sim.check(outputs, inputs, "partial")
    for ar in ranks:
        ar.check()


@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("mode", ["oneshot", "twoshot", "staged", "moe"])
def test_a_rank_that_comes_after_its_peers_gave_up(world: int, mode: str) -> None:
    """The late rank's boundary runs after every peer's wait gave up (its pushes land in slots nobody waits on any
    more): the peers report it, reset() re-arms every rank, and the next boundary is exact on every rank."""
    ranks = BoundaryAllReduce.simulated(late_rank.HIDDEN, world, max_rows=512, device="cuda", timeout_us=30_000)
    warmup_every_protocol(ranks[0], late_rank.variants())
    late = world - 1
    outcome = late_rank.trial(ranks, mode, late, lambda: late_rank.time.sleep(0.2), seed=11)
    assert f"gave up waiting for rank(s) [{late}]" in outcome.error, outcome  # trial() has reset every rank
    for seed in range(12, 15):
        assert late_rank.trial(ranks, mode, late, lambda: None, seed=seed).error == "", f"after reset(), seed {seed}"


def _shared_gpu_case(*args: str) -> list[dict]:
    out = subprocess.run(
        [sys.executable, "-m", "tests.shared_gpu_case", "--connections", "32", "--steps", "4", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])["steps"]


@pytest.mark.parametrize(
    "case",
    [("--world", "8"), ("--world", "4", "--hidden", "7168", "--rows", "16")],
    ids=["W8-H5120-4rows", "W4-H7168-16rows"],
)
def test_simulated_ranks_leave_room_for_a_late_ranks_own_kernels(case: tuple[str, ...]) -> None:
    """Simulated ranks run eager toy steps (fixed sublayer outputs, side streams): with the shipped grid budget every
    step is clean and every rank has rank 0's bits; sized as in v23 (4 CTAs per SM among the ranks; the negative
    control) the steps stall to the timeout (v24: 4 of 4 at both shapes)."""
    clean, dense = _shared_gpu_case(*case), _shared_gpu_case(*case, "--shared-ctas-per-sm", "4")
    assert all(not s["stalled"] and s["ranks_differing"] == 0 for s in clean), (clean, dense)
    assert any(s["stalled"] for s in dense), f"the negative control did not stall: {dense}"
