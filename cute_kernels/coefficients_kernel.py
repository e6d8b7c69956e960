"""The mHC coefficients (SPEC §3, `mhc_pre_delayed`) in one or two launches: split-K projection + Sinkhorn.

Per row t: mixes = (x . fn) * rsqrt(sum x^2 / K + rms_eps) over the K = 4H stream columns (or the
H embedding columns with fn_broadcast), then pre / post / comb (softmax + Sinkhorn).

Projection. The K columns are split into S = 8*G CTA slices (a function of H only, never of the
row count); CTA slice s, warp w owns the 32 columns [(s*W + w)*32, +32). A warp reads its fn
slice once (fp32, split into bf16 hi + lo, which is exact to 2^-17) and then, for each 16-row
m-tile of its row tile, multiplies the bf16 rows by it on the tensor cores (mma.sync m16n8k16,
fp32 accumulation): 3 n-tiles x (hi, lo) give the 24 dot products, and the rows' Gram block
(the A fragment doubles as B) gives the sums of squares on its diagonal. The k order inside a
fragment is permuted (a lane holds 8 contiguous columns) identically for A and B. With
config.row_split > 1 several warps share a 32-column chunk, each with its own m-tiles. With
config.projection "fma" (an A/B alternative, other bits) the CTA stages its fn slice in shared
memory instead and each lane runs fp32 FMAs over its 8 columns, summed over the row's 4 lanes
by shuffles.

Reduction, in a fixed order for every row: warps 0..W-1 of a CTA (shared memory), then the 8
CTAs of a thread-block cluster (each CTA owns TM/8 rows of the tile and receives every peer's
partials for them with st.async into its shared memory), then the G clusters (global workspace
partials [G, rows, 25]; a written partial never has the sentinel's bits, NaN rows included).
One of the G CTAs that own those rows sums the G partials in order and runs the per-row epilogue:
warp 0 comb (softmax + Sinkhorn, a lane per row, or config.comb_lanes lanes per row sharing the
column sums by shuffles; the Sinkhorn repeats as a loop of config.sinkhorn_unroll repeats per
iteration), warp 1 pre and post (warp 0 too, after comb, in a one-warp CTA). Which one (config.handoff): "counter", the last
to bump a per-(tile, rank) arrival counter after writing its partial; "ticket", the last to take
a ticket when it starts (so every other one is resident and will finish), which keeps its own
partial and polls the others' slots until none holds the NaN sentinel. Either way the counter
goes back to 0 and the slots back to the sentinel, so every call and every CUDA-graph replay
starts clean. The config knobs never change the reduction order, only (warps, groups) do;
config.projection changes the arithmetic of the warp partials, so the bits too.

Layer input (inline form): extra clusters, after the projection clusters of the tile that reads
the same rows (or all ahead of them, config.norm_order), each do NR rows: CTA r of the cluster
owns the columns [r*H/8, (r+1)*H/8); c = bf16(sum_j pre_mix[j]*R[j]) (or stream 0 / the embedding
exactly), the sum of squares of the rounded c is exchanged across the cluster the same way, then
out = bf16(c * rsqrt(sum/H + eps) * w). LayerInputKernel (mhc_layer_input) runs those clusters
alone, with the same bits, for a scheduler that runs the projection on a side stream.

Schedule "partials" (config.schedule): the same projection CTAs without the cluster exchange. Each
stores its warp-ordered sums into the workspace's rank_partials [G*8, rows, 25] and exits; a second
launch (PDL), one CTA per row, adds each group's 8 CTA sums in rank order, then the G groups in order
(the very additions of the one-launch schedule, so the same bits), then runs the epilogue. Without a
layer input the first launch has no clusters at all; with one it keeps them for the layer-input
clusters. No exchange, no handoff: the default at almost every row count (docs/PERF.md, v7-v10). Without a
layer input its CTAs may also take 256 or 512 rows (more 64-row batches with fn held) and stage their
rows in shared memory by cp.async (config.stage_rows), which keeps ptxas from issuing a CTA's row
loads only after its fn round trip (docs/PERF.md, v8).

PDL: before griddepcontrol.wait a CTA reads only weights (fn, w); the streams, the carried
pre-mix and the workspace come after it.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch
from cutlass import BFloat16, Float32, Int32, Int64, const_expr

from cute_kernels import ptx as prim
from cute_kernels.compile import WarmupJob, check_arch, compile_kernel, fake_stream, fake_tensor, jit_cache

HC = 4
MIX = HC * (HC + 2)  # 24 mixes: pre (4), post (4), comb (16)
NV = MIX + 1  # values per row in the partials: the 24 dot products and the sum of squares
CLUSTER = 8  # CTAs per thread-block cluster (the portable limit)
CHUNK = 32  # columns per warp: two k16 MMA steps, 8 contiguous columns (16 bytes) per lane
WARP = 32  # threads per warp
MAX_WARPS = 8
VARIANTS = ("standard", "broadcast")
LAYER_INPUTS = ("none", "carried", "one_hot")
HANDOFFS = ("counter", "ticket")
SCHEDULES = ("tile", "partials")
PROJECTIONS = ("mma", "fma")
NORM_ORDERS = ("interleave", "front")
NORM_ROWS = (0, 1, 2, 4, 8, 16)
ROW_SPLITS = (1, 2, 4)
MIN_BLOCKS = (0, 1, 2, 3, 4)
STAGE_DEPTHS = (0, 2, 3, 4)
COMB_LANES = (1, 2, 4)
SINKHORN_UNROLLS = (1, 2, 4, 8)
MAX_THREADS_PER_SM = 2048
CANONICAL_NAN = 0x7FFFFFFF  # what the GPU's arithmetic gives for every NaN result
INPUT_ONLY_BUDGET = 2  # 16-byte vectors per thread of the layer-input-only kernel (x2 for one-hot)
# The value of an empty workspace partial slot: a NaN that arithmetic never produces (the GPU's
# NaN results are the canonical 0x7FFFFFFF), so a slot holding it has not been written yet.
SENTINEL = -4137299  # 0xFFC0DEAD as int32: a negative quiet NaN with a payload
# The phases a trace build stamps, per projection CTA: [0, 8) globaltimer ns, [8, 16) clock64 of
# the same points, then the SM id and whether this CTA ran the epilogue.
TRACE_PHASES = ("entry", "wait", "first_mma", "cluster_wait", "pushed", "received", "partials", "epilogue")
TRACE_SLOTS = 24
TRACE_SM, TRACE_CONSUMER = 16, 17
# Then clock64 inside the comb epilogue of the CTA's first row: start, Sinkhorn loop entry, loop exit, end.
TRACE_COMB = ("comb_start", "loop_start", "loop_end", "comb_end")
TRACE_COMB_SLOT = 18


# ---------------------------------------------------------------------------------------------
# Compile-time shape
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CoefficientsConfig:
    """Compile-time launch shape: rows per tile, warps per CTA and clusters (groups) along K, plus knobs.

    (warps, groups) fix the reduction order and `projection` the arithmetic of the warp partials, so
    configs that share (warps, groups, projection) give the very same bits (the host may pick any of
    them per call, e.g. by row count, without breaking batch invariance). The knobs:
    - `handoff`: how the G clusters of a row tile meet. "counter": each CTA writes its partial,
      fences and bumps an arrival counter; the last to arrive reads the G partials. "ticket": each
      CTA takes a ticket when it starts; the last to start (so every other one is resident) keeps its
      partial and polls the others' partials (workspace slots hold a NaN sentinel between calls),
      which takes the fence and the atomic off the chain.
    - `prefetch`: with more than one 64-row batch per tile, load the next batch's rows before the
      current batch's MMAs.
    - `norm_rows`: rows per layer-input cluster (inline form), 0 = as many as 2 (carried) or 4
      (one-hot) 16-byte vectors per thread cover.
    - `norm_order`: where the layer-input clusters sit in the grid: "interleave" (after the
      projection clusters of the tile that reads the same rows, so their stream reads hit L2) or
      "front" (all before the projection, the original order).
    - `row_split`: warps per 32-column chunk (1, 2 or 4): the CTA runs warps * row_split warps,
      warp (w, s) reads the columns of chunk w for its own 1/row_split of a batch's m-tiles. More
      loads in flight per CTA, fewer row registers per thread, a shorter MMA and push phase; the
      partial of a row is still summed over the chunks in order, so the bits do not change.
    - `push_vec`: push the summed warp partials to their owner CTA 16 bytes at a time
      (st.async.v4, a quarter of the DSMEM transactions; needs rows_per_tile >= 32).
    - `min_blocks`: 0, or the CTAs per SM the launch bound asks ptxas to fit (caps the registers;
      with 2 or more the shared-memory carveout is set to its maximum as well).
    - `comb_lanes`: lanes of the epilogue warp per row for comb (1, 2 or 4): each holds 4/comb_lanes
      rows of the Sinkhorn matrix and the column sums travel by shuffles (same bits: the sums keep
      their order, float addition commutes).
    - `sinkhorn_unroll`: Sinkhorn repeats per iteration of the epilogue's rolled loop (1, 2, 4 or 8).
    - `trace`: a profiling build: thread 0 of each projection CTA writes timestamps of its phases
      to a trace buffer (see TRACE_PHASES; "epilogue" is the end of warp 0's comb) and, in the CTA
      that finishes rows, clock64 inside its first row's comb (TRACE_COMB); never a default.
    - `projection`: how a warp computes its partial sums: "mma" (bf16 tensor-core MMAs, fn split
      into hi + lo; the default) or "fma" (fp32 FMAs on the CUDA cores, fn staged in shared memory,
      the 4 lanes of a row summed by shuffles). The sums are rounded in another order, so "fma"
      gives other bits than "mma" (as accurate); for A/B measurement at few rows, never a default.
    - `schedule`: "tile" (one launch, clusters, the last CTA of a row tile finishes its rows) or
      "partials" (two launches, no clusters: CTA sums to the workspace, then one CTA per row sums
      them in the same order and finishes it; the same bits; mma projection, no trace, no
      push_vec; `handoff` does not apply to it).
    - `stage_rows`: schedule "partials" only: each lane copies its rows of every batch of the tile to
      its own shared-memory slots with cp.async right after the wait, then splits fn and reads them
      back batch by batch. Loaded into registers instead, ptxas issues an m-tile's row loads only
      after the fn split and the MMAs before it, one round trip after another (the partials kernel's
      SASS).
    - `stage_depth`: with stage_rows, how many of the tile's batches are in flight at once: 0 = all
      of them (copied right after the wait), or a ring of that many batch slots, each refilled with
      the batch `stage_depth` ahead once its words are multiplied (a tall tile in less shared memory).
    - `sum_buffers`: schedule "partials" only: shared-memory buffers of warp partials the batches
      alternate between (1 or 2); with 2, a warp may multiply the next batch while others still sum
      this one (one barrier per batch instead of two).
    """

    rows_per_tile: int
    warps: int
    groups: int
    handoff: str = "counter"
    prefetch: bool = False
    norm_rows: int = 0
    norm_order: str = "interleave"
    row_split: int = 1
    push_vec: bool = False
    min_blocks: int = 0
    comb_lanes: int = 1
    sinkhorn_unroll: int = 1
    trace: bool = False
    projection: str = "mma"
    schedule: str = "tile"
    stage_rows: bool = False
    stage_depth: int = 0
    sum_buffers: int = 1

    @property
    def threads(self) -> int:
        """Threads per CTA: warps * row_split warps of 32."""
        return CHUNK * self.warps * self.row_split

    @staticmethod
    def for_shape(H: int, broadcast: bool, rows_per_tile: int = 64, **knobs: Any) -> CoefficientsConfig:
        """The default split for hidden size H: about 128 CTAs along K, at least 2 warps when possible."""
        _check_hidden(H)
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
        return CoefficientsConfig(rows_per_tile, best[1], best[2], **knobs)

    def validate(self, H: int, broadcast: bool) -> None:
        """Raise ValueError unless this config tiles the projection of hidden size H."""
        _check_hidden(H)
        tm, w, g = self.rows_per_tile, self.warps, self.groups
        if not _is_int_in(tm, (16, 32, 64, 128, 256, 512)):
            raise ValueError(f"rows_per_tile must be 16, 32, 64, 128, 256 or 512, got {tm!r}")
        if tm > 128 and self.schedule != "partials":
            raise ValueError(f"rows_per_tile {tm} needs schedule 'partials' (a cluster finishes at most 128 rows)")
        if not (isinstance(w, int) and 1 <= w <= MAX_WARPS):
            raise ValueError(f"warps must be an int in 1..{MAX_WARPS}, got {w!r}")
        width = projection_width(H, broadcast)
        if not (isinstance(g, int) and g >= 1 and CLUSTER * g * w * CHUNK == width):
            raise ValueError(
                f"groups * {CLUSTER} CTAs * warps * {CHUNK} columns must equal the projection width {width}; "
                f"got groups={g!r}, warps={w}"
            )
        if self.handoff not in HANDOFFS:
            raise ValueError(f"handoff must be one of {HANDOFFS}, got {self.handoff!r}")
        if not isinstance(self.prefetch, bool):
            raise ValueError(f"prefetch must be a bool, got {self.prefetch!r}")
        if not _is_int_in(self.norm_rows, NORM_ROWS):
            raise ValueError(f"norm_rows must be one of {NORM_ROWS} (0 = auto), got {self.norm_rows!r}")
        if self.norm_rows > tm:
            raise ValueError(f"norm_rows ({self.norm_rows}) must not exceed rows_per_tile ({tm})")
        if self.norm_order not in NORM_ORDERS:
            raise ValueError(f"norm_order must be one of {NORM_ORDERS}, got {self.norm_order!r}")
        if not _is_int_in(self.row_split, ROW_SPLITS):
            raise ValueError(f"row_split must be one of {ROW_SPLITS}, got {self.row_split!r}")
        if min(4, tm // 16) % self.row_split:
            raise ValueError(f"row_split ({self.row_split}) must divide the {min(4, tm // 16)} m-tiles of a batch")
        if not isinstance(self.push_vec, bool):
            raise ValueError(f"push_vec must be a bool, got {self.push_vec!r}")
        if self.push_vec and tm < 32:
            raise ValueError(f"push_vec needs rows_per_tile >= 32 (16-byte row shares), got {tm}")
        if not _is_int_in(self.min_blocks, MIN_BLOCKS):
            raise ValueError(f"min_blocks must be one of {MIN_BLOCKS}, got {self.min_blocks!r}")
        if not _is_int_in(self.sinkhorn_unroll, SINKHORN_UNROLLS):
            raise ValueError(f"sinkhorn_unroll must be one of {SINKHORN_UNROLLS}, got {self.sinkhorn_unroll!r}")
        if not _is_int_in(self.comb_lanes, COMB_LANES):
            raise ValueError(f"comb_lanes must be one of {COMB_LANES}, got {self.comb_lanes!r}")
        if self.schedule == "tile" and tm // CLUSTER * self.comb_lanes > 32:
            raise ValueError(
                f"comb_lanes ({self.comb_lanes}) lanes for each of the {tm // CLUSTER} rows a CTA finishes exceed a warp"
            )
        if not isinstance(self.trace, bool):
            raise ValueError(f"trace must be a bool, got {self.trace!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.schedule == "partials" and (self.trace or self.projection != "mma"):
            raise ValueError("schedule 'partials' needs the mma projection and no trace")
        if not isinstance(self.stage_rows, bool):
            raise ValueError(f"stage_rows must be a bool, got {self.stage_rows!r}")
        if self.stage_rows and (self.schedule != "partials" or self.prefetch):
            raise ValueError("stage_rows needs schedule 'partials' and no prefetch")
        if not _is_int_in(self.stage_depth, STAGE_DEPTHS):
            raise ValueError(f"stage_depth must be one of {STAGE_DEPTHS} (0 = every batch), got {self.stage_depth!r}")
        if self.stage_depth and not self.stage_rows:
            raise ValueError("stage_depth needs stage_rows")
        if self.stage_depth and self.stage_depth >= tm // 64:
            raise ValueError(
                f"stage_depth ({self.stage_depth}) must be less than the {max(1, tm // 64)} batches of a "
                f"{tm}-row tile (0 stages them all)"
            )
        if not _is_int_in(self.sum_buffers, (1, 2)):
            raise ValueError(f"sum_buffers must be 1 or 2, got {self.sum_buffers!r}")
        if self.sum_buffers == 2 and (self.schedule != "partials" or tm <= 64):
            raise ValueError("sum_buffers 2 needs schedule 'partials' and more than one 64-row batch per tile")
        if self.schedule == "partials" and self.push_vec:
            raise ValueError("schedule 'partials' sums its warps itself: push_vec does not apply")
        if self.projection not in PROJECTIONS:
            raise ValueError(f"projection must be one of {PROJECTIONS}, got {self.projection!r}")
        if self.min_blocks * self.threads > MAX_THREADS_PER_SM:
            raise ValueError(
                f"min_blocks ({self.min_blocks}) CTAs of {self.threads} threads exceed {MAX_THREADS_PER_SM} threads per SM"
            )


@dataclass(frozen=True)
class LayerInputConfig:
    """Launch shape of the layer-input-only kernel: warps per CTA and rows per cluster (0 = auto)."""

    warps: int = 8
    norm_rows: int = 0

    def validate(self) -> None:
        if not (isinstance(self.warps, int) and not isinstance(self.warps, bool) and 1 <= self.warps <= MAX_WARPS):
            raise ValueError(f"warps must be an int in 1..{MAX_WARPS}, got {self.warps!r}")
        if not _is_int_in(self.norm_rows, NORM_ROWS):
            raise ValueError(f"norm_rows must be one of {NORM_ROWS} (0 = auto), got {self.norm_rows!r}")


# Measured on the H200 (docs/PERF.md, v2): the ticket handoff wins at every row count. Every default
# below shares (warps, groups), so the bits of a row do not depend on which one a call gets.
DEFAULT_HANDOFF = "ticket"
# Measured on the H200 (docs/PERF.md, v5): 4 Sinkhorn repeats per loop iteration take 0.07-0.26 us
# off the call at <= 16 rows against 1 (the epilogue runs cold code once per call), same at 512.
DEFAULT_SINKHORN_UNROLL = 4
# The default (row tile, push_vec, row_split, min_blocks) by form and row count, from interleaved A/B
# runs on the H200 (docs/PERF.md, v5, v6 and v7), us per call:
# - SPLIT = 16-byte pushes + two warps per 32-column chunk. Standard projection at 16-32 rows
#   (7168 x 16: 5.40-5.46 -> 5.21-5.22; loses at <= 8 rows); broadcast at 1-32 (7168 x 16: 5.13-5.17
#   -> 4.49-4.50); the inline form at 8-32 rows from H 7168 only (7168 x 16: 5.56-5.62 -> 5.25-5.31,
#   x 32: 6.87-6.90 -> 6.22-6.29; it loses 0.3-1.1 at H 4096-5120).
# - Standard above 32 rows: 16-byte pushes (64 rows: 7.55 -> 7.16 at 7168, 6.53 -> 6.28 at 4096), and
#   64-row tiles from 129 rows (192 rows: 13.19 -> 12.34 at 7168, 9.87 -> 9.31 at 4096; 256 rows:
#   11.17 -> 9.79 at 4096, a tie at 7168).
# - The standard projection's 64-row tile with 7-warp CTAs (H 7168) also asks for 3 CTAs per SM
#   (min_blocks 3: the largest shared-memory carveout, and a register cap of 96 that the 94 registers
#   already meet; 2 fit without): 7168 x 512 23.29-23.32 -> 22.16 (two runs), x 256 15.16 -> 14.63.
#   At H 4096 (4 warps) it loses 1 us; 8-warp CTAs (a cap of 80 registers) were not measured.
# - Broadcast (2-warp CTAs, so min_blocks 3 only buys the largest carveout) from 129 rows at H >= 5120:
#   64-row tiles, pushes, min_blocks 3 (7168 x 192: 10.03 -> 8.75, x 256: 10.55 -> 9.45, 5120 x 256:
#   10.1-10.2 -> 8.47). At H 4096 the same tile wins at 193-384 rows (256: 9.6 -> 8.0) and the 32-row
#   tile with pushes at 512 (11.67 -> 10.49).
# - Inline: at H 7168 the 32-row tile with pushes from 257 rows (512: 34.34 -> 32.53, 384: 26.23 ->
#   25.47; replaced by the partials band below); below H 7168 64-row tiles with pushes from 129 rows (5120 x 256: 15.12 -> 14.08) or, at H
#   4096, from 192 (192 rows: 10.78 -> 10.25). The first-layer inline form keeps v6's bands.
# - v7, the partials schedule (two launches, no cluster; same bits), from two A/B runs at >= 64 rows and
#   one below (docs/PERF.md, v7). Standard projection at H >= 5120: 7168 x 16 5.23 -> 5.04, x 32 6.07 ->
#   5.55, x 64 7.15-7.20 -> 6.56-6.62, x 256 14.74-14.80 -> 12.65-12.70, x 512 22.13-22.30 -> 20.16-20.18;
#   5120 x 16 4.95 -> 4.80, x 512 17.92-17.96 -> 17.09-17.10. At H 4096 it wins only at 33-64 rows and
#   from 384 (512: 15.28 -> 14.88-14.92). Broadcast from 129 rows: 64-row tiles, min_blocks 3 (512 rows:
#   12.04-12.20 -> 11.12-11.23 at 7168, 10.46-10.55 -> 9.05-9.11 at 4096). The broadcast split tile also
#   wins up to 96 rows (48 rows: 5.32-6.28 -> 4.60-5.11; 96 rows: 5.60-7.12 -> 4.96-6.47; 97-128 not
#   measured, so the plain tile stays there).
# - v7, inline at H 7168 from 129 rows: 32-row partials (one A/B run, bits GPU-tested): 129 rows 12.29 ->
#   11.72, 256 rows 18.44 -> 17.02, 512 rows 32.54 -> 28.77. At H 4096-5120 the tile schedule stays
#   (partials 0.1-1 us slower there).
# - v8, the partials schedule above 192 rows (two A/B runs at 256-512 rows, docs/PERF.md, v8; us at 256 /
#   384 / 512 rows against v7's defaults): H 7168, 128-row tiles of 14 warps (row_split 2): 12.68 -> 11.43,
#   16.31 -> 16.12, 20.14 -> 19.05. H 5120: 128-row split tiles at 193-256 (256: 11.26 -> 10.08), 32-row
#   tiles with staged rows at 257-384 (320: 12.54 -> 12.08, 384: 14.17 -> 13.53) and plain 128-row tiles
#   above (448: 15.52 -> 14.34, 512: 17.09 -> 15.00). H 4096: 64-row tiles, min_blocks 3, staged rows at
#   193-288 (256: 9.91 -> 9.33) and 417-512 (448: 13.43 -> 13.17, 512: 14.77 -> 14.18), 128-row split
#   tiles at 289-416 (320: 11.76 -> 10.55, 384: 12.36 -> 10.88). Broadcast, two more runs: at H 7168 staged
#   rows in the 64-row tile from 384 rows (384: 10.08-10.32 -> 9.76-9.79, 512: 11.06-11.11 -> 10.42-10.52;
#   it loses 0.1-0.25 at 129-256), at H 5120 the 32-row tile with staged rows at 129-192 (129: 7.90-8.06
#   -> 6.55-6.58, 192: 7.62-8.16 -> 7.37-7.51); H 4096 unchanged (within 0.1).
# - v9, the staging ring (one A/B run of 3-14 configs at 129-512 rows, two more at 129/256/384/512 and one
#   at 193-480 rows, docs/PERF.md, v9; us against v8's defaults): one 512-row tile of 4 warps per chunk,
#   2 batches in flight, 2 buffers of warp sums: H 7168 from 257 rows (288: 13.76 -> 12.62, 384: 16.13
#   -> 14.32, 512: 19.10 -> 16.86-16.91), H 5120 from 305 (between the measured 288, where the staged
#   32-row tile stays 0.18 ahead, and 320: 11.93 -> 11.63; 512: 15.01 -> 14.44), H 4096 from 401 (384:
#   the 128-row split tile 0.5 ahead; 416: 12.75 -> 11.95, 512: 14.29-14.32 -> 12.92-12.93). Its 256-row
#   form at 193-256 rows for H 4096 and 5120 (4096 x 224: 9.46 -> 8.79, 5120 x 224: 9.90 -> 9.51).
# - v10, after the warp sums went 4 at a time (one A/B run of 15 configs at 1-512 rows, 3 H, standard,
#   broadcast and inline, docs/PERF.md, v10, which has the whole table; us against v9's defaults measured
#   with the v10 kernels): the partials schedule wins more rows. Standard: split tiles at 41-80 rows at
#   H 7168 (64: 7.11 -> 6.11) and 8-24 at H 4096 (16: 4.95 -> 4.58), 16-row tiles at 17-112 for H 5120
#   (64: 6.52 -> 5.88, 96: 7.18 -> 6.44) and 25-112 for H 4096 (96: 7.07 -> 6.09), staged 32-row tiles at
#   113-176 for H 5120, the 256-row ring from 145 / 177 / 113 rows (H 7168 x 256: 15.78 -> 10.93: with
#   v10's warp sums the 128-row split tile takes 76 registers, one CTA per SM), the 512-row ring from 257
#   rows at every H (4096 x 384: 11.11 -> 10.41). Broadcast: split tiles of the partials schedule up to
#   304 / 416 / 512 rows (7168 x 256: 8.96 -> 6.69), then staged 32-row tiles (7168 x 512: 10.88 ->
#   8.80). Inline: at H 7168 32-row partials tiles at 8-40 rows (16: 5.72 -> 5.22), the 32-row tile with
#   pushes at 41-128, 64-row partials tiles from 177 (512: 28.68 -> 27.68); at H 5120 32-row partials tiles
#   at 12-208 and 64-row ones from 209 (512: 22.73 -> 22.17); at H 4096 64-row partials tiles from 353.
# (rows_per_tile, push_vec, row_split, min_blocks, schedule, stage_rows, stage_depth, sum_buffers)
Choice = tuple[int, bool, int, int, str, bool, int, int]
T32: Choice = (32, False, 1, 0, "tile", False, 0, 1)
T32_VEC: Choice = (32, True, 1, 0, "tile", False, 0, 1)
SPLIT: Choice = (32, True, 2, 0, "tile", False, 0, 1)
T64_VEC: Choice = (64, True, 1, 0, "tile", False, 0, 1)
SPLIT_P: Choice = (32, False, 2, 0, "partials", False, 0, 1)
T16_P: Choice = (16, False, 1, 0, "partials", False, 0, 1)
T32_P: Choice = (32, False, 1, 0, "partials", False, 0, 1)
T64_P: Choice = (64, False, 1, 0, "partials", False, 0, 1)
T64_MB3_P: Choice = (64, False, 1, 3, "partials", False, 0, 1)
T32_STAGED_P: Choice = (32, False, 1, 0, "partials", True, 0, 1)
# One 512- or 256-row tile, 4 warps per chunk, rows through a 2-batch staging ring, 2 buffers of warp sums.
RING_P: Choice = (512, False, 4, 0, "partials", True, 2, 2)
T256_RING_P: Choice = (256, False, 4, 0, "partials", True, 2, 2)


def default_form(broadcast: bool, inline: bool) -> str:
    """Which row of the defaults table a call uses: "inline", "first inline" (broadcast with a layer
    input), "broadcast" or "standard"."""
    if inline:
        return "first inline" if broadcast else "inline"
    return "broadcast" if broadcast else "standard"


def default_bands(H: int, form: str) -> tuple[tuple[int, Choice], ...]:
    """The defaults of one form at hidden size H: (first row, choice) bands in row order."""
    if form == "standard":
        if H >= 7168:
            return ((1, SPLIT_P), (17, T16_P), (41, SPLIT_P), (81, T32_P), (145, T256_RING_P), (257, RING_P))
        if H >= 5120:
            return ((1, SPLIT_P), (17, T16_P), (113, T32_STAGED_P), (177, T256_RING_P), (257, RING_P))
        if H >= 4096:
            return ((1, T32), (8, SPLIT_P), (25, T16_P), (113, T256_RING_P), (257, RING_P))
        return ((1, T32), (16, SPLIT), (33, T16_P), (49, T64_P), (65, T32_VEC), (129, T64_VEC), (384, T32_P))
    if form == "broadcast":
        if H >= 7168:
            return ((1, SPLIT_P), (305, T32_STAGED_P))
        if H >= 5120:
            return ((1, SPLIT_P), (417, T32_STAGED_P))
        if H >= 4096:
            return ((1, SPLIT_P),)
        return ((1, SPLIT), (97, T32), (129, T64_MB3_P))
    if form == "inline":
        if H >= 7168:
            return ((1, T32), (8, T32_P), (41, T32_VEC), (129, T32_P), (177, T64_P))
        if H >= 5120:
            return ((1, T32), (12, T32_P), (209, T64_P))
        if H >= 4096:
            return ((1, T32), (192, T64_VEC), (353, T64_P))
        return ((1, T32), (192, T64_VEC))
    if form == "first inline":
        return ((1, T32), (257, T64_VEC))
    raise ValueError(f"unknown defaults form {form!r}")


def default_choice(H: int, broadcast: bool, inline: bool, rows: int) -> Choice:
    """The defaults' Choice (rows_per_tile, push_vec, row_split, min_blocks, schedule, stage_rows, stage_depth,
    sum_buffers) for a call of `rows` rows."""
    choice = T32
    for first, band in default_bands(H, default_form(broadcast, inline)):
        if rows >= first:
            choice = band
    return choice


@functools.cache
def default_config(H: int, broadcast: bool, rows: int = 1, inline: bool = False) -> CoefficientsConfig:
    """The measured best config for a call of `rows` rows at hidden size H (memoized: one lookup per call)."""
    return _default_config(H, broadcast, *default_choice(H, broadcast, inline, rows))


@functools.cache
def _default_config(
    H: int,
    broadcast: bool,
    rows_per_tile: int,
    push_vec: bool = False,
    row_split: int = 1,
    min_blocks: int = 0,
    schedule: str = "tile",
    stage_rows: bool = False,
    stage_depth: int = 0,
    sum_buffers: int = 1,
) -> CoefficientsConfig:
    """The default config of one Choice."""
    return CoefficientsConfig.for_shape(
        H, broadcast, rows_per_tile, handoff=DEFAULT_HANDOFF, sinkhorn_unroll=DEFAULT_SINKHORN_UNROLL,
        push_vec=push_vec, row_split=row_split, min_blocks=min_blocks, schedule=schedule, stage_rows=stage_rows,
        stage_depth=stage_depth, sum_buffers=sum_buffers,
    )  # fmt: skip


def default_row_classes(H: int, broadcast: bool, inline: bool, max_rows: int) -> list[int]:
    """One row count per distinct default config of calls of 1..max_rows rows."""
    seen: dict[Choice, int] = {}
    for first, choice in default_bands(H, default_form(broadcast, inline)):
        if first <= max_rows:
            seen.setdefault(choice, first)
    return sorted(seen.values())


def norm_rows_per_cluster(H: int, threads: int, layer_input: str, requested: int = 0, budget: int = 2) -> int:
    """Rows per layer-input cluster: `requested`, or as many as `budget` (carried: 4 stream reads per
    vector) or 2*budget (one-hot) 16-byte vectors per thread cover, a power of two in 1..16. Budget 2
    keeps the layer-input code from raising the projection's registers (inline form), and ptxas
    from sinking the later vectors' loads below the first one's math (more vectors: one round trip each)."""
    if requested:
        return requested
    per_thread = budget if layer_input == "carried" else 2 * budget
    rows = max(1, min(16, per_thread * threads // (H // (CLUSTER * 8))))
    return 1 << (rows.bit_length() - 1)


def projection_width(H: int, broadcast: bool) -> int:
    """Columns of the projection input: 4H for the streams, H for the broadcast embedding."""
    return H if broadcast else HC * H


def _is_int_in(value: Any, allowed: tuple[int, ...]) -> bool:
    """Whether value is a plain int (not a bool, not a float like 2.0) among `allowed`."""
    return type(value) is int and value in allowed


def _check_hidden(H: int) -> None:
    if isinstance(H, bool) or not isinstance(H, int) or H < 256 or H % 256:
        raise ValueError(f"the hidden size must be a positive multiple of 256, got {H!r}")


# ---------------------------------------------------------------------------------------------
# Private PTX helpers
# ---------------------------------------------------------------------------------------------


def _not_sentinel(x: Float32) -> Float32:
    """x, or the canonical NaN where x has the sentinel's bits (arithmetic never gives them, this
    makes sure): a written workspace slot never reads as empty, so a NaN row cannot stall the poll."""
    bits = Float32(x).bitcast(Int32)
    return Int32(cutlass.select_(bits == Int32(SENTINEL), Int32(CANONICAL_NAN), bits)).bitcast(Float32)


def _dot8(x: list, f: list) -> Float32:
    """sum_c x[c] * f[c] over 8 values in column order: one multiply, then 7 fused multiply-adds."""
    acc = x[0] * f[0]
    for c in range(1, 8):
        acc = cute.math.fma(x[c], f[c], acc)
    return acc


# ---------------------------------------------------------------------------------------------
# The kernel
# ---------------------------------------------------------------------------------------------


class CoefficientsKernel:
    """post, comb and next pre of SPEC §3 (plus, inline, the layer input); variant and shape compile-time."""

    def __init__(
        self,
        H: int,
        *,
        variant: str = "standard",
        layer_input: str = "none",
        sinkhorn_repeat: int = 20,
        config: CoefficientsConfig | None = None,
    ) -> None:
        if variant not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
        if layer_input not in LAYER_INPUTS:
            raise ValueError(f"layer_input must be one of {LAYER_INPUTS}, got {layer_input!r}")
        if variant == "broadcast" and layer_input == "carried":
            raise ValueError(
                "the broadcast variant collapses to the embedding row: layer_input must be 'none' or 'one_hot'"
            )
        if isinstance(sinkhorn_repeat, bool) or not isinstance(sinkhorn_repeat, int) or sinkhorn_repeat < 1:
            raise ValueError(f"sinkhorn_repeat must be a positive int, got {sinkhorn_repeat!r}")
        self.broadcast = variant == "broadcast"
        config = config if config is not None else CoefficientsConfig.for_shape(H, self.broadcast)
        config.validate(H, self.broadcast)
        self.H = H
        self.layer_input = layer_input
        self.repeat = sinkhorn_repeat
        self.K = projection_width(H, self.broadcast)
        self.row_stride = H if self.broadcast else HC * H  # elements per row of the input tensor
        self.tm = config.rows_per_tile
        self.warps = config.warps  # 32-column chunks per CTA (with groups, the reduction order)
        self.groups = config.groups
        self.row_split = config.row_split
        self.cta_warps = config.warps * config.row_split
        self.threads = config.threads
        self.share = self.tm // CLUSTER  # rows of a tile each CTA of a cluster finishes
        self.stage_rows = config.stage_rows
        if (config.stage_rows or self.tm > 128) and layer_input != "none":
            raise ValueError("stage_rows and row tiles above 128 rows apply to the projection without a layer input")
        self.mtiles_per_batch = min(4, self.tm // 16)
        self.mtiles_per_warp = self.mtiles_per_batch // self.row_split
        self.batches = self.tm // (16 * self.mtiles_per_batch)
        self.batch_rows = 16 * self.mtiles_per_batch
        self.stage_slots = config.stage_depth or self.batches  # batch slots of the staging buffer
        self.sum_buffers = config.sum_buffers
        self.handoff = config.handoff
        self.prefetch = config.prefetch and self.batches > 1
        self.push_vec = config.push_vec
        self.min_blocks = config.min_blocks
        self.trace = config.trace
        self.comb_lanes = config.comb_lanes
        self.sinkhorn_unroll = config.sinkhorn_unroll
        self.projection = config.projection
        self.schedule = config.schedule
        # Layer-input clusters: each CTA owns H/8 columns of NR rows in 8-column vectors.
        self.vecs_per_row = H // (CLUSTER * 8)
        self.norm_rows = norm_rows_per_cluster(H, self.threads, layer_input, config.norm_rows)
        self.norm_vpt = -(-(self.norm_rows * self.vecs_per_row) // self.threads)
        self.norm_order = config.norm_order
        self.norm_per_tile = self.tm // self.norm_rows  # layer-input clusters per tile (interleaved)

    # -----------------------------------------------------------------------------------------
    # Host side
    # -----------------------------------------------------------------------------------------

    @cute.jit
    def __call__(
        self,
        mX: cute.Tensor,  # [T, 4, H] bf16 streams, or [T, H] bf16 embedding (broadcast)
        mFn: cute.Tensor,  # [24, K] fp32
        mScale: cute.Tensor,  # [3] fp32
        mBase: cute.Tensor,  # [24] fp32
        mPost: cute.Tensor,  # [T, 4] fp32
        mComb: cute.Tensor,  # [T, 4, 4] fp32, [src, dst]
        mPre: cute.Tensor,  # [T, 4] fp32 (next pre)
        mPartial: cute.Tensor,  # [>= G, >= T, 25] fp32 workspace
        mCounter: cute.Tensor,  # [>= ceil(T/TM)*8] int32 workspace, zero between calls
        mPreMix: cute.Tensor | None,  # [T, 4] fp32 carried pre (layer_input == "carried")
        mW: cute.Tensor | None,  # [H] bf16 norm weight (inline form)
        mOut: cute.Tensor | None,  # [T, H] bf16 layer input (inline form)
        mTrace: cute.Tensor | None,  # [CTAs * TRACE_SLOTS] int64 (trace builds)
        rms_eps: Float32,
        pre_eps: Float32,
        sinkhorn_eps: Float32,
        post_mult: Float32,
        norm_eps: Float32,
        stream: cuda.CUstream,
    ):
        rows = mX.shape[0]
        tiles = (rows + (self.tm - 1)) // self.tm
        if const_expr(self.schedule == "partials" and self.layer_input == "none"):
            self.partials_kernel(mX, mFn, mPartial).launch(
                grid=[CLUSTER, tiles * self.groups, 1],
                block=[self.threads, 1, 1],
                stream=stream,
                use_pdl=True,
                min_blocks_per_mp=self.min_blocks,
                preferred_smem_carveout=100 if self.min_blocks > 1 else None,
            )
        else:
            # With a layer input the partials schedule keeps this launch (its layer-input clusters
            # exchange sums of squares); its projection clusters skip the exchange and the handoff.
            norm_clusters = Int32(0)
            clusters = tiles * self.groups
            if const_expr(self.layer_input != "none"):
                if const_expr(self.norm_order == "front"):
                    norm_clusters = (rows + (self.norm_rows - 1)) // self.norm_rows
                    clusters = norm_clusters + tiles * self.groups
                else:
                    norm_clusters = tiles * self.norm_per_tile
                    clusters = tiles * (self.groups + self.norm_per_tile)
            self.kernel(
                mX, mFn, mScale, mBase, mPost, mComb, mPre, mPartial, mCounter, mPreMix, mW, mOut, mTrace,
                rms_eps, pre_eps, sinkhorn_eps, post_mult, norm_eps, norm_clusters,
            ).launch(
                grid=[CLUSTER, clusters, 1],
                block=[self.threads, 1, 1],
                cluster=[CLUSTER, 1, 1],
                stream=stream,
                use_pdl=True,
                min_blocks_per_mp=self.min_blocks,
                # The largest carveout, so shared memory does not cap the CTAs per SM below the bound.
                preferred_smem_carveout=100 if self.min_blocks > 1 else None,
            )  # fmt: skip
        if const_expr(self.schedule == "partials"):
            self.finish_kernel(
                mScale, mBase, mPost, mComb, mPre, mPartial, rms_eps, pre_eps, sinkhorn_eps, post_mult
            ).launch(
                grid=[rows, 1, 1],
                block=[self.finish_threads, 1, 1],
                stream=stream,
                use_pdl=True,
            )

    # -----------------------------------------------------------------------------------------
    # Device side
    # -----------------------------------------------------------------------------------------

    @cute.kernel
    def kernel(
        self,
        mX: cute.Tensor,
        mFn: cute.Tensor,
        mScale: cute.Tensor,
        mBase: cute.Tensor,
        mPost: cute.Tensor,
        mComb: cute.Tensor,
        mPre: cute.Tensor,
        mPartial: cute.Tensor,
        mCounter: cute.Tensor,
        mPreMix: cute.Tensor | None,
        mW: cute.Tensor | None,
        mOut: cute.Tensor | None,
        mTrace: cute.Tensor | None,
        rms_eps: Float32,
        pre_eps: Float32,
        sinkhorn_eps: Float32,
        post_mult: Float32,
        norm_eps: Float32,
        norm_clusters: Int32,
    ):
        rank, cluster_id, smem, mbar = self.cluster_prologue()

        if const_expr(self.layer_input != "none"):
            # Which role this cluster plays, and its index among the clusters of that role.
            norm = cluster_id < norm_clusters
            norm_cluster = cluster_id
            proj_cluster = cluster_id - norm_clusters
            if const_expr(self.norm_order == "interleave"):
                # Per tile: its G projection clusters, then the layer-input clusters of its rows.
                block = const_expr(self.groups + self.norm_per_tile)
                tile = cluster_id // block
                k = cluster_id - tile * block
                norm = k >= self.groups
                norm_cluster = tile * self.norm_per_tile + k - self.groups
                proj_cluster = tile * self.groups + k
            if norm:
                # A cluster past the last row (the tail of an interleaved grid) has nothing to do.
                if norm_cluster * self.norm_rows < mX.shape[0]:
                    self.layer_input_rows(smem, mbar, mX, mPreMix, mW, mOut, norm_eps, rank, norm_cluster)
            elif const_expr(self.schedule == "partials"):
                self.partials_role(smem, mX, mFn, mPartial, rank, proj_cluster)
            else:
                self.projection_role(
                    smem, mbar, mX, mFn, mScale, mBase, mPost, mComb, mPre, mPartial, mCounter, mTrace,
                    rms_eps, pre_eps, sinkhorn_eps, post_mult, rank, proj_cluster,
                )  # fmt: skip
        else:
            self.projection_role(
                smem, mbar, mX, mFn, mScale, mBase, mPost, mComb, mPre, mPartial, mCounter, mTrace,
                rms_eps, pre_eps, sinkhorn_eps, post_mult, rank, cluster_id,
            )  # fmt: skip

    @cute.jit
    def cta_coords(self, mX: cute.Tensor, rank: Int32, cluster: Int32) -> tuple:
        """(warp, lane, split, tile, group, row0, tile_rows, col) of a projection CTA: warp (chunk w,
        split s) takes the columns of chunk w and the m-tiles of split s of every batch; cluster index
        tile * G + group; col is the first of this lane's 8 columns."""
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        split = 0
        if const_expr(self.row_split > 1):
            split = warp // self.warps
            warp = warp - split * self.warps
        tile = cluster // self.groups
        group = cluster - tile * self.groups
        row0 = tile * self.tm
        tile_rows = cutlass.min(mX.shape[0] - row0, self.tm)
        col = ((group * CLUSTER + rank) * self.warps + warp) * CHUNK + (lane % 4) * 8
        return warp, lane, split, tile, group, row0, tile_rows, col

    @cute.jit
    def cluster_prologue(self) -> tuple:
        """(rank in the cluster, cluster index, shared-memory allocator, the exchange mbarrier
        initialised), after the cluster arrive that the first cluster_wait matches."""
        tidx, _, _ = cute.arch.thread_idx()
        rank, cluster_id, _ = cute.arch.block_idx()
        smem = cutlass.memory.SmemAllocator()
        mbar = smem.allocate_array(Int64, num_elems=1)
        if tidx == 0:
            cute.arch.mbarrier_init(mbar, 1)
        cute.arch.mbarrier_init_fence()
        # Peers push into this CTA's shared memory only after every CTA of the cluster got here.
        cute.arch.cluster_arrive_relaxed()
        return rank, cluster_id, smem, mbar

    @cute.jit
    def projection_role(
        self,
        smem: cutlass.memory.SmemAllocator,
        mbar: cute.Pointer,
        mX: cute.Tensor,
        mFn: cute.Tensor,
        mScale: cute.Tensor,
        mBase: cute.Tensor,
        mPost: cute.Tensor,
        mComb: cute.Tensor,
        mPre: cute.Tensor,
        mPartial: cute.Tensor,
        mCounter: cute.Tensor,
        mTrace: cute.Tensor | None,
        rms_eps: Float32,
        pre_eps: Float32,
        sinkhorn_eps: Float32,
        post_mult: Float32,
        rank: Int32,
        cluster: Int32,
    ):
        """One CTA of a projection cluster: its K slice of one row tile, then its share of the rows."""
        tidx, _, _ = cute.arch.thread_idx()
        self.stamp(mTrace, 0)
        warp, lane, split, tile, group, row0, tile_rows, col = self.cta_coords(mX, rank, cluster)
        share_rows = cutlass.max(cutlass.min(tile_rows - rank * self.share, self.share), 0)

        sWarp = smem.allocate_tensor(Float32, cute.make_layout(self.warps * self.batch_rows * NV), byte_alignment=16)
        sRecv = smem.allocate_tensor(Float32, cute.make_layout(CLUSTER * self.share * NV), byte_alignment=16)
        sMix = smem.allocate_tensor(Float32, cute.make_layout(self.share * NV), byte_alignment=16)
        sParam = smem.allocate_tensor(Float32, cute.make_layout(3 + MIX), byte_alignment=16)
        sFlag = smem.allocate_tensor(Int32, cute.make_layout(1), byte_alignment=4)
        sFn = None
        if const_expr(self.projection == "fma"):
            sFn = smem.allocate_tensor(Float32, cute.make_layout(MIX * self.warps * CHUNK), byte_alignment=16)

        # Weights before the wait (the previous kernel does not write them): this warp's fn slice
        # (with "fma", the CTA's, on its way to shared memory), and scale / base for whichever CTA
        # ends up running the epilogue.
        fn = None
        if const_expr(self.projection == "fma"):
            self.stage_fn(mFn, sFn, (group * CLUSTER + rank) * (self.warps * CHUNK))
        else:
            fn = self.load_fn(mFn, col, lane)
        if tidx < 3:
            sParam[tidx] = mScale[tidx]
        if tidx < MIX:
            sParam[3 + tidx] = mBase[tidx]
        cute.arch.griddepcontrol_wait()
        self.stamp(mTrace, 1)

        counter = mCounter.iterator + (tile * CLUSTER + rank)
        ticket = Int32(0)
        hi, lo = None, None
        words = self.load_rows(mX, row0, col, lane, split)
        for b in cutlass.range_constexpr(self.batches):
            batch_row0 = b * self.batch_rows
            if const_expr(b == 0):
                if const_expr(self.handoff == "ticket"):
                    # Take this CTA's ticket while the first rows are in flight.
                    if tidx == 0:
                        if share_rows > 0:
                            ticket = cute.arch.atomic_add(counter, Int32(1), sem="relaxed", scope="gpu")
                if const_expr(self.projection == "fma"):
                    # Every thread's share of the staged fn slice has landed, once the first rows
                    # are in flight.
                    cute.arch.cp_async_wait_group(0)
                    cute.arch.sync_threads()
                else:
                    # Split fn once the first rows are in flight, not before the wait.
                    hi, lo = self.split_fn(fn)
            current = words
            if const_expr(self.prefetch and b < self.batches - 1):
                words = self.load_rows(mX, row0 + batch_row0 + self.batch_rows, col, lane, split)
            if const_expr(self.projection == "fma"):
                self.project_batch_fma(current, sFn, sWarp, tile_rows - batch_row0, warp, lane, split)
            else:
                self.project_batch(current, hi, lo, sWarp, tile_rows - batch_row0, warp, lane, split)
            if const_expr(b == self.batches - 1):
                cute.arch.griddepcontrol_launch_dependents()
            if const_expr(b == 0 and self.handoff == "ticket"):
                if tidx == 0:
                    last = Int32(0)
                    if ticket == self.groups - 1:
                        # The last of the G to start: every other CTA of these rows is resident.
                        last = Int32(1)
                        cute.arch.store(counter, Int32(0))
                    sFlag[0] = last
            cute.arch.sync_threads()
            if const_expr(b == 0):
                self.stamp(mTrace, 2)
                cute.arch.cluster_wait()
                self.stamp(mTrace, 3)
                if tidx == 0:
                    if share_rows > 0:
                        cute.arch.mbarrier_arrive_and_expect_tx(mbar, CLUSTER * self.pushed(share_rows) * 4)
            self.push_batch(sWarp, sRecv, mbar, rank, batch_row0, tile_rows)
            if const_expr(b < self.batches - 1):
                if const_expr(not self.prefetch):
                    words = self.load_rows(mX, row0 + batch_row0 + self.batch_rows, col, lane, split)
                cute.arch.sync_threads()
        self.stamp(mTrace, 4)

        if share_rows > 0:
            cute.arch.mbarrier_wait(mbar, 0)
            self.stamp(mTrace, 5)
            share_row0 = row0 + rank * self.share
            if const_expr(self.handoff == "ticket"):
                consumer = sFlag[0] != 0
                if const_expr(self.trace):
                    if tidx == 0:
                        mTrace[self.trace_base() + TRACE_CONSUMER] = Int64(sFlag[0])
                for e in cutlass.range(tidx, share_rows * NV, self.threads):
                    # This cluster's partial of the share rows: peers summed in rank order.
                    acc = self.cluster_sum(sRecv, e)
                    grow = share_row0 + e // NV
                    n = e % NV
                    if consumer:
                        sMix[e] = self.gather_partials(mPartial, group, grow, n, acc)
                    else:
                        ptr = mPartial.iterator + cute.crd2idx((group, grow, n), mPartial.layout)
                        cute.arch.store(ptr, _not_sentinel(acc), sem="relaxed", scope="gpu")
                self.stamp(mTrace, 6)
                if consumer:
                    cute.arch.sync_threads()
                    self.finish_rows(
                        sMix, sParam, share_row0, share_rows, mPost, mComb, mPre, mTrace,
                        rms_eps, pre_eps, sinkhorn_eps, post_mult,
                    )  # fmt: skip
                    self.stamp(mTrace, 7)
            else:
                for e in cutlass.range(tidx, share_rows * NV, self.threads):
                    acc = self.cluster_sum(sRecv, e)
                    mPartial[group, share_row0 + e // NV, e % NV] = _not_sentinel(acc)
                cute.arch.sync_threads()
                if tidx == 0:
                    # Release (fence + relaxed atomic) on behalf of the whole CTA, after the barrier;
                    # the last arrival's fence is the acquire for the reads below.
                    cute.arch.fence_acq_rel_gpu()
                    arrived = cute.arch.atomic_add(counter, Int32(1), sem="relaxed", scope="gpu")
                    last = Int32(0)
                    if arrived == self.groups - 1:
                        last = Int32(1)
                        cute.arch.fence_acq_rel_gpu()
                        cute.arch.store(counter, Int32(0))
                    sFlag[0] = last
                cute.arch.sync_threads()
                if sFlag[0] != 0:
                    for e in cutlass.range(tidx, share_rows * NV, self.threads):
                        grow = share_row0 + e // NV
                        n = e % NV
                        vals = [self.load_partial(mPartial, g, grow, n) for g in range(self.groups)]
                        acc = vals[0]
                        for g in cutlass.range_constexpr(1, self.groups):
                            acc = acc + vals[g]
                        sMix[e] = acc
                        self.clear_partials(mPartial, grow, n)
                    cute.arch.sync_threads()
                    self.finish_rows(
                        sMix, sParam, share_row0, share_rows, mPost, mComb, mPre, mTrace,
                        rms_eps, pre_eps, sinkhorn_eps, post_mult,
                    )  # fmt: skip

    @cute.kernel
    def partials_kernel(self, mX: cute.Tensor, mFn: cute.Tensor, mRank: cute.Tensor):
        """schedule "partials", first launch without a layer input: the projection CTAs, no clusters."""
        rank, cluster, _ = cute.arch.block_idx()
        self.partials_role(cutlass.memory.SmemAllocator(), mX, mFn, mRank, rank, cluster)

    @cute.jit
    def partials_role(
        self, smem: cutlass.memory.SmemAllocator, mX: cute.Tensor, mFn: cute.Tensor, mRank: cute.Tensor,
        rank: Int32, cluster: Int32,
    ):  # fmt: skip
        """schedule "partials": CTA (rank, tile, group) of the tile schedule without the cluster exchange:
        its K slice of one row tile, summed over its warps in warp order (store_sums' sums), into slot
        group * 8 + rank of mRank [G * 8, T, 25]; no exchange, no handoff."""
        tidx, _, _ = cute.arch.thread_idx()
        sum_words = const_expr(self.warps * self.batch_rows * NV)
        sSums = smem.allocate_tensor(Float32, cute.make_layout(self.sum_buffers * sum_words), byte_alignment=16)
        warp, lane, split, tile, group, row0, tile_rows, col = self.cta_coords(mX, rank, cluster)
        slot = group * CLUSTER + rank
        sStage = None
        if const_expr(self.stage_rows):
            # [batch][CTA warp][m-tile][half] 128 words: a lane's 16 bytes at 4 * lane.
            sStage = smem.allocate_tensor(
                Int32,
                cute.make_layout(self.stage_slots * self.cta_warps * self.mtiles_per_warp * 2 * WARP * 4),
                byte_alignment=16,
            )
        fn = self.load_fn(mFn, col, lane)
        cute.arch.griddepcontrol_wait()
        words = None
        if const_expr(self.stage_rows):
            for b in cutlass.range_constexpr(self.stage_slots):
                self.copy_rows(mX, sStage, row0 + b * self.batch_rows, b, col, warp, lane, split)
                cute.arch.cp_async_commit_group()
        else:
            words = self.load_rows(mX, row0, col, lane, split)
        hi, lo = self.split_fn(fn)
        for b in cutlass.range_constexpr(self.batches):
            batch_row0 = b * self.batch_rows
            current = words
            if const_expr(self.stage_rows):
                # The copies of the batches after b issued so far may still be in flight.
                cute.arch.cp_async_wait_group(min(self.batches, self.stage_slots + b) - 1 - b)
                current = self.staged_rows(sStage, b % self.stage_slots, warp, lane, split)
            if const_expr(self.prefetch and b < self.batches - 1):
                words = self.load_rows(mX, row0 + batch_row0 + self.batch_rows, col, lane, split)
            sWarp = cute.make_tensor(sSums.iterator + (b % self.sum_buffers) * sum_words, cute.make_layout(sum_words))
            self.project_batch(current, hi, lo, sWarp, tile_rows - batch_row0, warp, lane, split)
            if const_expr(self.stage_rows and b + self.stage_slots < self.batches):
                # The MMAs above consumed this slot's words, so the lane may refill it.
                ahead = b + self.stage_slots
                self.copy_rows(
                    mX, sStage, row0 + ahead * self.batch_rows, ahead % self.stage_slots, col, warp, lane, split
                )
                cute.arch.cp_async_commit_group()
            if const_expr(b == self.batches - 1):
                cute.arch.griddepcontrol_launch_dependents()
            cute.arch.sync_threads()
            rows_here = cutlass.max(cutlass.min(tile_rows - batch_row0, self.batch_rows), 0)
            self.store_sums(sWarp, mRank, slot, row0 + batch_row0, rows_here)
            if const_expr(b < self.batches - 1):
                if const_expr(not self.prefetch and not self.stage_rows):
                    words = self.load_rows(mX, row0 + batch_row0 + self.batch_rows, col, lane, split)
                if const_expr(self.sum_buffers == 1):
                    # With two buffers, the barrier after the next batch's MMAs orders these reads
                    # before the batch after it writes this buffer again.
                    cute.arch.sync_threads()

    @cute.jit
    def store_sums(self, sWarp: cute.Tensor, mRank: cute.Tensor, slot: Int32, grow0: Int32, rows_here: Int32):
        """A batch's partials summed over the CTA's warps in warp order (warp_sum's additions) into
        mRank[slot, grow0 + r, n], 4 consecutive elements per thread: [rows][25] is contiguous both in a
        warp's block of sWarp and in mRank, so no thread divides by 25."""
        tidx, _, _ = cute.arch.thread_idx()
        block = const_expr(self.batch_rows * NV)  # one warp's partials; a multiple of 4
        vecs = const_expr(block // 4)
        count = rows_here * NV
        dst = mRank.iterator + cute.crd2idx((slot, grow0, 0), mRank.layout)
        for k in cutlass.range_constexpr(-(-vecs // self.threads)):
            e = (tidx + k * self.threads) * 4
            if e < count:  # count <= block: rows_here is at most a batch
                total = prim.ld_v4_f32(sWarp.iterator + e)
                for w in cutlass.range_constexpr(1, self.warps):
                    part = prim.ld_v4_f32(sWarp.iterator + (w * block + e))
                    total = tuple(total[i] + part[i] for i in range(4))
                for i in cutlass.range_constexpr(4):
                    if e + i < count:
                        cute.arch.store(dst + (e + i), total[i])

    def stage_slot(
        self, sStage: cute.Tensor, b: int, warp: Int32, lane: Int32, split, i: int, half: int
    ) -> cute.Pointer:
        """Where a lane's 16 bytes of (batch b, m-tile i of its split, half) sit in the staging buffer."""
        cta_warp = split * self.warps + warp
        return (
            sStage.iterator
            + ((((b * self.cta_warps + cta_warp) * self.mtiles_per_warp + i) * 2 + half) * WARP + lane) * 4
        )

    @cute.jit
    def copy_rows(
        self, mX: cute.Tensor, sStage: cute.Tensor, batch_row: Int32, b: int, col: Int32, warp: Int32, lane: Int32, split
    ):  # fmt: skip
        """load_rows into this lane's staging slots of batch slot b with cp.async (rows past the end read
        the last row; a batch wholly past the end copies nothing, and its MMAs are skipped)."""
        if batch_row < mX.shape[0]:
            for i in cutlass.range_constexpr(self.mtiles_per_warp):
                for half in cutlass.range_constexpr(2):
                    src = self.row_piece(mX, batch_row, col, lane, split, i, half)
                    prim.cp_async_16(self.stage_slot(sStage, b, warp, lane, split, i, half), src)

    @cute.jit
    def staged_rows(self, sStage: cute.Tensor, b: int, warp: Int32, lane: Int32, split) -> list:
        """This lane's words of batch b back from its staging slots, shaped as load_rows returns them."""
        return [
            [prim.ld_v4_i32(self.stage_slot(sStage, b, warp, lane, split, i, half)) for half in range(2)]
            for i in range(self.mtiles_per_warp)
        ]

    @property
    def finish_threads(self) -> int:
        """Threads of a finish CTA (schedule "partials"): one per (group, element) of its row, >= 2 warps."""
        return max(2, -(-self.groups * NV // WARP)) * WARP

    @cute.kernel
    def finish_kernel(
        self,
        mScale: cute.Tensor,
        mBase: cute.Tensor,
        mPost: cute.Tensor,
        mComb: cute.Tensor,
        mPre: cute.Tensor,
        mRank: cute.Tensor,
        rms_eps: Float32,
        pre_eps: Float32,
        sinkhorn_eps: Float32,
        post_mult: Float32,
    ):
        """schedule "partials", second launch: CTA b finishes row b. Thread (g, n) sums group g's 8 CTA
        partials of element n in rank order (the cluster sum; 8 loads in flight), then 25 threads sum
        the G groups in order (the finishing CTA's sum): the tile schedule's bits. Then the epilogue."""
        tidx, _, _ = cute.arch.thread_idx()
        row, _, _ = cute.arch.block_idx()
        smem = cutlass.memory.SmemAllocator()
        sGroup = smem.allocate_tensor(Float32, cute.make_layout(self.groups * NV), byte_alignment=16)
        sMix = smem.allocate_tensor(Float32, cute.make_layout(NV), byte_alignment=16)
        sParam = smem.allocate_tensor(Float32, cute.make_layout(3 + MIX), byte_alignment=16)
        if tidx < 3:
            sParam[tidx] = mScale[tidx]
        if tidx < MIX:
            sParam[3 + tidx] = mBase[tidx]
        cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()
        if tidx < self.groups * NV:
            g = tidx // NV
            n = tidx - g * NV
            parts = [mRank[g * CLUSTER + r, row, n] for r in range(CLUSTER)]
            acc = parts[0]
            for r in cutlass.range_constexpr(1, CLUSTER):
                acc = acc + parts[r]
            sGroup[tidx] = acc
        cute.arch.sync_threads()
        if tidx < NV:
            total = sGroup[tidx]
            for g in cutlass.range_constexpr(1, self.groups):
                total = total + sGroup[g * NV + tidx]
            sMix[tidx] = total
        cute.arch.sync_threads()
        self.finish_rows(
            sMix, sParam, row, Int32(1), mPost, mComb, mPre, None, rms_eps, pre_eps, sinkhorn_eps, post_mult
        )

    def trace_base(self) -> Int32:
        """This CTA's first slot in the trace buffer."""
        rank, cluster_id, _ = cute.arch.block_idx()
        return (cluster_id * CLUSTER + rank) * TRACE_SLOTS

    @cute.jit
    def stamp(self, mTrace: cute.Tensor | None, phase: int):
        """Trace builds: thread 0 records the time it reached `phase` (and its SM, at entry)."""
        if const_expr(self.trace):
            tidx, _, _ = cute.arch.thread_idx()
            if tidx == 0:
                base = self.trace_base()
                mTrace[base + phase] = prim.globaltimer()
                mTrace[base + 8 + phase] = prim.clock64()
                if const_expr(phase == 0):
                    mTrace[base + TRACE_SM] = Int64(prim.smid())

    @cute.jit
    def clock_stamp(self, mTrace: cute.Tensor | None, k: int):
        """Trace builds: thread 0 records clock64 at comb point k (TRACE_COMB; the loop's ends are
        block boundaries, so the reads stay put up to one instruction latency)."""
        if const_expr(self.trace):
            tidx, _, _ = cute.arch.thread_idx()
            if tidx == 0:
                mTrace[self.trace_base() + TRACE_COMB_SLOT + k] = prim.clock64()

    @cute.jit
    def warp_sum(self, sWarp: cute.Tensor, e: Int32) -> Float32:
        """Element e of a batch's partials summed over the CTA's warps in warp order."""
        acc = sWarp[e]
        for w in cutlass.range_constexpr(1, self.warps):
            acc = acc + sWarp[w * (self.batch_rows * NV) + e]
        return acc

    @cute.jit
    def cluster_sum(self, sRecv: cute.Tensor, e: Int32) -> Float32:
        """Element e of the share rows summed over the cluster's CTAs in rank order."""
        acc = sRecv[e]
        for r in cutlass.range_constexpr(1, CLUSTER):
            acc = acc + sRecv[r * (self.share * NV) + e]
        return acc

    @cute.jit
    def gather_partials(self, mPartial: cute.Tensor, group: Int32, row: Int32, n: Int32, own: Float32) -> Float32:
        """The sum over the G groups in order of one partial, this CTA's own for `group`: polls the
        other slots (all G reads in flight per round) until none holds the sentinel, then clears them."""
        pending = Int32(1)
        total = Float32(0.0)
        while pending != 0:
            vals = [self.load_partial(mPartial, g, row, n) for g in range(self.groups)]
            pending = Int32(0)
            total = own
            for g in cutlass.range_constexpr(self.groups):
                unset = vals[g].bitcast(Int32) == Int32(SENTINEL)
                pending = pending + cutlass.select_(unset & (group != g), Int32(1), Int32(0))
                v = cutlass.select_(group == g, own, vals[g])
                if const_expr(g > 0):
                    total = total + v
                else:
                    total = v
        self.clear_partials(mPartial, row, n)
        return total

    @cute.jit
    def clear_partials(self, mPartial: cute.Tensor, row: Int32, n: Int32):
        """Put the sentinel back in the G slots of one partial, for the next call."""
        for g in cutlass.range_constexpr(self.groups):
            ptr = mPartial.iterator + cute.crd2idx((g, row, n), mPartial.layout)
            cute.arch.store(ptr, Int32(SENTINEL).bitcast(Float32), sem="relaxed", scope="gpu")

    @cute.jit
    def load_fn(self, mFn: cute.Tensor, col: Int32, lane: Int32) -> list:
        """This lane's fp32 fn values: [n-tile j][8 columns] of fn row 8j + lane/4."""
        g = lane // 4
        fn = []
        for j in cutlass.range_constexpr(3):
            base = mFn.iterator + ((8 * j + g) * self.K + col)
            fn.append(list(prim.ld_v4_f32(base) + prim.ld_v4_f32(base + 4)))
        return fn

    @cute.jit
    def split_fn(self, fn: list) -> tuple:
        """B fragments of fn^T: [n-tile][pair] hi and lo bf16x2 words, pair p = columns 2p, 2p+1."""
        hi, lo = [], []
        for j in cutlass.range_constexpr(3):
            hj, lj = [], []
            for p in cutlass.range_constexpr(4):
                h, low = prim.split_bf16x2(fn[j][2 * p], fn[j][2 * p + 1])
                hj.append(h)
                lj.append(low)
            hi.append(hj)
            lo.append(lj)
        return hi, lo

    @cute.jit
    def stage_fn(self, mFn: cute.Tensor, sFn: cute.Tensor, cta_col: Int32):
        """Start copying this CTA's fn slice (24 rows of warps * 32 columns from `cta_col`) to sFn
        [n][warps * 32] with cp.async (no registers); complete after cp_async_wait_group(0) and a barrier."""
        tidx, _, _ = cute.arch.thread_idx()
        width = const_expr(self.warps * CHUNK // 4)  # 16-byte vectors per fn row
        total = const_expr(MIX * width)
        for k in cutlass.range_constexpr(-(-total // self.threads)):
            v = tidx + k * self.threads
            if v < total:
                n = v // width
                prim.cp_async_16(sFn.iterator + v * 4, mFn.iterator + (n * self.K + cta_col + (v - n * width) * 4))
        cute.arch.cp_async_commit_group()

    @cute.jit
    def row_piece(self, mX: cute.Tensor, batch_row: Int32, col: Int32, lane: Int32, split, i: int, half: int):
        """Where this lane's 16 bytes of m-tile i of its split, row g + 8 * half of a batch, start in the
        streams (rows past the end read the last row)."""
        mt = split * self.mtiles_per_warp + i
        row = cutlass.min(batch_row + mt * 16 + half * 8 + lane // 4, mX.shape[0] - 1)
        return mX.iterator + (row * self.row_stride + col)

    @cute.jit
    def load_rows(self, mX: cute.Tensor, batch_row: Int32, col: Int32, lane: Int32, split) -> list:
        """[m-tile of this warp's split][rows g, g + 8] 16-byte words of this lane's columns; rows past
        the end read the last row."""
        return [
            [prim.ld_v4_i32(self.row_piece(mX, batch_row, col, lane, split, i, half)) for half in range(2)]
            for i in range(self.mtiles_per_warp)
        ]

    @cute.jit
    def project_batch(
        self,
        words: list,
        hi: list,
        lo: list,
        sWarp: cute.Tensor,
        batch_rows: Int32,
        warp: Int32,
        lane: Int32,
        split,
    ):
        """The projection mainloop: this warp's 25 partial sums over its 32 columns for each row of its
        m-tiles of a batch (tensor-core MMAs on the loaded words), into sWarp; m-tiles past the end
        are skipped. (ptxas sinks a register-loaded m-tile's row loads into this guard, below the fn
        split: one round trip after the other outside PDL's overlap; config.stage_rows avoids it.)"""
        g = lane // 4
        t = lane % 4
        for i in cutlass.range_constexpr(self.mtiles_per_warp):
            mt = split * self.mtiles_per_warp + i
            if mt * 16 < batch_rows:
                upper, lower = words[i][0], words[i][1]  # rows g and g + 8 of the m-tile
                # Logical k {2t, 2t+1} <-> columns 8t+4s+{0,1}; k {2t+8, 2t+9} <-> 8t+4s+{2,3}.
                a = [(upper[2 * s], lower[2 * s], upper[2 * s + 1], lower[2 * s + 1]) for s in range(2)]
                base = (warp * self.batch_rows + mt * 16 + g) * NV
                # The Gram block of the 16 rows: B = A^T, whose fragments are A's own registers.
                gram0 = [Float32(0.0)] * 4
                gram1 = [Float32(0.0)] * 4
                for s in cutlass.range_constexpr(2):
                    gram0 = list(prim.mma_bf16(a[s], (upper[2 * s], upper[2 * s + 1]), gram0))
                    gram1 = list(prim.mma_bf16(a[s], (lower[2 * s], lower[2 * s + 1]), gram1))
                # Row g's square sum is Gram[g][g], held by lane t = g/2 in register g % 2 (c0/c1 for
                # rows 0-7, c2/c3 for rows 8-15).
                if t == g // 2:
                    odd = (g % 2) == 1
                    sWarp[base + MIX] = Float32(cutlass.select_(odd, gram0[1], gram0[0]))
                    sWarp[base + 8 * NV + MIX] = Float32(cutlass.select_(odd, gram1[3], gram1[2]))
                # One n-tile's chain at a time (k step 0 hi, lo, then step 1 hi, lo: each chain's own
                # order, so the order of the n-tiles does not change a bit): 4 live accumulators.
                for j in cutlass.range_constexpr(3):
                    acc = [Float32(0.0)] * 4
                    for s in cutlass.range_constexpr(2):
                        acc = list(prim.mma_bf16(a[s], (hi[j][2 * s], hi[j][2 * s + 1]), acc))
                        acc = list(prim.mma_bf16(a[s], (lo[j][2 * s], lo[j][2 * s + 1]), acc))
                    n = 8 * j + 2 * t
                    sWarp[base + n] = acc[0]
                    sWarp[base + n + 1] = acc[1]
                    sWarp[base + 8 * NV + n] = acc[2]
                    sWarp[base + 8 * NV + n + 1] = acc[3]

    @cute.jit
    def project_batch_fma(
        self, words: list, sFn: cute.Tensor, sWarp: cute.Tensor, batch_rows: Int32, warp: Int32, lane: Int32, split
    ):
        """project_batch on the CUDA cores: fp32 FMAs over this lane's 8 columns of rows g and g + 8
        (fn from shared memory), then the 4 lanes of a row summed by a reduce-scatter of 2 butterfly
        rounds; the same sWarp slots, sums of rows past the end dropped the same way."""
        g = lane // 4
        t = lane % 4
        upper_row = (lane & 2) != 0  # keeps row g + 8 after the first round, row g otherwise
        upper_n = (lane & 1) != 0  # keeps n in [12, 24) after the second round, [0, 12) otherwise
        half_n = const_expr(MIX // 2)
        fn_cols = sFn.iterator + (warp * CHUNK + 8 * t)
        for i in cutlass.range_constexpr(self.mtiles_per_warp):
            mt = split * self.mtiles_per_warp + i
            if mt * 16 < batch_rows:
                # Rows g and g + 8 as fp32, in column order (word e holds columns 2e, 2e + 1).
                x = []
                for half in cutlass.range_constexpr(2):
                    xs = []
                    for e in cutlass.range_constexpr(4):
                        xs += [prim.bf16_lo(words[i][half][e]), prim.bf16_hi(words[i][half][e])]
                    x.append(xs)
                # Per n, the two rows' sums, then round 1 of the reduction (lanes t, t ^ 2): each lane
                # keeps one row's value and sends the other's; round 2 (lanes t, t ^ 1) as soon as
                # n and n - 12 are both in, each lane keeping one of the two.
                part = []
                total = []
                for n in cutlass.range_constexpr(NV):
                    if const_expr(n < MIX):
                        ptr = fn_cols + n * (self.warps * CHUNK)
                        f = prim.ld_v4_f32(ptr) + prim.ld_v4_f32(ptr + 4)
                        sums = [_dot8(x[half], f) for half in range(2)]
                    else:
                        sums = [_dot8(x[half], x[half]) for half in range(2)]
                    keep = cutlass.select_(upper_row, sums[1], sums[0])
                    send = cutlass.select_(upper_row, sums[0], sums[1])
                    part.append(Float32(keep) + cute.arch.shuffle_sync_bfly(Float32(send), offset=2))
                    if const_expr(half_n <= n < MIX):
                        keep = cutlass.select_(upper_n, part[n], part[n - half_n])
                        send = cutlass.select_(upper_n, part[n - half_n], part[n])
                        total.append(Float32(keep) + cute.arch.shuffle_sync_bfly(Float32(send), offset=1))
                squares = part[MIX] + cute.arch.shuffle_sync_bfly(part[MIX], offset=1)
                row = mt * 16 + g + cutlass.select_(upper_row, Int32(8), Int32(0))
                base = (warp * self.batch_rows + row) * NV
                first = base + cutlass.select_(upper_n, Int32(half_n), Int32(0))
                for n in cutlass.range_constexpr(half_n):
                    sWarp[first + n] = total[n]
                if (lane & 1) == 0:
                    sWarp[base + MIX] = squares

    @cute.jit
    def push_batch(
        self, sWarp: cute.Tensor, sRecv: cute.Tensor, mbar: cute.Pointer, rank: Int32, batch_row0: int, tile_rows: Int32
    ):
        """Sum the warps' partials of a batch (warp order) and push each row to the CTA that owns it."""
        tidx, _, _ = cute.arch.thread_idx()
        rows_here = cutlass.max(cutlass.min(tile_rows - batch_row0, self.batch_rows), 0)
        seg = const_expr(self.share * NV)  # elements of one owner's rows
        if const_expr(self.push_vec):
            # 4 elements per store. seg, stride and batch_row0 * NV are multiples of 4, so a vector
            # never straddles two owners; the last one of an owner may run past its rows (padding
            # that nobody reads, counted by pushed()).
            for v in cutlass.range(tidx, (rows_here * NV + 3) // 4, self.threads):
                e = cute.assume(v * 4, divby=4)
                accs = []
                for k in cutlass.range_constexpr(4):
                    accs.append(self.warp_sum(sWarp, e + k).bitcast(Int32))
                flat = batch_row0 * NV + e
                owner = flat // seg
                slot = cute.assume(rank * seg + flat - owner * seg, divby=4)
                cute.arch.store_async_dsmem(sRecv.iterator + slot, tuple(accs), mbar, owner)
        else:
            for e in cutlass.range(tidx, rows_here * NV, self.threads):
                acc = self.warp_sum(sWarp, e)
                flat = batch_row0 * NV + e  # element index within the tile
                owner = flat // seg
                slot = rank * seg + flat - owner * seg
                cute.arch.store_async_dsmem(sRecv.iterator + slot, acc.bitcast(Int32), mbar, owner)

    def pushed(self, share_rows: Int32) -> Int32:
        """Elements each CTA of the cluster pushes to an owner of `share_rows` rows (whole vectors with push_vec)."""
        if const_expr(self.push_vec):
            return (share_rows * NV + 3) // 4 * 4
        return share_rows * NV

    @cute.jit
    def load_partial(self, mPartial: cute.Tensor, g: int, row: Int32, n: Int32) -> Float32:
        """One workspace partial, read at gpu scope (it was written by another CTA of this launch)."""
        ptr = mPartial.iterator + cute.crd2idx((g, row, n), mPartial.layout)
        return cute.arch.load(ptr, Float32, sem="relaxed", scope="gpu")

    @cute.jit
    def finish_rows(
        self,
        sMix: cute.Tensor,
        sParam: cute.Tensor,
        share_row0: Int32,
        share_rows: Int32,
        mPost: cute.Tensor,
        mComb: cute.Tensor,
        mPre: cute.Tensor,
        mTrace: cute.Tensor | None,
        rms_eps: Float32,
        pre_eps: Float32,
        sinkhorn_eps: Float32,
        post_mult: Float32,
    ):
        """The per-row epilogue of the share rows: warp 0 runs comb (the long Sinkhorn chain, comb_lanes
        lanes per row) and warp 1 pre and post (one lane per row), so they do not queue on one scheduler
        (a one-warp CTA runs pre and post on warp 0 after comb)."""
        tidx, _, _ = cute.arch.thread_idx()
        if tidx < WARP:
            self.row_comb(sMix, sParam, share_row0, share_rows, mComb, mTrace, rms_eps, sinkhorn_eps)
        pre_post_lane = tidx
        if const_expr(self.threads >= 2 * WARP):
            pre_post_lane = tidx - WARP
        if pre_post_lane >= 0 and pre_post_lane < share_rows:
            mixes = self.row_mixes(sMix, pre_post_lane, rms_eps, 2 * HC)
            self.row_pre_post(mixes, sParam, share_row0 + pre_post_lane, mPost, mPre, pre_eps, post_mult)

    @cute.jit
    def row_scale(self, sMix: cute.Tensor, i: Int32, rms_eps: Float32) -> Float32:
        """SPEC §3 step 1 for share row i: rsqrt(mean square + eps)."""
        return prim.rsqrt_approx(prim.div_rn(sMix[i * NV + MIX], Float32(self.K)) + rms_eps)

    @cute.jit
    def row_mixes(self, sMix: cute.Tensor, i: Int32, rms_eps: Float32, count: int) -> list:
        """The first `count` dot products of share row i times the row's scale."""
        r = self.row_scale(sMix, i, rms_eps)
        return [sMix[i * NV + n] * r for n in range(count)]

    @cute.jit
    def row_pre_post(
        self,
        mixes: list,
        sParam: cute.Tensor,
        row: Int32,
        mPost: cute.Tensor,
        mPre: cute.Tensor,
        pre_eps: Float32,
        post_mult: Float32,
    ):
        """SPEC §3 steps 2-3 of one row: the next pre and this post (sigmoids)."""
        for j in cutlass.range_constexpr(HC):
            z = mixes[j] * sParam[0] + sParam[3 + j]
            mPre[row, j] = prim.rcp_approx(Float32(1.0) + prim.exp_approx(-z)) + pre_eps
        for j in cutlass.range_constexpr(HC):
            z = mixes[HC + j] * sParam[1] + sParam[3 + HC + j]
            mPost[row, j] = prim.rcp_approx(Float32(1.0) + prim.exp_approx(-z)) * post_mult

    @cute.jit
    def row_comb(
        self,
        sMix: cute.Tensor,
        sParam: cute.Tensor,
        share_row0: Int32,
        share_rows: Int32,
        mComb: cute.Tensor,
        mTrace: cute.Tensor | None,
        rms_eps: Float32,
        sinkhorn_eps: Float32,
    ):
        """SPEC §3 step 4 on one warp: comb = Sinkhorn(softmax rows of the 16 comb logits). Lane
        (i, h) of the comb_lanes lanes of share row i holds rows [h*R, (h+1)*R) of the 4 x 4 matrix;
        lanes past the rows redo the last one (the column sums shuffle across the whole warp)."""
        self.clock_stamp(mTrace, 0)
        lane = cute.arch.lane_idx()
        nl = const_expr(self.comb_lanes)
        R = const_expr(HC // nl)
        i = cutlass.min(lane // nl, share_rows - 1)
        h = lane % nl
        r = self.row_scale(sMix, i, rms_eps)
        rC = cute.make_rmem_tensor((R * HC,), Float32)
        for k in cutlass.range_constexpr(R):
            a = h * R + k
            logits = []
            for b in cutlass.range_constexpr(HC):
                n = 2 * HC + HC * a + b
                logits.append((sMix[i * NV + n] * r) * sParam[2] + sParam[3 + n])
            top = cute.arch.fmax(cute.arch.fmax(logits[0], logits[1]), cute.arch.fmax(logits[2], logits[3]))
            ex = [prim.exp_approx(logits[b] - top) for b in range(HC)]
            inv = prim.rcp_approx((ex[0] + ex[1]) + (ex[2] + ex[3]))
            for b in cutlass.range_constexpr(HC):
                rC[k * HC + b] = ex[b] * inv + sinkhorn_eps
        self.normalize_columns(rC, sinkhorn_eps)
        # The repeats as a rolled loop of sinkhorn_unroll repeats per iteration, not straight-line
        # code: one warp runs this chain on an SM whose instruction cache has not seen it, and fully
        # unrolled (39 normalisations) it was fetch-bound (docs/PERF.md, v4; unroll 4: v5).
        self.clock_stamp(mTrace, 1)
        for _ in cutlass.range(self.repeat - 1, unroll=self.sinkhorn_unroll):
            self.sinkhorn_step(rC, sinkhorn_eps)
        self.clock_stamp(mTrace, 2)
        if lane // nl < share_rows:
            for k in cutlass.range_constexpr(R):
                for b in cutlass.range_constexpr(HC):
                    mComb[share_row0 + i, h * R + k, b] = rC[k * HC + b]
        self.clock_stamp(mTrace, 3)

    @cute.jit
    def sinkhorn_step(self, rC: cute.Tensor, eps: Float32):
        """One Sinkhorn repeat in place on this lane's rows of the matrix: rows, then columns."""
        for k in cutlass.range_constexpr(HC // self.comb_lanes):
            c = [rC[k * HC + b] for b in range(HC)]
            inv = prim.rcp_approx((c[0] + c[1]) + (c[2] + c[3]) + eps)
            for b in cutlass.range_constexpr(HC):
                rC[k * HC + b] = c[b] * inv
        self.normalize_columns(rC, eps)

    @cute.jit
    def normalize_columns(self, rC: cute.Tensor, eps: Float32):
        """C[a][b] / ((C[0][b] + C[1][b]) + (C[2][b] + C[3][b]) + eps) on this lane's rows. With 2 or 4
        lanes per matrix the partial sums come from the other lanes by butterfly shuffles; float
        addition commutes, so every lane gets the very bits of the one-lane sum."""
        R = const_expr(HC // self.comb_lanes)
        for b in cutlass.range_constexpr(HC):
            if const_expr(self.comb_lanes == 1):
                total = (rC[b] + rC[HC + b]) + (rC[2 * HC + b] + rC[3 * HC + b])
            elif const_expr(self.comb_lanes == 2):
                pair = rC[b] + rC[HC + b]
                total = pair + cute.arch.shuffle_sync_bfly(pair, offset=1)
            else:
                pair = rC[b] + cute.arch.shuffle_sync_bfly(rC[b], offset=1)
                total = pair + cute.arch.shuffle_sync_bfly(pair, offset=2)
            inv = prim.rcp_approx(total + eps)
            for k in cutlass.range_constexpr(R):
                rC[k * HC + b] = rC[k * HC + b] * inv

    @cute.jit
    def layer_input_rows(
        self,
        smem: cutlass.memory.SmemAllocator,
        mbar: cute.Pointer,
        mX: cute.Tensor,
        mPreMix: cute.Tensor | None,
        mW: cute.Tensor,
        mOut: cute.Tensor,
        norm_eps: Float32,
        rank: Int32,
        cluster: Int32,
    ):
        """One CTA of a layer-input cluster: collapse and RMSNorm of H/8 columns of NR rows."""
        tidx, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        rows = mX.shape[0]
        nr = const_expr(self.norm_rows)
        vpr = const_expr(self.vecs_per_row)
        vpt = const_expr(self.norm_vpt)
        row0 = cluster * nr
        sVec = smem.allocate_tensor(Float32, cute.make_layout(nr * vpr), byte_alignment=16)
        sRecv = smem.allocate_tensor(Float32, cute.make_layout(CLUSTER * nr), byte_alignment=16)

        # This thread's vectors: v = tidx + k*threads, row v // vpr, column block v % vpr.
        vec_in = []
        vec_row = []
        vec_col = []
        for k in cutlass.range_constexpr(vpt):
            v = cutlass.min(tidx + k * self.threads, nr * vpr - 1)
            vec_in.append(tidx + k * self.threads < nr * vpr)
            local_row = v // vpr
            vec_row.append(local_row)
            vec_col.append(rank * (self.H // CLUSTER) + (v - local_row * vpr) * 8)
        w_words = [prim.ld_v4_i32(mW.iterator + vec_col[k]) for k in range(vpt)]
        cute.arch.griddepcontrol_wait()

        # Every read in flight before any math.
        loaded = []
        for k in cutlass.range_constexpr(vpt):
            row = cutlass.min(row0 + vec_row[k], rows - 1)
            nstreams = HC if self.layer_input == "carried" else 1
            streams = [
                prim.ld_v4_i32(mX.iterator + (row * self.row_stride + j * self.H + vec_col[k])) for j in range(nstreams)
            ]
            pre = prim.ld_v4_f32(mPreMix.iterator + row * HC) if self.layer_input == "carried" else None
            loaded.append((streams, pre))
        # ptxas would otherwise sink the later vectors' loads below the first vector's math (one
        # memory round trip per vector); loads cannot move across a barrier.
        if const_expr(vpt > 1):
            cute.arch.sync_threads()

        c_words = []
        for k in cutlass.range_constexpr(vpt):
            streams, pre = loaded[k]
            if const_expr(self.layer_input == "carried"):
                cw = []
                for e in cutlass.range_constexpr(4):
                    vals = []
                    for half in cutlass.range_constexpr(2):
                        unpack = prim.bf16_lo if half == 0 else prim.bf16_hi
                        # Same order and roundings as the reference: pre0*R0, then + pre_j*R_j.
                        acc = prim.mul_rn(pre[0], unpack(streams[0][e]))
                        for j in cutlass.range_constexpr(1, HC):
                            acc = prim.add_rn(acc, prim.mul_rn(pre[j], unpack(streams[j][e])))
                        vals.append(acc)
                    cw.append(prim.cvt_bf16x2(vals[0], vals[1]))
                c_words.append(cw)
            else:
                c_words.append(list(streams[0]))
        cute.arch.griddepcontrol_launch_dependents()

        for k in cutlass.range_constexpr(vpt):
            part = Float32(0.0)
            for e in cutlass.range_constexpr(4):
                c0 = prim.bf16_lo(c_words[k][e])
                c1 = prim.bf16_hi(c_words[k][e])
                part = part + c0 * c0 + c1 * c1
            if vec_in[k]:
                sVec[tidx + k * self.threads] = part
        cute.arch.sync_threads()
        cute.arch.cluster_wait()
        if tidx == 0:
            cute.arch.mbarrier_arrive_and_expect_tx(mbar, CLUSTER * nr * 4)
        # One warp per row sums the row's vectors (fixed lane order, then a butterfly) and sends it
        # to every CTA of the cluster.
        for rr in cutlass.range_constexpr(0, nr, self.cta_warps):
            r = rr + warp
            if r < nr:
                part = Float32(0.0)
                for i in cutlass.range_constexpr(-(-vpr // 32)):
                    if lane + i * 32 < vpr:
                        part = part + sVec[r * vpr + lane + i * 32]
                part = cute.arch.warp_reduction_sum(part)
                if lane < CLUSTER:
                    cute.arch.store_async_dsmem(sRecv.iterator + (rank * nr + r), part.bitcast(Int32), mbar, lane)
        cute.arch.mbarrier_wait(mbar, 0)

        for k in cutlass.range_constexpr(vpt):
            total = sRecv[vec_row[k]]
            for p in cutlass.range_constexpr(1, CLUSTER):
                total = total + sRecv[p * nr + vec_row[k]]
            inv = prim.rsqrt_approx(prim.div_rn(total, Float32(self.H)) + norm_eps)
            out = []
            for e in cutlass.range_constexpr(4):
                lo_v = prim.mul_rn(prim.mul_rn(prim.bf16_lo(c_words[k][e]), inv), prim.bf16_lo(w_words[k][e]))
                hi_v = prim.mul_rn(prim.mul_rn(prim.bf16_hi(c_words[k][e]), inv), prim.bf16_hi(w_words[k][e]))
                out.append(prim.cvt_bf16x2(lo_v, hi_v))
            row = row0 + vec_row[k]
            if vec_in[k]:
                if row < rows:
                    prim.st_v4_i32(mOut.iterator + (row * self.H + vec_col[k]), tuple(out))


class LayerInputKernel(CoefficientsKernel):
    """The layer input alone (no projection, no workspace): c = the collapse (carried pre-mix) or
    stream 0 / the embedding row (one-hot), then out = RMSNorm_w(c). The same cluster code as the
    inline form, so the same bits; for the scheduler's main stream while the projection runs beside it."""

    def __init__(self, H: int, *, variant: str = "standard", layer_input: str = "carried",
                 config: LayerInputConfig | None = None) -> None:  # fmt: skip
        if variant not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
        if layer_input not in ("carried", "one_hot"):
            raise ValueError(f"layer_input must be 'carried' or 'one_hot', got {layer_input!r}")
        if variant == "broadcast" and layer_input == "carried":
            raise ValueError("the broadcast variant collapses to the embedding row: layer_input must be 'one_hot'")
        _check_hidden(H)
        config = config if config is not None else LayerInputConfig()
        config.validate()
        self.H = H
        self.broadcast = variant == "broadcast"
        self.layer_input = layer_input
        self.row_stride = H if self.broadcast else HC * H
        self.warps = config.warps
        self.cta_warps = config.warps
        self.threads = CHUNK * config.warps
        self.vecs_per_row = H // (CLUSTER * 8)
        self.norm_rows = norm_rows_per_cluster(H, self.threads, layer_input, config.norm_rows, INPUT_ONLY_BUDGET)
        self.norm_vpt = -(-(self.norm_rows * self.vecs_per_row) // self.threads)

    @cute.jit
    def __call__(
        self,
        mX: cute.Tensor,  # [T, 4, H] bf16 streams, or [T, H] bf16 embedding (broadcast)
        mPreMix: cute.Tensor | None,  # [T, 4] fp32 carried pre (layer_input == "carried")
        mW: cute.Tensor,  # [H] bf16 norm weight
        mOut: cute.Tensor,  # [T, H] bf16 layer input
        norm_eps: Float32,
        stream: cuda.CUstream,
    ):
        clusters = (mX.shape[0] + (self.norm_rows - 1)) // self.norm_rows
        self.kernel(mX, mPreMix, mW, mOut, norm_eps).launch(
            grid=[CLUSTER, clusters, 1],
            block=[self.threads, 1, 1],
            cluster=[CLUSTER, 1, 1],
            stream=stream,
            use_pdl=True,
            # Without it ptxas aims at full occupancy (32 registers) and sinks loads below math.
            min_blocks_per_mp=1,
        )

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mPreMix: cute.Tensor | None, mW: cute.Tensor, mOut: cute.Tensor,
               norm_eps: Float32):  # fmt: skip
        rank, cluster_id, smem, mbar = self.cluster_prologue()
        self.layer_input_rows(smem, mbar, mX, mPreMix, mW, mOut, norm_eps, rank, cluster_id)


# ---------------------------------------------------------------------------------------------
# Compile
# ---------------------------------------------------------------------------------------------


@jit_cache
def compile_coefficients(
    H: int, variant: str, layer_input: str, sinkhorn_repeat: int, config: CoefficientsConfig, *, arch: str
) -> Callable[..., Any]:
    """Compile one coefficients variant for `arch`; the row count and the workspace sizes stay dynamic."""
    check_arch(arch)
    kernel = CoefficientsKernel(
        H, variant=variant, layer_input=layer_input, sinkhorn_repeat=sinkhorn_repeat, config=config
    )
    T = cute.sym_int()
    K = kernel.K
    x = fake_tensor(BFloat16, (T, H) if kernel.broadcast else (T, HC, H), divisibility=8)
    f32 = lambda shape: fake_tensor(Float32, shape, divisibility=4)  # noqa: E731
    inline = layer_input != "none"
    args = (
        x,
        f32((MIX, K)),
        fake_tensor(Float32, (3,), divisibility=1),
        fake_tensor(Float32, (MIX,), divisibility=1),
        fake_tensor(Float32, (T, HC), divisibility=1),
        fake_tensor(Float32, (T, HC, HC), divisibility=1),
        fake_tensor(Float32, (T, HC), divisibility=1),
        fake_tensor(Float32, (cute.sym_int(), cute.sym_int(), NV), divisibility=1),
        fake_tensor(Int32, (cute.sym_int(),), divisibility=1),
        f32((T, HC)) if layer_input == "carried" else None,
        fake_tensor(BFloat16, (H,), divisibility=8) if inline else None,
        fake_tensor(BFloat16, (T, H), divisibility=8) if inline else None,
        fake_tensor(Int64, (cute.sym_int(),), divisibility=1) if config.trace else None,
        Float32(0.0),
        Float32(0.0),
        Float32(0.0),
        Float32(0.0),
        Float32(0.0),
    )
    return compile_kernel(kernel, *args, fake_stream(), arch=arch)


@jit_cache
def compile_layer_input(
    H: int, variant: str, layer_input: str, config: LayerInputConfig, *, arch: str
) -> Callable[..., Any]:
    """Compile the layer-input-only kernel for `arch`; the row count stays dynamic."""
    check_arch(arch)
    kernel = LayerInputKernel(H, variant=variant, layer_input=layer_input, config=config)
    T = cute.sym_int()
    args = (
        fake_tensor(BFloat16, (T, H) if kernel.broadcast else (T, HC, H), divisibility=8),
        fake_tensor(Float32, (T, HC), divisibility=4) if layer_input == "carried" else None,
        fake_tensor(BFloat16, (H,), divisibility=8),
        fake_tensor(BFloat16, (T, H), divisibility=8),
        Float32(0.0),
    )
    return compile_kernel(kernel, *args, fake_stream(), arch=arch)


def layer_input_mode(broadcast: bool, inline: bool, carried: bool) -> str:
    """The compile-time layer-input mode: none, the carried pre-mix collapse, or the one-hot stream 0."""
    if not inline:
        return "none"
    return "carried" if carried and not broadcast else "one_hot"


def coefficients_warmup_keys(
    H: int, *, sinkhorn_repeat: int = 20, max_rows: int = 512
) -> list[tuple[int, str, str, int, CoefficientsConfig]]:
    """The compile keys (positional args of compile_coefficients) every call of up to `max_rows` rows can need."""
    keys = []
    for variant, modes in (("standard", LAYER_INPUTS), ("broadcast", ("none", "one_hot"))):
        broadcast = variant == "broadcast"
        for mode in modes:
            inline = mode != "none"
            for rows in default_row_classes(H, broadcast, inline, max_rows):
                keys.append((H, variant, mode, sinkhorn_repeat, default_config(H, broadcast, rows, inline)))
    return keys


def layer_input_warmup_keys(H: int) -> list[tuple[int, str, str, LayerInputConfig]]:
    """The compile keys (positional args of compile_layer_input) of the layer-input-only kernel of hidden size H."""
    _check_hidden(H)
    return [
        (H, "standard", "carried", LayerInputConfig()),
        (H, "standard", "one_hot", LayerInputConfig()),
        (H, "broadcast", "one_hot", LayerInputConfig()),
    ]


def coefficients_warmup_jobs(H: int, *, arch: str, sinkhorn_repeat: int = 20, max_rows: int = 512) -> list[WarmupJob]:
    """WarmupJobs compiling every coefficients variant (and layer-input-only kernel) of hidden size H for `arch`."""
    check_arch(arch)
    jobs = [
        WarmupJob(
            f"coefficients H={key[0]} {key[1]} layer_input={key[2]} tile={key[4].rows_per_tile}"
            + (" split" if key[4].row_split > 1 else ""),
            compile_coefficients,
            key,
            (("arch", arch),),
        )
        for key in coefficients_warmup_keys(H, sinkhorn_repeat=sinkhorn_repeat, max_rows=max_rows)
    ]
    jobs += [
        WarmupJob(f"layer input H={key[0]} {key[1]} {key[2]}", compile_layer_input, key, (("arch", arch),))
        for key in layer_input_warmup_keys(H)
    ]
    return jobs


# ---------------------------------------------------------------------------------------------
# Host side: workspace and call
# ---------------------------------------------------------------------------------------------

MAX_ROWS = 16384
_BF16 = torch.bfloat16
_F32 = torch.float32


class CoefficientsWorkspace:
    """Partials [groups, max_rows, 25] fp32, per-(tile, CTA) arrival counters (int32, zero between calls)
    and the partials schedule's per-CTA sums [groups * 8, max_rows, 25] fp32.

    One workspace serves every variant of hidden size H on one device, but one launch at a time:
    two calls that may run concurrently (e.g. the main stream and an mHC side stream) need two
    workspaces. Counters are zeroed and partial slots set to the sentinel here, and every completed
    launch leaves them so.
    """

    def __init__(
        self,
        H: int,
        max_rows: int,
        device: Any,
        *,
        configs: tuple[CoefficientsConfig, ...] | None = None,
    ) -> None:
        _check_hidden(H)
        if isinstance(max_rows, bool) or not isinstance(max_rows, int) or not 1 <= max_rows <= MAX_ROWS:
            raise ValueError(f"max_rows must be an int in 1..{MAX_ROWS}, got {max_rows!r}")
        if max_rows * HC * H >= 2**31:
            raise ValueError(f"max_rows * 4 * H must stay below 2**31 (32-bit offsets), got {max_rows} * 4 * {H}")
        if configs is None:
            configs = (default_config(H, False), default_config(H, True))
        self.H = H
        self.max_rows = max_rows
        self.groups = max(c.groups for c in configs)
        # Every slot holds the sentinel between calls (the ticket handoff polls for it to change).
        self.partials = torch.full((self.groups, max_rows, NV), SENTINEL, dtype=torch.int32, device=device).view(_F32)
        # Sized for the smallest tile (16 rows), so any rows_per_tile fits.
        self.counters = torch.zeros((-(-max_rows // 16) * CLUSTER,), dtype=torch.int32, device=device)
        # The partials schedule's per-CTA sums [G * 8, max_rows, 25] (6.5 MB at H 7168 x 512 rows):
        # written by its first launch and read by its second within one call.
        self.rank_partials = torch.empty((self.groups * CLUSTER, max_rows, NV), dtype=_F32, device=device)
        self.device = self.partials.device

    def reset(self) -> None:
        """Zero the arrival counters and clear the partials (only needed after a launch was aborted)."""
        self.counters.zero_()
        self.partials.view(torch.int32).fill_(SENTINEL)


def mhc_coefficients(
    x: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    *,
    rms_eps: float,
    pre_eps: float,
    sinkhorn_eps: float,
    post_mult: float,
    sinkhorn_repeat: int,
    broadcast: bool,
    workspace: CoefficientsWorkspace,
    post_out: torch.Tensor,
    comb_out: torch.Tensor,
    pre_out: torch.Tensor,
    pre_mix: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    norm_eps: float | None = None,
    layer_input_out: torch.Tensor | None = None,
    arch: str,
    config: CoefficientsConfig | None = None,
    stream: torch.cuda.Stream | None = None,
    validate: bool = True,
    trace: torch.Tensor | None = None,
) -> None:
    """Write post [T,4], comb [T,4,4] and next pre [T,4] of SPEC §3, and with `layer_input_out` the layer input.

    `x` is the streams [T, 4, H] bf16 with `fn` [24, 4H], or with `broadcast` the first layer's
    embedding [T, H] with `fn_broadcast` [24, H]. With `layer_input_out` [T, H] bf16 (inline form)
    the kernel also writes RMSNorm_w(c): c = bf16(sum_j pre_mix[t, j] * R[t, j]), or R[t, 0] exactly
    when `pre_mix` is None (the embedding row itself with `broadcast`). One launch on the current
    torch stream, or on `stream` when given (the overlap form: the caller orders `stream` after the
    producer of `x` and joins it before reading the outputs). Outputs may not alias inputs;
    `post_out` may also be [T, 4, 1]. `validate=False` skips the host checks (hot path, inputs
    already known good). `trace` (int64, trace_slots() entries) goes with a config whose `trace` is
    set: a profiling build that writes the phase timestamps of every projection CTA there.
    """
    if validate:
        _check_call(
            x, fn, scale, base, rms_eps, pre_eps, sinkhorn_eps, post_mult, sinkhorn_repeat, broadcast, workspace,
            post_out, comb_out, pre_out, pre_mix, norm_weight, norm_eps, layer_input_out, arch, config, stream,
        )  # fmt: skip
    rows = x.shape[0]
    if rows == 0:
        return
    H = x.shape[-1]
    if config is None:
        config = default_config(H, broadcast, rows, layer_input_out is not None)
    if config.trace != (trace is not None):
        raise ValueError("trace must be given exactly when config.trace is set")
    if trace is not None:
        need = trace_slots(rows, config, broadcast, layer_input_out is not None)
        if trace.dtype != torch.int64 or trace.device != x.device or not trace.is_contiguous() or trace.numel() < need:
            raise ValueError(f"trace must be a contiguous int64 tensor of >= {need} entries on {x.device}")
    mode = layer_input_mode(broadcast, layer_input_out is not None, pre_mix is not None)
    compiled = compile_coefficients(
        H, "broadcast" if broadcast else "standard", mode, sinkhorn_repeat, config, arch=arch
    )
    if post_out.dim() == 3:
        post_out = post_out.view(rows, HC)
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        compiled(
            x, fn, scale, base, post_out, comb_out, pre_out,
            workspace.rank_partials if config.schedule == "partials" else workspace.partials, workspace.counters,
            pre_mix if mode == "carried" else None,
            norm_weight if mode != "none" else None,
            layer_input_out,
            trace,
            float(rms_eps), float(pre_eps), float(sinkhorn_eps), float(post_mult),
            float(norm_eps) if norm_eps is not None else 0.0,
        )  # fmt: skip


def trace_slots(rows: int, config: CoefficientsConfig, broadcast: bool, inline: bool) -> int:
    """Entries of the trace buffer a trace build of `config` needs for a call of `rows` rows."""
    tiles = -(-rows // config.rows_per_tile)
    clusters = tiles * config.groups
    if inline:  # the layer-input clusters (front or interleaved) take grid slots too; over-allocate
        clusters += rows
    return clusters * CLUSTER * TRACE_SLOTS


def mhc_layer_input(
    x: torch.Tensor,
    pre_mix: torch.Tensor | None,
    norm_weight: torch.Tensor,
    norm_eps: float,
    out: torch.Tensor,
    *,
    arch: str,
    broadcast: bool = False,
    config: LayerInputConfig | None = None,
    stream: torch.cuda.Stream | None = None,
    validate: bool = True,
) -> None:
    """Write the layer input alone: out = RMSNorm_w(c), c = bf16(sum_j pre_mix[t, j] * R[t, j]), or R[t, 0]
    exactly when `pre_mix` is None (the embedding row itself with `broadcast`, x then [T, H]).

    The same bits as the inline form of `mhc_coefficients`, without the projection and without a
    workspace: the scheduler runs it on the main stream while the projection runs on a side stream
    (first layer, Engram seams). One launch on the current torch stream, or on `stream`.
    """
    if validate:
        _check_layer_input_call(x, pre_mix, norm_weight, norm_eps, out, arch, broadcast, config, stream)
    if x.shape[0] == 0:
        return
    mode = "carried" if pre_mix is not None else "one_hot"
    compiled = compile_layer_input(
        x.shape[-1], "broadcast" if broadcast else "standard", mode,
        config if config is not None else LayerInputConfig(), arch=arch,
    )  # fmt: skip
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        compiled(x, pre_mix, norm_weight, out, float(norm_eps))


def _check_layer_input_call(
    x: Any, pre_mix: Any, norm_weight: Any, norm_eps: Any, out: Any, arch: Any, broadcast: Any, config: Any,
    stream: Any,
) -> None:  # fmt: skip
    """Raise TypeError / ValueError naming the first bad argument of mhc_layer_input; reads no device memory."""
    if not isinstance(broadcast, bool):
        raise TypeError(f"broadcast must be a bool, got {type(broadcast).__name__}")
    _check_tensor("x", x, _BF16, (None, None) if broadcast else (None, HC, None))
    rows, H = x.shape[0], x.shape[-1]
    _check_hidden(H)
    placed = [("x", x, 16)]
    placed.append(("out", _check_tensor("out", out, _BF16, (rows, H)), 16))
    placed.append(("norm_weight", _check_tensor("norm_weight", norm_weight, _BF16, (H,)), 16))
    if pre_mix is not None:
        if broadcast:
            raise ValueError("pre_mix must be None with broadcast: the first layer collapses to the embedding row")
        placed.append(("pre_mix", _check_tensor("pre_mix", pre_mix, _F32, (rows, HC)), 16))
    _check_float("norm_eps", norm_eps, minimum=0.0)
    check_arch(arch)
    if config is None:
        config = LayerInputConfig()
    elif not isinstance(config, LayerInputConfig):
        raise TypeError(f"config must be a LayerInputConfig or None, got {type(config).__name__}")
    config.validate()
    if stream is not None and not isinstance(stream, torch.cuda.Stream):
        raise TypeError(f"stream must be a torch.cuda.Stream or None, got {type(stream).__name__}")
    mode = "carried" if pre_mix is not None else "one_hot"
    if -(-rows // norm_rows_per_cluster(H, CHUNK * config.warps, mode, config.norm_rows, INPUT_ONLY_BUDGET)) > 65535:
        raise ValueError(f"{rows} rows need more than 65535 clusters")
    if rows and out.data_ptr() == x.data_ptr():
        raise ValueError("out must not alias x")
    dev = x.device
    if dev.type != "cuda":
        raise ValueError(f"x must be on a CUDA device, got {dev}")
    for name, t, align in placed:
        if t.device != dev:
            raise ValueError(f"{name} is on {t.device}, x is on {dev}")
        if t.data_ptr() % align:
            raise ValueError(f"{name} must start on a {align}-byte boundary (address {t.data_ptr():#x})")


def _check_call(
    x: Any, fn: Any, scale: Any, base: Any, rms_eps: Any, pre_eps: Any, sinkhorn_eps: Any, post_mult: Any,
    sinkhorn_repeat: Any, broadcast: Any, workspace: Any, post_out: Any, comb_out: Any, pre_out: Any,
    pre_mix: Any, norm_weight: Any, norm_eps: Any, layer_input_out: Any, arch: Any, config: Any, stream: Any,
) -> None:  # fmt: skip
    """Raise TypeError / ValueError naming the first bad argument; reads no device memory."""
    if not isinstance(broadcast, bool):
        raise TypeError(f"broadcast must be a bool, got {type(broadcast).__name__}")
    _check_tensor("x", x, _BF16, (None, None) if broadcast else (None, HC, None))
    rows, H = x.shape[0], x.shape[-1]
    _check_hidden(H)
    # (name, tensor, byte alignment the kernel relies on)
    placed = [("x", x, 16)]
    fn_name = "fn_broadcast" if broadcast else "fn"
    placed.append((fn_name, _check_tensor(fn_name, fn, _F32, (MIX, projection_width(H, broadcast))), 16))
    placed.append(("scale", _check_tensor("scale", scale, _F32, (3,)), 4))
    placed.append(("base", _check_tensor("base", base, _F32, (MIX,)), 4))
    post_shape = (rows, HC, 1) if isinstance(post_out, torch.Tensor) and post_out.dim() == 3 else (rows, HC)
    placed.append(("post_out", _check_tensor("post_out", post_out, _F32, post_shape), 4))
    placed.append(("comb_out", _check_tensor("comb_out", comb_out, _F32, (rows, HC, HC)), 4))
    placed.append(("pre_out", _check_tensor("pre_out", pre_out, _F32, (rows, HC)), 4))
    if layer_input_out is None:
        for arg, val in (("pre_mix", pre_mix), ("norm_weight", norm_weight), ("norm_eps", norm_eps)):
            if val is not None:
                raise ValueError(f"{arg} is only used by the inline form: pass layer_input_out too")
    else:
        placed.append(("layer_input_out", _check_tensor("layer_input_out", layer_input_out, _BF16, (rows, H)), 16))
        if norm_weight is None:
            raise ValueError("the inline form (layer_input_out) needs norm_weight [H] bf16")
        placed.append(("norm_weight", _check_tensor("norm_weight", norm_weight, _BF16, (H,)), 16))
        _check_float("norm_eps", norm_eps, minimum=0.0)
        if pre_mix is not None:
            if broadcast:
                raise ValueError("pre_mix must be None with broadcast: the first layer collapses to the embedding row")
            placed.append(("pre_mix", _check_tensor("pre_mix", pre_mix, _F32, (rows, HC)), 16))
            # The layer-input CTAs read pre_mix while the projection CTAs write pre_out.
            if rows and pre_mix.data_ptr() == pre_out.data_ptr():
                raise ValueError("pre_out must not alias pre_mix: write the next pre to a new tensor")
    _check_float("rms_eps", rms_eps, minimum=0.0)
    _check_float("pre_eps", pre_eps, minimum=0.0)
    _check_float("sinkhorn_eps", sinkhorn_eps, minimum=0.0)
    _check_float("post_mult", post_mult)
    if isinstance(sinkhorn_repeat, bool) or not isinstance(sinkhorn_repeat, int) or sinkhorn_repeat < 1:
        raise ValueError(f"sinkhorn_repeat must be a positive int, got {sinkhorn_repeat!r}")
    check_arch(arch)
    if config is None:
        config = default_config(H, broadcast, rows, layer_input_out is not None)
    elif not isinstance(config, CoefficientsConfig):
        raise TypeError(f"config must be a CoefficientsConfig or None, got {type(config).__name__}")
    config.validate(H, broadcast)
    if not isinstance(workspace, CoefficientsWorkspace):
        raise TypeError(f"workspace must be a CoefficientsWorkspace, got {type(workspace).__name__}")
    if workspace.H != H:
        raise ValueError(f"workspace is for H={workspace.H}, the call has H={H}")
    if stream is not None and not isinstance(stream, torch.cuda.Stream):
        raise TypeError(f"stream must be a torch.cuda.Stream or None, got {type(stream).__name__}")
    if rows > workspace.max_rows:
        raise ValueError(f"{rows} rows exceed the workspace capacity of {workspace.max_rows} rows")
    if config.groups > workspace.groups:
        raise ValueError(f"config needs {config.groups} partial groups, the workspace holds {workspace.groups}")
    tiles = -(-rows // config.rows_per_tile)
    norm_clusters = 0
    if layer_input_out is not None:
        mode = layer_input_mode(broadcast, True, pre_mix is not None)
        norm_rows = norm_rows_per_cluster(H, config.threads, mode, config.norm_rows)
        norm_clusters = (
            -(-rows // norm_rows) if config.norm_order == "front" else tiles * (config.rows_per_tile // norm_rows)
        )
    if norm_clusters + tiles * config.groups > 65535:
        raise ValueError(f"{rows} rows need more than 65535 clusters; use a larger rows_per_tile")
    dev = x.device
    if dev.type != "cuda":
        raise ValueError(f"x must be on a CUDA device, got {dev}")
    if workspace.device != dev:
        raise ValueError(f"workspace is on {workspace.device}, x is on {dev}")
    for name, t, align in placed:
        if t.device != dev:
            raise ValueError(f"{name} is on {t.device}, x is on {dev}")
        if t.data_ptr() % align:
            raise ValueError(f"{name} must start on a {align}-byte boundary (address {t.data_ptr():#x})")


def _check_tensor(name: str, t: Any, dtype: torch.dtype, shape: tuple) -> torch.Tensor:
    """Type, dtype, shape (None = any size) and contiguity of one tensor argument."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise TypeError(f"{name} must have dtype {dtype}, got {t.dtype}")
    if t.dim() != len(shape) or any(want is not None and got != want for got, want in zip(t.shape, shape)):
        want = ", ".join("*" if s is None else str(s) for s in shape)
        raise ValueError(f"{name} must have shape [{want}], got {list(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    return t


def _check_float(name: str, value: Any, *, minimum: float | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value!r}")
