"""Which protocol a call of the peer all-reduce takes: one-shot for small payloads, two-shot for large ones.

The switch is a row count per (world size, H), measured on simulated ranks (W kernels sharing one
GPU), where every byte of the exchange goes through one HBM; on NVLink the one-shot's extra bytes cost
less and the two-shot's extra hop more, so a multi-GPU machine may move it (the multi-GPU benchmark
measures it there).
"""

from __future__ import annotations

import functools

# Every call, whatever its rows: at W 2 both protocols move the same bytes (a row's partial out, a row's worth
# back) and the one-shot takes one hop fewer.
EVERY_CALL = 2**31 - 1

# Calls of at most this many rows take the one-shot protocol, per (world size, H); other H: the
# nearest measured H of that world size. The one-shot's single hop wins at few rows, the two-shot's
# fewer bytes at many (docs/PERF.md decisions: ONESHOT_MAX_ROWS).
ONESHOT_MAX_ROWS: dict[tuple[int, int], int] = {
    (2, 4096): EVERY_CALL,
    (2, 5120): EVERY_CALL,
    (2, 7168): EVERY_CALL,
    (4, 4096): 64,
    (4, 5120): 16,
    (4, 7168): 16,
    (8, 4096): 4,
    (8, 5120): 4,
    (8, 7168): 4,
}


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
