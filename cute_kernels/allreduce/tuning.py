"""Which protocol a call of the peer all-reduce takes: one-shot for small payloads, two-shot for large ones.

The switch is a row count per (world size, H), measured on simulated ranks (W kernels sharing one
H200, docs/PERF.md "Multi-rank boundary"), where every byte of the exchange goes through one HBM; on
NVLink the one-shot's extra bytes cost less and the two-shot's extra hop more, so a multi-GPU machine
may move it (the multi-GPU benchmark measures it there).
"""

from __future__ import annotations

import functools

# Every call, whatever its rows: at W 2 both protocols move the same bytes (a row's partial out, a row's worth
# back) and the one-shot takes one hop fewer.
EVERY_CALL = 2**31 - 1

# Calls of at most this many rows take the one-shot protocol, per (world size, H); other H: the
# nearest measured H of that world size. Measured rows: 1, 4, 16, 64, 256, 512 (docs/PERF.md, per call
# in a long graph, the sweep of perf-log v19): at W 2 the one-shot is ahead everywhere (0.45-1.0 us at 1-16
# rows, 2.4-6.5 at 256 and 512); at W 4 one-shot up to 16 rows (0.6-1.0 us ahead there), at H 4096 up to 64
# (0.85 us ahead; 0.1-0.7 behind at H 5120 / 7168); at W 8 one-shot up to 4 rows (0.3-0.7 us ahead there;
# at 16 rows 0.07-3.1 behind).
ONESHOT_MAX_ROWS: dict[tuple[int, int], int] = {
    (2, 4096): EVERY_CALL, (2, 5120): EVERY_CALL, (2, 7168): EVERY_CALL,
    (4, 4096): 64, (4, 5120): 16, (4, 7168): 16,
    (8, 4096): 4, (8, 5120): 4, (8, 7168): 4,
}  # fmt: skip


@functools.cache
def oneshot_max_rows(world_size: int, hidden: int) -> int:
    """The largest row count that takes the one-shot protocol, for a world size the switch was measured at."""
    measured = [(abs(h - hidden), rows) for (w, h), rows in ONESHOT_MAX_ROWS.items() if w == world_size]
    if not measured:
        sizes = sorted({w for w, _ in ONESHOT_MAX_ROWS})
        raise ValueError(f"no protocol switch measured for world size {world_size} (measured: {sizes})")
    return min(measured)[1]


def protocol_for(world_size: int, hidden: int, rows: int) -> str:
    """ "oneshot" or "twoshot" for a call of `rows` rows at hidden size `hidden` across `world_size` ranks."""
    return "oneshot" if rows <= oneshot_max_rows(world_size, hidden) else "twoshot"


def protocols_up_to(world_size: int, hidden: int, max_rows: int) -> tuple[str, ...]:
    """The protocols the switch picks for calls of 1..max_rows rows (what a warmup compiles)."""
    limit = oneshot_max_rows(world_size, hidden)
    return tuple(p for p, used in (("oneshot", limit >= 1), ("twoshot", max_rows > limit)) if used)
