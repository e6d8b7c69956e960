"""The peer protocol's layout and constants (CONTRACT §7), shared by the kernel role and the host workspace.

Slots: every rank owns bf16 [GENERATIONS][W + 1][max_rows][H] receive slots. Slot s < W of a row
receives rank s's partial; slot W receives the reduced row y from its owner (two-shot). Every 32-bit
word of a slot is its own arrival flag: it holds SENTINEL_WORD until a peer writes it, and the rank
that consumes it writes the sentinel back in the same call.
"""

from __future__ import annotations

SENTINEL_WORD = 0x80000000  # a bf16 pair (+0.0 low, -0.0 high); payload words equal to it are sent as 0
SENTINEL_INT32 = -(1 << 31)  # the same bits as a signed int32 (torch fill value)
GENERATIONS = 2  # call k uses generation k % 2 (why two suffice: CONTRACT §7)
MAX_WORLD = 32  # the error word's mask of missing ranks has 32 bits
# The world sizes the peer protocol is built, tested and measured for (the TP sizes of the models served,
# SPEC shapes); a TP group of another size takes "nccl+kernel".
PEER_WORLD_SIZES = (2, 4, 8)
PROTOCOLS = ("oneshot", "twoshot")
# The per-rank device state (int32): the call counter, this rank, the bounded wait in microseconds. Every
# call adds exactly CALL_UNIT to the counter, in shares, one per warp, each added after that warp read
# it: the first warp of the first CTA adds CALL_UNIT - (warps - 1), every other warp 1, so the
# counter crosses the next multiple of CALL_UNIT only once every warp of the call has read it, and
# counter // CALL_UNIT counts the calls (modulo 2^16: only its parity is used) for any reader of the call.
STATE_CALLS, STATE_RANK, STATE_TIMEOUT_US = range(3)
STATE_WORDS = 3
# More than the warps of any peer launch (its grid is resident at once: at most 64 warps per SM; the kernel
# checks its own bound).
CALL_SHIFT = 16
CALL_UNIT = 1 << CALL_SHIFT
# The error word (int32): a mask of the ranks a wait gave up on, 1 + a row whose MoE index was outside
# [-1, P), that index.
ERROR_MISSING, ERROR_MOE_ROW, ERROR_MOE_INDEX = range(3)
ERROR_WORDS = 4


def segment_owner(row: int, cta: int, ctas_per_row: int, clusters: int, world_size: int) -> int:
    """The rank that reduces segment (row, CTA column chunk) in the two-shot protocol of a launch of `clusters`
    clusters: a row's chunks and each CTA's rows (row, row + clusters, ...) have successive owners. (W 2 ships
    one-shot only, tuning.EVERY_CALL: its two-shot is the same protocol, run by the tests and the bench.)"""
    return ((row % clusters) * ctas_per_row + cta + row // clusters) % world_size


def slot_elements(world_size: int, max_rows: int, hidden: int) -> int:
    """bf16 elements of one rank's receive slots."""
    return GENERATIONS * (world_size + 1) * max_rows * hidden
