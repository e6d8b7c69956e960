"""Boundaries.final (CONTRACT §4c): the residual-only reduction of the last MoE, the collapse with state.pre and the
final RMSNorm, against the reference at W = 1 and on gloo ranks, for every form of the pending output."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from boundary import Boundaries, BoundaryAllReduce, BoundaryState, MoEOutput, UnfinalizedMoEOutput
from boundary import reference as ref
from boundary.demo import file_rendezvous
from tests.bf16 import bitwise_equal

BF16 = torch.bfloat16
HIDDEN = 512


def state_with(form: str, rows: int, seed: int) -> tuple[BoundaryState, torch.Tensor]:
    """A state whose pending output has `form`, and the rank's partial that it stands for (rank-order sum pending)."""
    g = torch.Generator().manual_seed(seed)
    residual = torch.randn(rows, 4, HIDDEN, generator=g).to(BF16)
    post = torch.rand(rows, 4, generator=g) * 2
    comb = torch.softmax(torch.randn(rows, 4, 4, generator=g), -1)
    pre = torch.rand(rows, 4, generator=g)
    x = torch.randn(rows, HIDDEN, generator=g).to(BF16)
    shared = torch.randn(rows, HIDDEN, generator=g).to(BF16)
    permuted = torch.randn(2 * rows + 1, HIDDEN, generator=g).to(BF16)
    weights = torch.rand(rows, 2, generator=g)
    idx = torch.randint(-1, permuted.shape[0], (rows, 2), generator=g, dtype=torch.int32)
    if form == "tensor":
        pending, partial = x, x
    elif form == "routed+shared":
        pending, partial = MoEOutput(x, shared), ref.add_shared(x, shared)
    elif form == "unfinalized+shared":
        pending = MoEOutput(UnfinalizedMoEOutput(permuted, weights, idx), shared)
        partial = ref.moe_finalize(permuted, weights, idx, shared)
    else:
        pending = MoEOutput(UnfinalizedMoEOutput(permuted, weights, idx), None)
        partial = ref.moe_finalize(permuted, weights, idx, None)
    return BoundaryState(residual, post, comb, pre, pending), partial


FORMS = ["tensor", "routed+shared", "unfinalized+shared", "unfinalized"]


def final_norm(seed: int = 9) -> torch.Tensor:
    return (1 + 0.1 * torch.randn(HIDDEN, generator=torch.Generator().manual_seed(seed))).to(BF16)


def expected(state: BoundaryState, y: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """CONTRACT §4c from the reference's steps: RMSNorm(collapse(R', state.pre)) with R' the residual-only boundary."""
    streams = ref.mhc_post(y, state.residual, state.post, state.comb)
    return ref.rms_norm(ref.collapse(streams, state.pre), weight, eps)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("rows", [1, 5])
def test_final_is_post_only_then_collapse_and_norm(form: str, rows: int) -> None:
    b = Boundaries(BoundaryAllReduce(HIDDEN, max_rows=8, device="cpu"))
    weight, eps = final_norm(), 1e-20
    state, partial = state_with(form, rows, rows)
    pending = state.pending
    hidden = b.final(state, weight, eps)
    assert state.pending is None, "final consumes the pending output"
    assert hidden.dtype == BF16 and hidden.shape == (rows, HIDDEN)
    assert bitwise_equal(hidden, expected(state, partial, weight, eps))
    state.pending = pending
    streams = b.post_only(state)
    assert bitwise_equal(hidden, ref.final_collapse(streams, state.pre, weight, eps))


def test_final_checks_its_input() -> None:
    b = Boundaries(BoundaryAllReduce(HIDDEN, max_rows=8, device="cpu"))
    state, _ = state_with("tensor", 2, 0)
    with pytest.raises(TypeError, match=r"^norm_weight must have dtype torch.bfloat16, got torch.float32"):
        b.final(state, final_norm().float(), 1e-6)
    with pytest.raises(ValueError, match=r"^eps must be >= 0.0, got -1.0"):
        b.final(state, final_norm(), -1.0)
    with pytest.raises(TypeError, match=r"^state must be a BoundaryState"):
        b.final(state.residual, final_norm(), 1e-6)
    state.pending = state.pending.float()
    with pytest.raises(TypeError, match=r"^state.pending must have dtype torch.bfloat16"):
        b.final(state, final_norm(), 1e-6)
    state.pending = None
    with pytest.raises(ValueError, match=r"^state.pending is None"):
        b.final(state, final_norm(), 1e-6)


def _rank_worker(rank: int, world: int, rendezvous: str, results: Any) -> None:
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=world)
    try:
        b = Boundaries(BoundaryAllReduce(HIDDEN, group=dist.group.WORLD, max_rows=8, device="cpu"))
        weight, eps = final_norm(), 1e-6
        out = {}
        for form in FORMS:
            # Every rank holds the same streams and mixes (seed 0) and its own partial (seed 1 + rank).
            state, _ = state_with(form, 3, 0)
            mine, partial = state_with(form, 3, 1 + rank)
            state.pending = mine.pending
            partials = [torch.empty_like(partial) for _ in range(world)]
            dist.all_gather(partials, partial)
            want = expected(state, ref.rank_sum(partials), weight, eps)
            hidden = b.final(state, weight, eps)
            out[form] = (bitwise_equal(hidden, want), hidden.view(torch.int16).clone())
        results[rank] = out
    finally:
        dist.destroy_process_group()


