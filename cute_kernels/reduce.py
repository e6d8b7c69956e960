"""Fixed-order sums inside a CTA and across a thread-block cluster (DSMEM), written once for every kernel.

Every kernel of the project sums partials in an order that never depends on the grid or the row
count (batch invariance): a warp's lanes by butterfly shuffles, then per-warp or per-CTA slots read
back in slot order. Across a cluster the slots travel with `push` (st.async into the peer CTA's
shared memory, completing on the peer's mbarrier), so a CTA waits once for all of them.
"""

from __future__ import annotations

import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr


def push(smem_ptr: cute.Pointer, value: Float32 | Int32 | tuple, mbar: cute.Pointer, peer: Int32) -> None:
    """Store 4 bytes (or a 2/4-word tuple) at `smem_ptr` of cluster CTA `peer`, completing on its mbarrier."""
    if isinstance(value, tuple):
        words = tuple(Int32(w) if not isinstance(w, Float32) else w.bitcast(Int32) for w in value)
    else:
        words = value.bitcast(Int32) if isinstance(value, Float32) else Int32(value)
    cute.arch.store_async_dsmem(smem_ptr, words, mbar, peer)


def expect_bytes(mbar: cute.Pointer, nbytes) -> None:
    """Arm this CTA's mbarrier for `nbytes` of pushes (one elected thread of the calling warp arrives)."""
    with cute.arch.elect_one():
        cute.arch.mbarrier_arrive_and_expect_tx(mbar, nbytes)


def ordered_sum(terms: list) -> Float32:
    """terms[0] + terms[1] + ... in list order (fp32, one rounding per addition)."""
    acc = terms[0]
    for t in terms[1:]:
        acc = acc + t
    return acc


def warp_sum(value: Float32) -> Float32:
    """The sum over the 32 lanes of a warp by butterfly shuffles (every lane gets the same bits)."""
    return cute.arch.warp_reduction_sum(value)


@cute.jit
def wait_pushes(mbar: cute.Pointer, phase, spin: bool):
    """Wait until this CTA's mbarrier `mbar` has every push of its phase `phase` (`spin`: a try_wait loop with no
    suspend hint, entered by the CTA's warps together, after a CTA barrier, instead of mbarrier_wait's suspending
    retry: warps spinning on try_wait held up a warp of their CTA that was still reducing its sum, docs/PERF.md
    decisions: gather_sum barrier)."""
    if const_expr(spin):
        cute.arch.barrier()
        done = cute.arch.mbarrier_try_wait(mbar, phase)
        while not done:
            done = cute.arch.mbarrier_try_wait(mbar, phase)
    else:
        cute.arch.mbarrier_wait(mbar, phase)
