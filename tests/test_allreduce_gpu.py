"""The peer all-reduce inside the boundary (CONTRACT §7) on simulated ranks: W kernels sharing one GPU.

y must be the rank-order fp32 sum of the partials rounded once (exact, but for the sign of a zero),
every rank must get the very same bits, the slots must be reusable call after call with no host
work (CUDA graphs included), a late rank must not change a bit, a missing one must surface as an
error naming it, and the race test must fail with one buffer generation fewer.
"""

from __future__ import annotations

import itertools
import random
import time
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
import pytest
import torch
from torch import Tensor

from bench.allreduce import forced_protocol
from boundary import BoundaryAllReduce, empty_quantized_layer_input
from boundary import reference as ref
from cute_kernels.allreduce.peer import PeerReduce
from cute_kernels.allreduce.protocol import ERROR_MISSING, PROTOCOLS, SENTINEL_WORD
from cute_kernels.allreduce.tuning import oneshot_max_rows, protocols_up_to
from cute_kernels.boundary import api
from cute_kernels.boundary.config import default_config
from cute_kernels.boundary.kernel import FusedBoundaryKernel
from cute_kernels.compile import arch_for_device, warmup
from tests.bf16 import bitwise_equal, max_ulp, ordered, ulp_distance, within_contract

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

BF16, F32 = torch.bfloat16, torch.float32
EPS = 1e-6
TIMEOUT_US = 2_000_000  # a failing wait surfaces in 2 s, far above any skew these tests make
MODES = ("partial", "shared", "moe", "residual-only", "mxfp8", "aux", "mailbox")
WORLDS = (2, 4, 8)
HIDDEN = (2560, 4096, 5120, 7168)
TAIL_HIDDEN = 4352  # 2 CTAs of 288 threads for 272 vectors: 16 threads hold a clamped duplicate


MAX_ROWS = 512  # the simulated ranks' capacity


def protocol_rows(world: int, hidden: int) -> dict[str, int]:
    """Per protocol, the row count nearest the switch at (W, H) that the switch sends to it, within MAX_ROWS
    (where it sends none there, the largest: tests that name a protocol force it, `forcing`)."""
    limit = oneshot_max_rows(world, hidden)
    return {"oneshot": max(1, min(limit, MAX_ROWS)), "twoshot": min(limit + 1, MAX_ROWS)}


def unstaged_rows(world: int, hidden: int, rows: int, *, exact: bool = False) -> int:
    """At most `rows` rows whose call is unstaged at (W, H), one row per cluster (the cap of ranks sharing a GPU);
    `exact`: `rows` itself, which must be unstaged."""
    config = default_config(hidden, arch_for_device(torch.device("cuda")), world, world)
    fit = min(rows, config.max_clusters)
    assert not exact or fit == rows, f"{rows} rows at W {world}, H {hidden} take the staged kernel"
    return fit


def staged_rows(world: int, hidden: int) -> int:
    """A row count whose call is staged at (W, H): more rows than the clusters its launch takes."""
    config = default_config(hidden, arch_for_device(torch.device("cuda")), world, world)
    rows = min(2 * config.max_clusters + 1, MAX_ROWS)
    assert config.clusters(rows) < rows, "a staged call takes several rows per cluster"
    return rows


# Every boundary call in the block takes the protocol named, whatever the switch would pick (None: the switch's).
forcing = forced_protocol


# ---------------------------------------------------------------------------------------------
# Compile everything these tests launch once, in parallel, before the first test.


def _variant(mode: str) -> api.BoundaryVariant:
    return api.BoundaryVariant(
        "moe" if mode == "moe" else "x",
        mode in ("shared", "moe"),
        mode != "residual-only",
        mode == "mxfp8",
        mode == "aux",
    )


@pytest.fixture(scope="session", autouse=True)
def _compiled() -> None:
    arch = arch_for_device(torch.device("cuda"))
    jobs = []
    variants = sorted({_variant(m) for m in MODES})
    for world in WORLDS:
        for hidden in HIDDEN:
            jobs += api.warmup_jobs(hidden, arch=arch, world_size=world, ranks_per_device=world, variants=variants)
    for world in (2, 4):
        jobs += api.warmup_jobs(TAIL_HIDDEN, arch=arch, world_size=world, ranks_per_device=world, variants=variants)
    jobs += api.warmup_jobs(5120, arch=arch, variants=[_variant("moe")])
    warmup(jobs, desc="peer boundary kernels", device=torch.device("cuda"))


_RANKS: dict[tuple[int, int], list[BoundaryAllReduce]] = {}


