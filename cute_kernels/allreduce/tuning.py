"""Which protocol a call of the peer all-reduce takes: one-shot for small payloads, two-shot for large ones.

The switch is a row count per (world size, H), measured on simulated ranks (W kernels sharing one
H200, docs/PERF.md "Multi-rank boundary"), where every byte of the exchange goes through one HBM; on
NVLink the one-shot's extra bytes cost less and the two-shot's extra hop more, so a multi-GPU machine
may move it (the multi-GPU benchmark measures it there).
"""

from __future__ import annotations

import functools

# Calls of at most this many rows take the one-shot protocol, per (world size, H); other H: the
# nearest measured H of that world size. Measured rows: 1, 4, 16, 64, 256, 512 (docs/PERF.md): at W 2
# one-shot is as fast or faster at every one (the two move the same bytes; one-shot has one hop less),
# at W 4 up to 64 rows, at W 8 up to 4.
ONESHOT_MAX_ROWS: dict[tuple[int, int], int] = {
    (2, 4096): 512, (2, 5120): 512, (2, 7168): 512,
    (4, 4096): 64, (4, 5120): 64, (4, 7168): 64,
    (8, 4096): 4, (8, 5120): 4, (8, 7168): 4,
}  # fmt: skip


@functools.cache
def oneshot_max_rows(world_size: int, hidden: int) -> int:
    """The largest row count that takes the one-shot protocol (0: never)."""
    measured = [(abs(h - hidden), rows) for (w, h), rows in ONESHOT_MAX_ROWS.items() if w == world_size]
    return min(measured)[1] if measured else 0


def protocol_for(world_size: int, hidden: int, rows: int) -> str:
    """ "oneshot" or "twoshot" for a call of `rows` rows at hidden size `hidden` across `world_size` ranks."""
    return "oneshot" if rows <= oneshot_max_rows(world_size, hidden) else "twoshot"