def test_final_on_gloo_ranks_matches_the_rank_order_reference_on_every_rank() -> None:
    world = 2
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager, file_rendezvous() as rendezvous:
        results = manager.dict()
        mp.start_processes(
            _rank_worker, args=(world, rendezvous, results), nprocs=world, join=True, start_method="spawn"
        )
        results = dict(results)
    assert sorted(results) == list(range(world))
    for form in FORMS:
        assert all(results[r][form][0] for r in range(world)), form
        assert torch.equal(results[0][form][1], results[1][form][1]), form


def cuda(v: Any) -> Any:
    """A tensor, MoE output or state moved to the GPU."""
    if isinstance(v, torch.Tensor):
        return v.cuda()
    if isinstance(v, MoEOutput):
        return MoEOutput(cuda(v.routed), cuda(v.shared_output))
    if isinstance(v, UnfinalizedMoEOutput):
        return UnfinalizedMoEOutput(
            *(cuda(t) for t in (v.gemm2_permuted, v.expert_weights, v.expanded_idx_to_permuted_idx))
        )
    return (
        None
        if v is None
        else BoundaryState(*(cuda(getattr(v, f)) for f in ("residual", "post", "comb", "pre", "pending")))
    )


@pytest.mark.gpu
@pytest.mark.parametrize("form", FORMS)
def test_final_on_the_kernel_is_the_fused_boundary_with_the_final_norm(form: str) -> None:
    from tests.bf16 import max_ulp

    ar = BoundaryAllReduce(HIDDEN, max_rows=8, device="cuda")
    state, _ = state_with(form, 5, 3)
    state = cuda(state)
    weight = final_norm().cuda()
    pending, common = state.pending, (state.residual, state.post, state.comb, state.pre, weight, 1e-20, None)
    if isinstance(pending, torch.Tensor):
        new, out = ar(pending, *common)
    elif isinstance(pending.routed, torch.Tensor):
        new, out = ar(pending.routed, *common, shared_output=pending.shared_output)
    else:
        r = pending.routed
        new, out = ar.finalize(
            r.gemm2_permuted, r.expert_weights, r.expanded_idx_to_permuted_idx, pending.shared_output, *common
        )
    hidden = Boundaries(ar).final(state, weight, 1e-20)
    torch.cuda.synchronize()
    assert bitwise_equal(hidden, out)
    # Steps 3-5 against the reference applied to the kernel's own R' (CONTRACT §2 "How to compare").
    assert max_ulp(hidden, ref.rms_norm(ref.collapse(new, state.pre), weight, 1e-20)) <= 1