def simulated(world: int, hidden: int) -> list[BoundaryAllReduce]:
    """The simulated ranks of (W, H), made once (their workspaces carry their call counters on)."""
    key = (world, hidden)
    if key not in _RANKS:
        ranks = BoundaryAllReduce.simulated(hidden, world, max_rows=MAX_ROWS, device="cuda", timeout_us=TIMEOUT_US)
        # Every kernel these tests launch runs once first, all ranks joined: a rank that loads a kernel (or
        # compiles it) on its first launch while its peers already wait delays them (CONTRACT §7, warm-up).
        # Each protocol inline (1 row) and at its row count nearest the switch (staged where that takes
        # several rows per cluster), and staged at the largest count.
        for mode in MODES:
            for protocol, rows in protocol_rows(world, hidden).items():
                for count in sorted({1, rows, MAX_ROWS}):
                    with forcing(ranks, protocol):
                        run(ranks, make_inputs(world, count, hidden, mode, seed=0), mode)
        torch.cuda.synchronize()
        no_errors(ranks)
        _RANKS[key] = ranks
    return _RANKS[key]


# ---------------------------------------------------------------------------------------------
# Inputs, one set per rank, and the reference.


@dataclass
class RankInputs:
    """One rank's boundary inputs: its partial (x, or the MoE output), and the shared streams and mixes."""

    x: Tensor | None
    shared: Tensor | None
    moe: tuple[Tensor, Tensor, Tensor] | None
    residual: Tensor
    post: Tensor
    comb: Tensor
    pre: Tensor
    w: Tensor

    def partial(self) -> Tensor:
        """This rank's partial as the contract defines it."""
        if self.moe is not None:
            return ref.moe_finalize(*self.moe, self.shared)
        return ref.add_shared(self.x, self.shared)


def make_inputs(world: int, rows: int, hidden: int, mode: str, seed: int) -> list[RankInputs]:
    """Per-rank partials of realistic magnitude; the streams and mixes are the same on every rank (TP)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=gen, device="cuda")

    residual = randn(rows, 4, hidden).to(BF16)
    post = torch.rand(rows, 4, generator=gen, device="cuda") * 2
    comb = torch.softmax(randn(rows, 4, 4), dim=-1)
    pre = torch.rand(rows, 4, generator=gen, device="cuda")
    w = (1 + 0.1 * randn(hidden)).to(BF16)
    out = []
    for _ in range(world):
        x = shared = moe = None
        if mode == "moe":
            top_k, experts = 6, rows * 6
            gemm2 = randn(experts, hidden).to(BF16)
            weights = torch.rand(rows, top_k, generator=gen, device="cuda") / top_k
            idx = torch.randperm(experts, generator=gen, device="cuda")[: rows * top_k].view(rows, top_k)
            idx = torch.where(torch.rand(rows, top_k, generator=gen, device="cuda") < 0.25, -1, idx).to(torch.int32)
            moe = (gemm2, weights, idx)
            shared = (0.5 * randn(rows, hidden)).to(BF16)
        else:
            x = randn(rows, hidden).to(BF16)
            if mode == "shared":
                shared = (0.5 * randn(rows, hidden)).to(BF16)
        out.append(RankInputs(x, shared, moe, residual, post, comb, pre, w))
    return out


@dataclass
class RankOutputs:
    """What one rank's boundary returned or wrote."""

    residual: Tensor
    out: Tensor | None
    q: object | None
    aux: Tensor | None

    def tensors(self) -> list[Tensor]:
        parts = [self.residual]
        if self.out is not None:
            parts.append(self.out)
        if self.q is not None:
            parts += [self.q.data.view(torch.uint8), self.q.scale]
        if self.aux is not None:
            parts.append(self.aux)
        return parts


def call(ar: BoundaryAllReduce, inp: RankInputs, mode: str) -> RankOutputs:
    """One boundary call of `mode` on rank `ar` (on the current stream)."""
    rows, hidden = inp.residual.shape[0], inp.residual.shape[2]
    pre, w = (None, None) if mode == "residual-only" else (inp.pre, inp.w)
    q = empty_quantized_layer_input(rows, hidden, "cuda") if mode == "mxfp8" else None
    aux = torch.empty(rows, hidden, dtype=BF16, device="cuda") if mode == "aux" else None
    if mode == "moe":
        new, out = ar.finalize(*inp.moe, inp.shared, inp.residual, inp.post, inp.comb, pre, w, EPS, q, aux_out=aux)
    else:
        x = inp.x
        if mode == "mailbox":
            x = ar.mailbox(rows)
            x.copy_(inp.x)
        new, out = ar(x, inp.residual, inp.post, inp.comb, pre, w, EPS, q, shared_output=inp.shared, aux_out=aux)
    return RankOutputs(new, out, q, aux)


def run(ranks: list[BoundaryAllReduce], inputs: list[RankInputs], mode: str) -> list[RankOutputs]:
    """Every rank's call, issued on its own stream before any is waited for."""
    return BoundaryAllReduce.run_simulated(
        ranks, [lambda ar, i=i: call(ar, inputs[i], mode) for i in range(len(ranks))]
    )


