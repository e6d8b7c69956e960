"""The fused boundary's compile-time launch shape and row schedule, and the factory of the shipped defaults."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from cute_kernels import HC, SCALE_WORD_COLS, VEC, hardware

COEFS = HC + HC * HC + HC  # post, comb ([src, dst], row-major) and pre of one row
# Launch bounds cap the registers at this many per thread, so that a known number of CTAs fit on an SM.
# The peer exchange holds W slot vectors besides the row: 96 registers spill there (ptxas remarks).
REGISTER_BUDGET = 96
PEER_REGISTER_BUDGET = 128
# The one-rank own-pre boundary holds its 128 fn values a thread (own_pre.OwnPreRole.load_fn) beside the row: ptxas
# takes 254 registers at H 7168, no spills (at 96 it spilled 84 bytes loading fn per row), so two CTAs per SM
# (docs/PERF.md decisions: fn_in_registers).
OWN_PRE_REGISTER_BUDGET = 255
# The cluster cap takes this share of the clusters that fit, so that every cluster is resident from
# the start (one that waited for a free slot would run its rows after the others had finished theirs).
RESIDENT_SHARE = 0.9
OTHER_SHARED_BYTES = 1024  # a bound on the cluster sum's slots and barriers
# Ranks sharing one GPU: their waiting grids together take at most this many CTAs per SM. With every cluster that
# fits, simulated decode steps stalled to the timeout: a late rank's kernels before its boundary need room beside
# the peers' waiting CTAs (docs/PERF.md decisions: SHARED_GPU_CTAS_PER_SM).
SHARED_GPU_CTAS_PER_SM = 1


@dataclass(frozen=True)
class BoundaryConfig:
    """One cluster of `cluster_n` CTAs of `threads` threads per row, at most `max_clusters` clusters looping
    over the rows, launch bounds of `min_ctas_per_sm` CTAs per SM."""

    cluster_n: int
    threads: int
    max_clusters: int
    min_ctas_per_sm: int
    fn_in_registers: bool = False  # own pre: its fn values in registers from before the PDL wait (OwnPreRole.load_fn)

    def vecs_per_thread(self, H: int) -> int:
        """16-byte vectors each thread owns in its CTA's chunk (the last may be idle on some threads)."""
        return -(-(H // self.cluster_n // VEC) // self.threads)

    def premix_fits(self, H: int) -> bool:
        """Whether the peer kernels' premix (Epilogue.premix: 8 x 16 fp32 bytes per vector and thread, in shared
        memory) fits beside the cluster sum's slots in every CTA of a full SM, so that it never costs residency."""
        premix = self.threads * self.vecs_per_thread(H) * HC * VEC * 4
        per_cta = premix + OTHER_SHARED_BYTES + hardware.SHARED_BYTES_RESERVED_PER_CTA
        return self.min_ctas_per_sm * per_cta <= hardware.SHARED_BYTES_PER_SM

    def clusters(self, rows: int) -> int:
        """Clusters launched for `rows` rows: the fewest rows per cluster under the cap, then the fewest
        clusters that give each that many (the kernel's host side computes the same)."""
        if rows == 0:
            return 0
        per_cluster = -(-rows // self.max_clusters)
        return -(-rows // per_cluster)


def _round_up(a: int, b: int) -> int:
    return -(-a // b) * b


def row_split(H: int) -> tuple[int, int]:
    """(CTAs per row, threads per CTA): 1024 columns (128 threads of one 16-byte vector) per CTA when H
    allows 2..8 of them, else the widest cluster (<= 8) whose CTAs own >= 512 columns in multiples of 128.

    Every CTA's chunk is a multiple of 128 columns, so MXFP8 blocks and 4-block scale words never
    straddle two CTAs. 128-thread CTAs with no idle lane over the widest split: docs/PERF.md decisions:
    row_split.
    """
    if H % 1024 == 0 and 2 <= H // 1024 <= hardware.MAX_CLUSTER:
        cluster_n = H // 1024
    else:
        widths = [n for n in range(1, hardware.MAX_CLUSTER + 1) if H % (n * SCALE_WORD_COLS) == 0 and H // n >= 512]
        cluster_n = max(widths, default=1)
    # One vector per thread while that takes at most 512 threads, else fewer threads with more vectors.
    vecs = H // cluster_n // VEC
    per_thread = 1
    while _round_up(-(-vecs // per_thread), 32) > 512:
        per_thread += 1
    return cluster_n, _round_up(-(-vecs // per_thread), 32)


@functools.cache
def default_config(
    H: int, arch: str, ranks_per_device: int = 1, world_size: int = 1, own_pre: bool = False
) -> BoundaryConfig:
    """The shipped launch shape and row schedule for hidden size H on `arch`'s hardware: a function of H
    (and the device, and whether the kernel computes its own pre), never of the row count, so a row's bits never
    depend on the batch.

    `ranks_per_device` > 1 (ranks sharing one GPU) divides the resident clusters among them, counting
    `SHARED_GPU_CTAS_PER_SM` CTAs per SM: every rank's grid must be resident at once, and leave room for
    the kernels a late rank runs before its boundary. `world_size` > 1 (the peer exchange) takes a larger
    register budget, so fewer CTAs per SM. `own_pre` at one rank: the own pre's fn values stay in registers
    (OWN_PRE_REGISTER_BUDGET), loaded before the PDL wait.
    """
    cluster_n, threads = row_split(H)
    # One vector a thread (128 fn values) and room for at least one CTA of them per SM; else fn per row from L2.
    vecs = H // cluster_n // VEC
    fn_in_registers = (
        own_pre
        and world_size == 1
        and vecs <= threads
        and hardware.REGISTERS_PER_SM // (OWN_PRE_REGISTER_BUDGET * threads) >= 1
    )
    budget = (
        OWN_PRE_REGISTER_BUDGET if fn_in_registers else REGISTER_BUDGET if world_size == 1 else PEER_REGISTER_BUDGET
    )
    ctas_per_sm = min(
        hardware.MAX_CTAS_PER_SM,
        hardware.MAX_THREADS_PER_SM // threads,
        hardware.REGISTERS_PER_SM // (budget * threads),
    )
    sms = hardware.for_arch(arch).sm_count
    resident = ctas_per_sm if ranks_per_device == 1 else min(ctas_per_sm, SHARED_GPU_CTAS_PER_SM)
    cap = int(RESIDENT_SHARE * (sms * resident // cluster_n)) // ranks_per_device
    return BoundaryConfig(cluster_n, threads, max(1, min(cap, hardware.MAX_GRID_Y)), ctas_per_sm, fn_in_registers)


# DeepSeek-V4's final boundary computes hc_head's weights in its own launch (mix=) up to this many elements of a
# stream (rows x H); beyond it, the residual-only boundary, then the coefficients kernel's head weights, collapse and
# norm, is faster: the one launch holds fn in registers at two CTAs per SM, so its few clusters take many rows each
# (docs/PERF.md decisions: OWN_PRE_FINAL_MAX_ELEMENTS; bench/experiments/final_paths.py).
OWN_PRE_FINAL_MAX_ELEMENTS = 512 * 4096


def own_pre_final(rows: int, H: int) -> bool:
    """Whether DeepSeek-V4's final boundary at `rows` x `H` computes hc_head's weights itself (one launch)."""
    return rows * H <= OWN_PRE_FINAL_MAX_ELEMENTS
