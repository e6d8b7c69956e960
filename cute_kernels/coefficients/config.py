"""The coefficients kernels' compile-time configuration: the shipped knobs, the constants, the split along K."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

from cute_kernels import HC, hardware

MIX = HC * (HC + 2)  # 24 mixes: pre (4), post (4), comb (16)
NV = MIX + 1  # values per row in the partials: the 24 dot products and the sum of squares
CLUSTER = hardware.MAX_CLUSTER  # CTAs per thread-block cluster (the portable limit, 8)
CHUNK = 32  # columns per warp: two k16 MMA steps, 8 contiguous columns (16 bytes) per lane
WARP = 32  # threads per warp
MAX_WARPS = 8  # 32-column chunks per CTA
# Sinkhorn repeats per iteration of the epilogue's rolled loop: the epilogue runs once per call on an SM
# whose instruction cache has not seen it, and 4 fetches least (docs/PERF.md decisions: SINKHORN_UNROLL).
SINKHORN_UNROLL = 4


@dataclass(frozen=True)
class CoefficientsConfig:
    """Compile-time launch shape: rows per tile, the split along K (warps per CTA, clusters along K), knobs.

    (warps, groups) fix the reduction order and are a function of H alone (`for_shape`), so every config
    of one H gives the very same bits: the host picks one per call by row count (`tuning.coefficients_config`)
    without breaking batch invariance. The knob defaults are the shipped 32-row tile schedule.
    - `rows_per_tile`: rows of one row tile (16-128; 256 or 512 with schedule "partials").
    - `warps`, `groups`: 32-column chunks per CTA and clusters of 8 CTAs along K (`projection_split`).
    - `push_vec`: schedule "tile": push the summed warp partials to their owner CTA 16 bytes at a time
      (st.async.v4, a quarter of the DSMEM transactions; rows_per_tile >= 32).
    - `row_split`: warps per 32-column chunk (1, 2 or 4): warp (w, s) reads the columns of chunk w for
      its own 1/row_split of a batch's m-tiles; more loads in flight per CTA, fewer row registers per
      thread. A row's partial is still summed over the chunks in order.
    - `min_blocks`: 0, or the CTAs per SM the launch bound asks ptxas to fit (caps the registers; with
      2 or more the shared-memory carveout is set to its maximum as well).
    - `schedule`: "tile" (one launch: clusters, the last CTA of a row tile to start finishes its rows)
      or "partials" (CTA sums to the workspace, then a second launch of one CTA per row sums them in
      the same order and finishes it).
    - `stage_rows`: schedule "partials" without a layer input: each lane copies its rows of the tile to
      its own shared-memory slots with cp.async right after the wait, then reads them back batch by batch.
    - `stage_depth`: with stage_rows, batches in flight at once: 0 = all, or a ring of that many slots,
      each refilled with the batch `stage_depth` ahead once its words are multiplied.
    - `sum_buffers`: schedule "partials": shared-memory buffers of warp partials the batches alternate
      between (1 or 2; 2 takes one barrier per batch instead of two).
    """

    rows_per_tile: int
    warps: int
    groups: int
    push_vec: bool = False
    row_split: int = 1
    min_blocks: int = 0
    schedule: str = "tile"
    stage_rows: bool = False
    stage_depth: int = 0
    sum_buffers: int = 1

    @property
    def threads(self) -> int:
        """Threads per CTA: warps * row_split warps of 32."""
        return WARP * self.warps * self.row_split

    @staticmethod
    def for_shape(H: int, broadcast: bool, rows_per_tile: int = 32, **knobs: Any) -> CoefficientsConfig:
        """The config of hidden size H's split along K with these knobs (by default the 32-row tile)."""
        warps, groups = projection_split(H, broadcast)
        return CoefficientsConfig(rows_per_tile, warps, groups, **knobs)


def projection_width(H: int, broadcast: bool) -> int:
    """Columns of the projection input: 4H for the streams, H for the broadcast embedding."""
    return H if broadcast else HC * H


@functools.cache
def projection_split(H: int, broadcast: bool) -> tuple[int, int]:
    """(warps, groups) of the split along K for hidden size H: 8 * groups CTAs of `warps` 32-column chunks,
    about 128 CTAs, at least 2 warps when possible."""
    chunks = projection_width(H, broadcast) // CHUNK
    best = None
    for warps in range(MAX_WARPS, 0, -1):
        if chunks % (CLUSTER * warps):
            continue
        groups = chunks // (CLUSTER * warps)
        cost = abs(math.log2(CLUSTER * groups / 128)) + (1.5 if warps < 2 else 0.0)
        if best is None or cost < best[0] - 1e-9:
            best = (cost, warps, groups)
    assert best is not None  # warps = 1 always divides: chunks is a multiple of 8
    return best[1], best[2]