def expected_y(inputs: list[RankInputs]) -> Tensor:
    """CONTRACT §2 step 1: the rank-order fp32 sum of the partials, one bf16 rounding."""
    return ref.rank_sum([inp.partial() for inp in inputs])


def streams_outside_the_bound(new: Tensor, y: Tensor, inp: RankInputs) -> int:
    """How many elements of R' miss their float64 value by more than the contract's bound (1 ulp + the fp32
    reassociation bound: the peer kernels of a ready partial add in another order than the reference, CONTRACT §2)."""
    y64, r64 = y.to(torch.float64), inp.residual.to(torch.float64)
    post, comb = inp.post.to(torch.float64), inp.comb.to(torch.float64)
    exact = post[:, :, None] * y64[:, None, :] + torch.einsum("tkj,tkh->tjh", comb, r64)
    terms = (post[:, :, None] * y64[:, None, :]).abs() + torch.einsum("tkj,tkh->tjh", comb.abs(), r64.abs())
    return int((~within_contract(new, exact, terms)).sum())


def assert_streams(new: Tensor, y: Tensor, inp: RankInputs) -> None:
    """R' against its float64 value with the contract's bound."""
    outside = streams_outside_the_bound(new, y, inp)
    assert outside == 0, f"{outside} new-stream elements outside the contract's bound"


def check(outputs: list[RankOutputs], inputs: list[RankInputs], mode: str) -> None:
    """Every rank's bits are rank 0's; rank 0 against the reference (the epilogue on its own R')."""
    for r, res in enumerate(outputs[1:], start=1):
        for got, want in zip(res.tensors(), outputs[0].tensors(), strict=True):
            assert bitwise_equal(got, want), f"rank {r} differs from rank 0"
    res, inp = outputs[0], inputs[0]
    assert_streams(res.residual, expected_y(inputs), inp)
    if res.out is not None:
        want = ref.rms_norm(ref.collapse(res.residual, inp.pre), inp.w, EPS)
        dist = ulp_distance(res.out, want)
        assert int(dist.max()) <= 1 and float((dist != 0).float().mean()) < 0.02
    if res.q is not None:
        data, scale = ref.mxfp8_quantize(res.out)
        assert bitwise_equal(res.q.scale, scale) and torch.equal(res.q.data.view(torch.uint8), data.view(torch.uint8))
    if res.aux is not None:
        assert max_ulp(res.aux, ref.mean_of_streams(res.residual)) <= 1


def no_errors(ranks: list[BoundaryAllReduce]) -> None:
    for ar in ranks:
        ar.check()


# ---------------------------------------------------------------------------------------------
# Against the reference, every rank identical.


@pytest.mark.parametrize("protocol", ["oneshot", "twoshot"])
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("world", WORLDS)
def test_matches_the_reference_on_every_rank(world: int, hidden: int, protocol: str) -> None:
    ranks = simulated(world, hidden)
    assert all(ar.path == "peer" and ar.simulated_ranks for ar in ranks)
    for rows in sorted({1, 37, protocol_rows(world, hidden)[protocol], MAX_ROWS}):
        for mode in ("partial", "moe"):
            inputs = make_inputs(world, rows, hidden, mode, seed=rows * 31 + world)
            with forcing(ranks, protocol):
                check(run(ranks, inputs, mode), inputs, mode)
    no_errors(ranks)


# Each mode at every H, the world size rotating with the mode, so that each mode also meets every world size.
EVERY_MODE = [
    (mode, WORLDS[(i + k) % len(WORLDS)], hidden) for i, mode in enumerate(MODES) for k, hidden in enumerate(HIDDEN)
]


@pytest.mark.parametrize(("mode", "world", "hidden"), EVERY_MODE)
def test_every_mode(world: int, hidden: int, mode: str) -> None:
    """Rows 1 (inline, one-shot), 16 (W 4: one-shot, W 8: two-shot; staged where 16 passes the ranks' cluster cap), 129
    and 512 (staged)."""
    ranks = simulated(world, hidden)
    for rows in (1, 16, 129, 512):
        inputs = make_inputs(world, rows, hidden, mode, seed=rows + 7)
        check(run(ranks, inputs, mode), inputs, mode)
    no_errors(ranks)


