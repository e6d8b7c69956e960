"""BoundaryAllReduce(early_loads=True) (CONTRACT §7): the boundary kernel issues its first row's streams and
coefficients before waiting for its predecessor grid (PDL). Where the precondition holds (they were complete before the
predecessor started) it gives the default kernel's bits in every mode, at one rank and on simulated ranks; where a
predecessor that triggers its dependents at its start writes the streams itself, it reads the old streams, which the
default kernel never does (the negative control: the test sees an early read)."""

from __future__ import annotations

import re

import pytest
import torch

from bench.experiments import ptx_snapshot
from boundary import BoundaryAllReduce
from cute_kernels.boundary import api
from cute_kernels.boundary.config import default_config
from cute_kernels.compile import arch_for_device
from tests.test_allreduce_gpu import MODES, call, make_inputs

PLAIN = "boundary_H1024_x_shared-0_pre-1_mxfp8-0_aux-0"


def test_the_early_kernel_issues_the_first_rows_loads_before_the_pdl_wait(tmp_path) -> None:
    """In the PTX, the default kernel loads only the norm weight (one 16-byte load a thread) before its
    `griddepcontrol.wait`; the early one also the first row's coefficient (one word a lane) and its 4 streams (16-byte
    loads): those loads move from after the wait to before it, and the partial's stays after it."""
    failed = ptx_snapshot.snapshot(tmp_path, ["sm_90a"], [1024], 16, 1, "forward", False, [1], [PLAIN])
    assert failed == 0

    def loads_around_the_wait(name: str) -> tuple[int, int]:
        ptx = (tmp_path / "sm_90a" / "raw" / f"{name}.ptx").read_text()
        body = ptx[ptx.index(".entry") :]
        before, after = body.split("griddepcontrol.wait", 1)
        return len(re.findall(r"ld\.global", before)), len(re.findall(r"ld\.global", after))

    plain, early = loads_around_the_wait(PLAIN), loads_around_the_wait(PLAIN + "_early-loads")
    moved = 1 + 4 * default_config(1024, "sm_90a").vecs_per_thread(1024)
    assert plain[0] == 1 and early[0] == plain[0] + moved
    assert early[1] == plain[1] - moved > 0


def test_the_flag_is_a_checked_bool_and_keys_its_own_kernels() -> None:
    """early_loads is a bool (a string is refused); an early boundary's calls and warmup ask for the early variants."""
    with pytest.raises(TypeError, match="^early_loads must be a bool"):
        BoundaryAllReduce(1024, device="cpu", early_loads="yes")
    assert BoundaryAllReduce(1024, device="cpu").early_loads is False
    assert api.variant_name(api.BoundaryVariant(early_loads=True)) == "x pre early-loads"
    assert all(v.early_loads for v in api.early(api.ENGINE_VARIANTS, True))
    assert api.early(api.early(api.ENGINE_VARIANTS, True), False) == api.ENGINE_VARIANTS


H = 4096


def _outputs(out) -> list[torch.Tensor]:
    return [t.clone() for t in out.tensors()]


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 16, 129])
@pytest.mark.parametrize("mode", MODES)
def test_early_loads_give_the_default_kernels_bits_at_one_rank(mode: str, rows: int) -> None:
    """Inputs complete before the call (the precondition): every mode, the default kernel's bits."""
    plain, early = (BoundaryAllReduce(H, max_rows=256, device="cuda", early_loads=e) for e in (False, True))
    (inp,) = make_inputs(1, rows, H, mode, seed=rows)
    want, got = _outputs(call(plain, inp, mode)), _outputs(call(early, inp, mode))
    assert len(want) == len(got) and all(torch.equal(a, b) for a, b in zip(want, got))


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4])
def test_early_loads_give_the_default_kernels_bits_on_simulated_ranks(world: int) -> None:
    """Simulated ranks (the peer kernels, unstaged and staged), warmed up, each mode: every rank's bits are the default
    ranks' bits."""
    sets = [BoundaryAllReduce.simulated(H, world, max_rows=64, device="cuda", early_loads=e) for e in (False, True)]
    for ranks in sets:
        ranks[0].warmup(64, quantize=("mxfp8",), progress=False)  # the ranks share one context: loaded for all
    for mode in MODES:
        for rows in (1, 64):
            inputs = make_inputs(world, rows, H, mode, seed=rows)
            results = []
            for ranks in sets:
                outs = BoundaryAllReduce.run_simulated(ranks, [lambda ar, p=p, m=mode: call(ar, p, m) for p in inputs])
                torch.cuda.synchronize()
                for ar in ranks:
                    ar.check()
                results.append([_outputs(o) for o in outs])
            for want, got in zip(*results):
                assert all(torch.equal(a, b) for a, b in zip(want, got)), (mode, rows)


