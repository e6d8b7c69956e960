"""Which protocol a call of the peer all-reduce takes: one-shot for small payloads, two-shot for large ones.

The switch is a row count per (world size, H), measured on simulated ranks (W kernels sharing one
H200, docs/PERF.md "Multi-rank boundary"), where every byte of the exchange goes through one HBM; on
NVLink the one-shot's extra bytes cost less and the two-shot's extra hop more, so a multi-GPU machine
may move it (the multi-GPU benchmark measures it there).
"""

from __future__ import annotations

import functools

# Calls of at most this many rows take the one-shot protocol, per (world size, H); other H: the
# nearest measured H of that world size. Measured rows: 1, 4, 16, 64, 256, 512 (docs/PERF.md, per call in a
# long graph): at W 2 one-shot is as fast or faster up to 256 rows (64 at H 7168, where 256 rows tie) and the
# two-shot faster at 512, at W 4 one-shot up to 64 (at 16 rows the two-shot is 2-6 % faster, at 64 one-shot
# 7-12 %: one threshold cannot have both), at W 8 one-shot up to 4 rows at H 4096 and at one row else.
ONESHOT_MAX_ROWS: dict[tuple[int, int], int] = {
    (2, 4096): 256, (2, 5120): 256, (2, 7168): 64,
    (4, 4096): 64, (4, 5120): 64, (4, 7168): 64,
    (8, 4096): 4, (8, 5120): 1, (8, 7168): 1,
}  # fmt: skip


@functools.cache
def oneshot_max_rows(world_size: int, hidden: int) -> int:
    """The largest row count that takes the one-shot protocol (0: never)."""
    measured = [(abs(h - hidden), rows) for (w, h), rows in ONESHOT_MAX_ROWS.items() if w == world_size]
    return min(measured)[1] if measured else 0


def protocol_for(world_size: int, hidden: int, rows: int) -> str:
    """ "oneshot" or "twoshot" for a call of `rows` rows at hidden size `hidden` across `world_size` ranks."""
    return "oneshot" if rows <= oneshot_max_rows(world_size, hidden) else "twoshot"