@pytest.mark.parametrize("world", WORLDS)
def test_every_row_count_up_to_512(world: int) -> None:
    """Rows 1..512 (every count up to 40, then a stride), the switch's choice at each, and where the switch
    picks one protocol alone (W 2), the other one forced too: both protocols and every ownership pattern run."""
    hidden = 4096
    ranks = simulated(world, hidden)
    protocols = [None] + [p for p in PROTOCOLS if p not in protocols_up_to(world, hidden, MAX_ROWS)]
    for rows in list(range(1, 41)) + list(range(41, 513, 23)) + [512]:
        for protocol in protocols:
            inputs = make_inputs(world, rows, hidden, "partial", seed=rows)
            with forcing(ranks, protocol):
                check(run(ranks, inputs, "partial"), inputs, "partial")
    no_errors(ranks)


def first_rows(inp: RankInputs, rows: int) -> RankInputs:
    """The inputs of `inp`'s first `rows` rows (a ready partial)."""
    shared = None if inp.shared is None else inp.shared[:rows]
    return RankInputs(
        inp.x[:rows], shared, None, inp.residual[:rows], inp.post[:rows], inp.comb[:rows], inp.pre[:rows], inp.w
    )


@pytest.mark.parametrize("hidden", (4096, 7168))
@pytest.mark.parametrize("world", WORLDS)
def test_a_rows_bits_depend_on_neither_the_row_count_nor_the_protocol(world: int, hidden: int) -> None:
    """Batch invariance on the peer path: the first rows of a call come out bit for bit the same in a call of 1, 16
    or 512 rows (inline and staged schedules) under either protocol, in the modes whose epilogue order the peer
    kernel chooses (CONTRACT §2: it mixes the streams before y is in)."""
    ranks = simulated(world, hidden)
    for mode in ("partial", "shared", "aux"):
        full = make_inputs(world, MAX_ROWS, hidden, mode, seed=world * 7 + hidden)
        runs = []
        for rows in (1, 16, MAX_ROWS):
            for protocol in PROTOCOLS:
                with forcing(ranks, protocol):
                    runs.append((rows, protocol, run(ranks, [first_rows(inp, rows) for inp in full], mode)))
        want = runs[-1][2][0]
        for rows, protocol, outputs in runs:
            for r, res in enumerate(outputs):
                for got, full_rows in zip(res.tensors(), want.tensors(), strict=True):
                    assert bitwise_equal(got, full_rows[:rows]), f"{mode}: rank {r}, {rows} rows, {protocol}"
    no_errors(ranks)


@pytest.mark.parametrize("protocol", ["oneshot", "twoshot"])
@pytest.mark.parametrize("world", (2, 4))
def test_threads_past_the_chunk_push_and_store_nothing(world: int, protocol: str) -> None:
    """H 4352: the last vector of some threads is a clamped duplicate of a real one; it must never be pushed,
    polled, re-armed or stored, inline or staged."""
    ranks = simulated(world, TAIL_HIDDEN)
    config = default_config(TAIL_HIDDEN, ranks[0].arch, world, world)
    assert config.threads * config.cluster_n * 8 > TAIL_HIDDEN, "the shape must have threads past the chunk"
    staged = 2 * config.max_clusters + 1
    assert config.clusters(staged) < staged and config.clusters(8) == 8
    for rows in (1, 8, staged):
        for mode in ("partial", "mxfp8"):
            inputs = make_inputs(world, rows, TAIL_HIDDEN, mode, seed=rows + 17)
            with forcing(ranks, protocol):
                check(run(ranks, inputs, mode), inputs, mode)
    no_errors(ranks)


# ---------------------------------------------------------------------------------------------
# y exactly: with post = 1 and comb = 0 every new stream is y itself.


def _y_visible(inputs: list[RankInputs]) -> None:
    for inp in inputs:
        inp.post.fill_(1.0)
        inp.comb.zero_()


def assert_y(outputs: list[RankOutputs], inputs: list[RankInputs]) -> None:
    """Every stream of every rank equals the rank-order sum bit for bit (a zero's sign aside)."""
    y = expected_y(inputs)
    for r, res in enumerate(outputs):
        for j in range(4):
            got = res.residual[:, j]
            assert torch.equal(ordered(got), ordered(y)), f"rank {r} stream {j}: y is not the rank-order sum"
    for res in outputs[1:]:
        assert bitwise_equal(res.residual, outputs[0].residual)


@pytest.mark.parametrize("protocol", ["oneshot", "twoshot"])
@pytest.mark.parametrize("world", WORLDS)
def test_sums_exact_in_any_order(world: int, protocol: str) -> None:
    """Small integers: every order gives the same sum, so this checks the values alone (nccl-tests' idea); at the row
    count nearest the switch (staged where it passes the ranks' cluster cap) and staged."""
    hidden = 5120
    ranks = simulated(world, hidden)
    for rows in sorted({protocol_rows(world, hidden)[protocol], staged_rows(world, hidden)}):
        inputs = make_inputs(world, rows, hidden, "partial", seed=3)
        gen = torch.Generator(device="cuda").manual_seed(5)
        for inp in inputs:
            inp.x = torch.randint(-64, 65, (rows, hidden), generator=gen, device="cuda").to(BF16)
        _y_visible(inputs)
        with forcing(ranks, protocol):
            assert_y(run(ranks, inputs, "partial"), inputs)