@pytest.mark.gpu
def test_a_predecessor_that_writes_the_streams_and_triggers_early_shows_the_early_read() -> None:
    """The precondition broken, then kept. The streams are written by a PDL kernel that triggers its dependents at its
    start and writes them after a long weight read: the early boundary launched right after it returns the boundary of
    the old streams (it read them before its wait), the default one that of the new streams, in every trial. With a
    kernel between them that waits before it lets its dependents start, both return the new streams' boundary."""
    from bench.experiments.early_loads_ab import compile_last

    device = torch.device("cuda")
    writers = compile_last(arch_for_device(device))
    rows = 4
    g = torch.Generator(device=device).manual_seed(7)
    old = torch.randn(rows, 4, H, generator=g, device=device).bfloat16()
    new = torch.randn(rows, 4, H, generator=g, device=device).bfloat16()
    x = torch.randn(rows, H, generator=g, device=device).bfloat16()
    post = torch.rand(rows, 4, generator=g, device=device) + 0.5
    comb = torch.softmax(torch.randn(rows, 4, 4, generator=g, device=device), -1)
    pre = torch.softmax(torch.randn(rows, 4, generator=g, device=device), -1)
    weight = (torch.rand(H, generator=g, device=device) + 0.5).bfloat16()
    read_words = 64 * 2**20 // 4  # a 64 MB read on 8 CTAs: far longer than the boundary's launch after it
    words = torch.zeros(read_words + 64, dtype=torch.int32, device=device)
    sink = torch.zeros(64, dtype=torch.int32, device=device)
    plain, early = (BoundaryAllReduce(H, max_rows=rows, device=device, early_loads=e) for e in (False, True))

    def boundary(ar: BoundaryAllReduce, streams: torch.Tensor) -> list[torch.Tensor]:
        return [t.clone() for t in ar(x, streams, post, comb, pre, weight, 1e-6, None)]

    want_old, want_new = boundary(plain, old), boundary(plain, new)
    assert not torch.equal(want_old[0], want_new[0])
    assert all(torch.equal(a, b) for a, b in zip(boundary(early, new), want_new))  # warm: nothing loads in a trial

    def raced(ar: BoundaryAllReduce, between: bool) -> list[torch.Tensor]:
        streams = old.clone()
        torch.cuda.synchronize()
        writers["start"](words, new.view(rows * 4, H), streams.view(rows * 4, H), sink, 0, read_words, 8)
        if between:  # waits for the writer, lets its dependents start only when it ends
            writers["end"](words, x, torch.empty_like(x), sink, 0, 0, 1)
        got = boundary(ar, streams)
        torch.cuda.synchronize()
        assert torch.equal(streams, new)
        return got

    for _ in range(5):
        assert all(torch.equal(a, b) for a, b in zip(raced(early, between=False), want_old))
        assert all(torch.equal(a, b) for a, b in zip(raced(plain, between=False), want_new))
        assert all(torch.equal(a, b) for a, b in zip(raced(early, between=True), want_new))