@pytest.mark.parametrize("protocol", ["oneshot", "twoshot"])
@pytest.mark.parametrize("world", (4, 8))
def test_order_sensitive_sums(world: int, protocol: str) -> None:
    """2^24, 1, -2^24, 1, ... rotated over the columns: fp32 gives a different sum for each order, and only
    rank order 0..W-1 matches the reference (the 1 after 2^24 is lost, the last one is not); inline and
    staged."""
    hidden = 4096
    ranks = simulated(world, hidden)
    for rows in sorted({protocol_rows(world, hidden)[protocol], staged_rows(world, hidden)}):
        inputs = make_inputs(world, rows, hidden, "partial", seed=4)
        pattern = torch.tensor([2.0**24, 1.0, -(2.0**24), 1.0] + [0.5] * (world - 4), device="cuda")
        cols = torch.arange(hidden, device="cuda")
        for r, inp in enumerate(inputs):
            inp.x = pattern[(r + cols) % world].expand(rows, hidden).to(BF16).contiguous()
        _y_visible(inputs)
        y = expected_y(inputs)
        assert bool((y.float().abs() < 2.0**23).any()), "the inputs must cancel somewhere to be order-sensitive"
        with forcing(ranks, protocol):
            assert_y(run(ranks, inputs, "partial"), inputs)


@pytest.mark.parametrize("protocol", ["oneshot", "twoshot"])
@pytest.mark.parametrize("world", WORLDS)
def test_negative_zero_and_sentinel_valued_partials(world: int, protocol: str) -> None:
    """Partials that hold -0.0, and the sentinel's very bit pattern (a +0.0 beside a -0.0) in every word, from
    a tensor and through the mailbox, inline and staged: the sums stay exact and every rank gets the same bits."""
    hidden = 4096
    ranks = simulated(world, hidden)
    counts = sorted({max(protocol_rows(world, hidden)[protocol], 4), staged_rows(world, hidden)})
    for rows, mode in itertools.product(counts, ("partial", "mailbox")):
        inputs = make_inputs(world, rows, hidden, mode, seed=6)
        sentinel = torch.full((rows, hidden // 2), SENTINEL_WORD - (1 << 32), dtype=torch.int32, device="cuda")
        for r, inp in enumerate(inputs):
            inp.x[0] = -0.0  # a row of -0.0 on every rank: y is a zero
            inp.x[1] = sentinel[1].view(BF16)  # the sentinel pattern on every rank
            if r == world - 1:
                inp.x[2] = sentinel[2].view(BF16)  # on one rank only, beside real values
            # Row 3: the sentinel word on rank 0, (1.0, -0.0) pairs on the others: the high halves sum to
            # +0.0 only if rank 0 sums its own word in canonical form, as its peers receive it. The -0.0
            # streams keep the sign of a zero y in R' (post 1, comb 0), so that every rank's bits show it.
            other = torch.full((hidden // 2,), 0x80003F80 - (1 << 32), dtype=torch.int32, device="cuda")
            inp.x[3] = sentinel[3].view(BF16) if r == 0 else other.view(BF16)
        inputs[0].residual[3] = -0.0
        _y_visible(inputs)
        with forcing(ranks, protocol):
            assert_y(run(ranks, inputs, mode), inputs)
    no_errors(ranks)


# ---------------------------------------------------------------------------------------------
# Reuse: consecutive boundaries with no host work between them, and graph replays.


@pytest.mark.parametrize("world", WORLDS)
def test_consecutive_boundaries_without_host_sync(world: int) -> None:
    """40 boundaries back to back on every rank's stream (each rank runs ahead as far as its peers let it),
    switching protocols (the switch's choice, and each forced in turn), modes and row counts, inline and
    staged, then one check of them all."""
    hidden = 5120
    ranks = simulated(world, hidden)
    plan = [(rows, mode) for rows in (1, 16, 129, 512, 3) for mode in ("partial", "moe", "residual-only", "shared")]
    plan = (plan * 2)[:40]
    protocols = [(None, "twoshot", "oneshot")[k % 3] for k in range(len(plan))]
    sets = [make_inputs(world, rows, hidden, mode, seed=100 + k) for k, (rows, mode) in enumerate(plan)]

    def one(ar: BoundaryAllReduce, k: int) -> RankOutputs:
        with forcing([ar], protocols[k]):
            return call(ar, sets[k][ar.rank], plan[k][1])

    def many(ar: BoundaryAllReduce) -> list[RankOutputs]:
        return [one(ar, k) for k in range(len(plan))]

    results = BoundaryAllReduce.run_simulated(ranks, [many] * world)
    torch.cuda.synchronize()
    wrong = []
    for k, (rows, mode) in enumerate(plan):
        try:
            check([results[r][k] for r in range(world)], sets[k], mode)
        except AssertionError as exc:
            wrong.append((k, rows, mode, str(exc).splitlines()[0]))
    states = [ar.workspace.state.tolist() for ar in ranks]
    errors = [ar.workspace.error.tolist() for ar in ranks]
    assert not wrong, f"{len(wrong)} of {len(plan)} calls wrong, first {wrong[:3]}; states {states}; errors {errors}"
    no_errors(ranks)


def test_ten_thousand_graph_replays_with_inputs_changed_in_place() -> None:
    world, hidden = 4, 7168
    ranks = simulated(world, hidden)
    # One-shot inline (up to 16 rows, one per cluster), two-shot staged (several rows per cluster).
    for rows, protocol in ((unstaged_rows(world, hidden, 16), "oneshot"), (staged_rows(world, hidden), "twoshot")):
        inputs = make_inputs(world, rows, hidden, "mxfp8", seed=11)
        with forcing(ranks, protocol):
            run(ranks, inputs, "mxfp8")  # outside the capture: allocations settle
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
                outputs = run(ranks, inputs, "mxfp8")
        replays = 0
        for seed in range(5):
            fresh = make_inputs(world, rows, hidden, "mxfp8", seed=200 + seed)
            for inp, new in zip(inputs, fresh):
                for name in ("x", "residual", "post", "comb", "pre", "w"):
                    getattr(inp, name).copy_(getattr(new, name))
            for _ in range(2000):
                graph.replay()
                replays += 1
            torch.cuda.synchronize()
            check(outputs, inputs, "mxfp8")
        assert replays == 10_000
        no_errors(ranks)
        del graph


# ---------------------------------------------------------------------------------------------
# Skew: late ranks change no bit; a missing rank is an error naming it; one generation fewer fails.


@pytest.mark.parametrize("protocol", ["oneshot", "twoshot"])
@pytest.mark.parametrize("world", (2, 4))
def test_a_rank_delayed_on_the_device_before_its_push(world: int, protocol: str) -> None:
    hidden = 4096
    ranks = simulated(world, hidden)
    inline = unstaged_rows(world, hidden, 8)
    plan = [(rows, late) for rows in (inline, staged_rows(world, hidden)) for late in range(world)]
    for rows, late in plan:
        inputs = make_inputs(world, rows, hidden, "partial", seed=late)

        def delayed(ar: BoundaryAllReduce, late: int = late, inputs: list = inputs) -> RankOutputs:
            if ar.rank == late:
                torch.cuda._sleep(2_000_000)  # ~1 ms of device time before its boundary starts
            return call(ar, inputs[ar.rank], "partial")

        with forcing(ranks, protocol):
            check(BoundaryAllReduce.run_simulated(ranks, [delayed] * world), inputs, "partial")
    no_errors(ranks)


def test_random_host_sleeps_between_the_ranks_calls() -> None:
    """Each rank's call issued after a random host pause (up to 20 ms) while its peers already wait."""
    world, hidden = 4, 5120
    ranks = simulated(world, hidden)
    rng = random.Random(0)
    for trial in range(12):
        rows = (1, 16, 200)[trial % 3]
        inputs = make_inputs(world, rows, hidden, "partial", seed=300 + trial)

        def slept(ar: BoundaryAllReduce, inputs: list = inputs) -> RankOutputs:
            time.sleep(rng.uniform(0.0, 0.02))
            return call(ar, inputs[ar.rank], "partial")

        check(BoundaryAllReduce.run_simulated(ranks, [slept] * world), inputs, "partial")
    no_errors(ranks)


@pytest.mark.parametrize(
    ("world", "protocol", "staged"),
    [
        (2, "oneshot", False),
        (4, "oneshot", False),
        (4, "twoshot", False),
        (4, "oneshot", True),
        (4, "twoshot", True),
        (8, "twoshot", False),
    ],
)
def test_a_rank_that_never_arrives_is_named_and_the_process_stays_usable(
    world: int, protocol: str, staged: bool
) -> None:
    """Only rank 0 calls: every wait gives up by its deadline (two-shot: the wait for y too, half a timeout later),
    check() names every rank it waited for, and after a reset the ranks run on, exact."""
    hidden = 4096
    ranks = BoundaryAllReduce.simulated(hidden, world, max_rows=MAX_ROWS, device="cuda", timeout_us=20_000)
    rows = staged_rows(world, hidden) if staged else unstaged_rows(world, hidden, 8)
    with forcing(ranks, protocol):
        inputs = make_inputs(world, rows, hidden, "partial", seed=9)
        check(run(ranks, inputs, "partial"), inputs, "partial")  # every rank once: the kernel is loaded
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.cuda.stream(ranks[0].stream):
            call(ranks[0], inputs[0], "partial")  # the other ranks never call
        torch.cuda.synchronize()
        assert time.perf_counter() - start < 5.0, "the waits are bounded by the timeout"
        missing = ", ".join(str(r) for r in range(1, world))
        with pytest.raises(RuntimeError, match=rf"rank 0: the boundary gave up waiting for rank\(s\) \[{missing}\]"):
            ranks[0].check()
        with pytest.raises(RuntimeError, match="reset"):
            ranks[0].check()  # stays reported until the reset
        for ar in ranks:
            ar.reset()
        for seed in range(3):
            inputs = make_inputs(world, rows, hidden, "partial", seed=seed)
            check(run(ranks, inputs, "partial"), inputs, "partial")
    no_errors(ranks)


def test_each_ranks_own_graph_replayed_after_random_host_sleeps() -> None:
    """Each rank replays its own CUDA graph (as a rank of W processes would), after a random host pause of up to
    20 ms while the ranks replayed before it already wait; the inputs change in place between rounds."""
    world, hidden = 4, 5120
    ranks = simulated(world, hidden)
    rng = random.Random(1)
    for rows in (1, 16, 200):
        inputs = make_inputs(world, rows, hidden, "partial", seed=400 + rows)
        graphs, outputs = [], []
        for ar in ranks:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=ar.stream):
                outputs.append(call(ar, inputs[ar.rank], "partial"))
            graphs.append(graph)
        for trial in range(6):
            fresh = make_inputs(world, rows, hidden, "partial", seed=500 + 10 * rows + trial)
            for inp, new in zip(inputs, fresh, strict=True):
                inp.x.copy_(new.x)
            torch.cuda.synchronize()
            for r in rng.sample(range(world), world):
                time.sleep(rng.uniform(0.0, 0.02))
                with torch.cuda.stream(ranks[r].stream):
                    graphs[r].replay()
            torch.cuda.synchronize()
            check(outputs, inputs, "partial")
    no_errors(ranks)


class _Stalled(PeerReduce):
    """Rank 0 stalls ~60 us before each round of slot loads (those issued ahead of a wait, with a staged row's
    other loads or a window of owned rows, too), before each wait and before each re-arm, so rank 1 runs one
    call ahead of it and pushes into slots rank 0 has not read or re-armed yet."""

    @cute.jit
    def stall(self, ctx):
        if ctx.peer.rank == 0:
            until = cute.arch.globaltimer() + 60_000
            while cute.arch.globaltimer() < until:
                pass

    @cute.jit
    def issue(self, ctx, rIn: cute.Tensor, row: cutlass.Int32, sources: list):
        self.stall(ctx)
        PeerReduce.issue(self, ctx, rIn, row, sources)

    @cute.jit
    def wait(self, ctx, rIn: cute.Tensor, row: cutlass.Int32, sources: list, deadline: cutlass.Int64, pending=None):
        self.stall(ctx)
        PeerReduce.wait(self, ctx, rIn, row, sources, deadline, pending)

    @cute.jit
    def rearm(self, ctx, row: cutlass.Int32, sources: list):
        self.stall(ctx)
        PeerReduce.rearm(self, ctx, row, sources)


class _OneGeneration(_Stalled):
    """The negative control: the same, with one slot generation where the protocol needs two."""

    generations = 1


def _stalled_kernel(role: type, hidden: int, world: int, protocol: str, staged: bool, arch: str):
    variant = api.BoundaryVariant("x", False, True, False, False)
    config = default_config(hidden, arch, world, world)
    kernel = FusedBoundaryKernel(hidden, config, world_size=world, protocol=protocol, staged=staged)
    kernel.attach_allreduce(role(hidden, world, protocol, kernel.vpt, kernel.cluster_n, staged=staged))
    return api.compile_boundary_kernel(kernel, hidden, variant, world, arch=arch)


def _race(role: type, protocol: str, rows: int | list[int], world: int = 2) -> tuple[int, bool]:
    """20 stalled boundaries back to back on `world` fresh ranks, call k of rows[k % len(rows)] rows (one
    kernel: every count must be staged, or none): (wrong calls, whether a wait gave up)."""
    hidden, calls = 4096, 20
    counts = rows if isinstance(rows, list) else [rows]
    ranks = BoundaryAllReduce.simulated(hidden, world, max_rows=256, device="cuda", timeout_us=50_000)
    config = default_config(hidden, ranks[0].arch, world, world)
    staged = {config.clusters(n) < n for n in counts}
    assert len(staged) == 1, "one kernel: every row count staged, or none"
    fn = _stalled_kernel(role, hidden, world, protocol, staged.pop(), ranks[0].arch)
    sets = [make_inputs(world, counts[k % len(counts)], hidden, "partial", seed=500 + k) for k in range(calls)]

    def many(ar: BoundaryAllReduce) -> list[Tensor]:
        ws, outs = ar.workspace, []
        for k in range(calls):
            inp = sets[k][ar.rank]
            new = torch.empty_like(inp.residual)
            out = torch.empty(inp.residual.shape[0], hidden, dtype=BF16, device="cuda")
            fn(
                *api.BoundaryArgs(
                    residual=inp.residual,
                    post=inp.post,
                    comb=inp.comb,
                    pre=inp.pre,
                    norm_weight=inp.w,
                    x=inp.x,
                    new_residual=new,
                    out=out,
                    slots=ws.slots,
                    peers=ws.peers,
                    state=ws.state,
                    error=ws.error,
                    eps=EPS,
                )
            )
            outs.append(new)
        return outs

    results = BoundaryAllReduce.run_simulated(ranks, [many] * world)
    torch.cuda.synchronize()
    wrong = 0
    for k in range(calls):
        y = expected_y(sets[k])
        if any(streams_outside_the_bound(results[r][k], y, sets[k][r]) for r in range(world)):
            wrong += 1
    gave_up = any(int(ar.workspace.error[ERROR_MISSING]) != 0 for ar in ranks)
    return wrong, gave_up


# One-shot and two-shot, each inline (4 rows: one per cluster) and staged (200 rows: several per cluster).
@pytest.mark.parametrize(("protocol", "rows"), [("oneshot", 4), ("twoshot", 4), ("oneshot", 200), ("twoshot", 200)])
def test_the_race_test_passes_with_two_generations_and_fails_with_one(protocol: str, rows: int) -> None:
    clusters = default_config(4096, arch_for_device(torch.device("cuda")), 2, 2).clusters(rows)
    assert (rows > clusters) == (rows == 200), "the staged case must take several rows per cluster"
    wrong, gave_up = _race(_Stalled, protocol, rows)
    assert wrong == 0 and not gave_up, "two generations must survive a rank that runs a call ahead"
    wrong, gave_up = _race(_OneGeneration, protocol, rows)
    assert wrong > 0 or gave_up, "the negative control did not fail: the race test cannot detect a lost generation"


def test_the_race_test_with_two_shot_owners_moving_between_calls() -> None:
    """W 4, staged two-shot, calls whose cluster counts differ, so that a segment's owner moves from call to call
    (protocol.segment_owner) while rank 0 runs behind: two generations survive it, one does not."""
    config = default_config(4096, arch_for_device(torch.device("cuda")), 4, 4)
    rows = [2 * (config.max_clusters - k) for k in range(4)]  # two rows per cluster, 4 cluster counts
    assert len({config.clusters(n) for n in rows}) == len(rows), "the cluster counts must differ"
    assert all(config.clusters(n) < n for n in rows), "every call must be staged"
    wrong, gave_up = _race(_Stalled, "twoshot", rows, world=4)
    assert wrong == 0 and not gave_up, "two generations must survive owners that move while a rank runs behind"
    wrong, gave_up = _race(_OneGeneration, "twoshot", rows, world=4)
    assert wrong > 0 or gave_up, "the negative control did not fail: the race test cannot detect a lost generation"


# ---------------------------------------------------------------------------------------------
# MoE indices outside [-1, P): no expert, and the error word names the row.


@pytest.mark.parametrize("world", (1, 2))
def test_a_moe_index_outside_the_rows_is_no_expert_and_reported(world: int) -> None:
    hidden, rows = 5120, 6
    if world == 1:
        ranks = [BoundaryAllReduce(hidden, max_rows=64, device="cuda")]
    else:
        ranks = simulated(world, hidden)
    inputs = make_inputs(world, rows, hidden, "moe", seed=13)
    experts = inputs[0].moe[0].shape[0]
    clean = []
    for inp in inputs:
        clean.append(inp.moe[2].clone())
        inp.moe[2][4, 1] = experts + 1000  # far past gemm2_permuted: never read
        inp.moe[2][2, 0] = -7
    if world == 1:
        outputs = [call(ranks[0], inputs[0], "moe")]
        torch.cuda.synchronize()
    else:
        outputs = run(ranks, inputs, "moe")
    for inp, idx in zip(inputs, clean):
        idx[4, 1] = -1
        idx[2, 0] = -1
        inp.moe = (inp.moe[0], inp.moe[1], idx)
    check(outputs, inputs, "moe")
    for ar in ranks:
        with pytest.raises(ValueError, match=rf"rank {ar.rank}: .* held -?\d+ in row [24], outside \[-1, P\)"):
            ar.check()
        ar.check()  # reported once
