"""The shipped defaults as data: per arch, form and hidden size, the knobs each band of row counts uses.

Every config of one H shares the split along K (config.projection_split), so a row's bits never depend
on which band a call falls in.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from cute_kernels.coefficients.config import CoefficientsConfig
from cute_kernels.coefficients.variant import CoefficientsVariant


@dataclass(frozen=True)
class Choice:
    """The knobs of one band: a CoefficientsConfig without the split along K (a function of H)."""

    rows_per_tile: int = 32
    push_vec: bool = False
    row_split: int = 1
    min_blocks: int = 0
    schedule: str = "tile"
    stage_rows: bool = False
    stage_depth: int = 0
    sum_buffers: int = 1

    def config(self, H: int, broadcast: bool) -> CoefficientsConfig:
        """This choice at hidden size H."""
        return CoefficientsConfig.for_shape(H, broadcast, **dataclasses.asdict(self))


# The choices the bands name; each band is the fastest choice of interleaved A/B runs (docs/PERF.md
# decisions: SM90A).
T32 = Choice(32)
T32_VEC = Choice(32, push_vec=True)
SPLIT = Choice(32, push_vec=True, row_split=2)
T64_VEC = Choice(64, push_vec=True)
SPLIT_P = Choice(32, row_split=2, schedule="partials")
T16_P = Choice(16, schedule="partials")
T32_P = Choice(32, schedule="partials")
T64_P = Choice(64, schedule="partials")
T64_MB3_P = Choice(64, min_blocks=3, schedule="partials")
T32_STAGED_P = Choice(32, schedule="partials", stage_rows=True)
# One 512- or 256-row tile, 4 warps per chunk, rows through a 2-batch staging ring, 2 buffers of warp sums.
RING_P = Choice(512, row_split=4, schedule="partials", stage_rows=True, stage_depth=2, sum_buffers=2)
T256_RING_P = Choice(256, row_split=4, schedule="partials", stage_rows=True, stage_depth=2, sum_buffers=2)

Bands = tuple[tuple[int, Choice], ...]  # (first row, choice) in row order
FORMS = ("standard", "broadcast", "inline", "first inline", "own")  # the values of CoefficientsVariant.form

# form -> ((smallest H, bands), ...), largest H first; the last entry serves every H below.
SM90A: dict[str, tuple[tuple[int, Bands], ...]] = {
    "standard": (
        (7168, ((1, SPLIT_P), (17, T16_P), (41, SPLIT_P), (81, T32_P), (145, T256_RING_P), (257, RING_P))),
        (5120, ((1, SPLIT_P), (17, T16_P), (113, T32_STAGED_P), (177, T256_RING_P), (257, RING_P))),
        (4096, ((1, T32), (8, SPLIT_P), (25, T16_P), (113, T256_RING_P), (257, RING_P))),
        (0, ((1, T32), (16, SPLIT), (33, T16_P), (49, T64_P), (65, T32_VEC), (129, T64_VEC), (384, T32_P))),
    ),
    "broadcast": (
        (7168, ((1, SPLIT_P), (305, T32_STAGED_P))),
        (5120, ((1, SPLIT_P), (417, T32_STAGED_P))),
        (4096, ((1, SPLIT_P),)),
        (0, ((1, SPLIT), (97, T32), (129, T64_MB3_P))),
    ),
    "inline": (
        (7168, ((1, T32), (8, T32_P), (41, T32_VEC), (129, T32_P), (177, T64_P))),
        (5120, ((1, T32), (12, T32_P), (209, T64_P))),
        (4096, ((1, T32), (192, T64_VEC), (353, T64_P))),
        (0, ((1, T32), (192, T64_VEC))),
    ),
    "first inline": ((0, ((1, T32), (257, T64_VEC))),),
    # DeepSeek-V4's own-pre layer input (the finishing CTAs collapse their rows): at one row a 32-row tile, the mixes
    # and the layer input in one launch; from two rows the partials schedule, whose finish kernel (one CTA per row)
    # collapses its row: two launches, where a tile's 8 finishing CTAs would serialise their rows (docs/PERF.md
    # decisions: own-pre bands).
    "own": (
        (7168, ((1, T32_VEC), (2, SPLIT_P), (41, T16_P), (97, T256_RING_P), (257, RING_P))),
        (0, ((1, SPLIT), (2, SPLIT_P), (257, RING_P))),
    ),
}
# sm_100a has not been measured: it takes the sm_90a (H200) table.
TABLES = {"sm_90a": SM90A, "sm_100a": SM90A}


def default_bands(H: int, form: str, *, arch: str) -> Bands:
    """The bands of one form at hidden size H on `arch`."""
    for smallest, bands in TABLES[arch][form]:
        if H >= smallest:
            return bands
    raise AssertionError("every table's last entry serves H >= 0")


def default_choice(H: int, variant: CoefficientsVariant, rows: int, *, arch: str) -> Choice:
    """The shipped choice for a call of `rows` rows of `variant` at hidden size H on `arch`."""
    choice = T32
    for first, band in default_bands(H, variant.form, arch=arch):
        if rows >= first:
            choice = band
    return choice


@functools.cache
def coefficients_config(H: int, variant: CoefficientsVariant, rows: int = 1, *, arch: str) -> CoefficientsConfig:
    """The shipped config for a call of `rows` rows of `variant` at hidden size H on `arch` (memoized: one lookup per
    call)."""
    return default_choice(H, variant, rows, arch=arch).config(H, variant.broadcast)


def default_row_classes(H: int, variant: CoefficientsVariant, max_rows: int, *, arch: str) -> list[int]:
    """One row count per distinct default config of calls of 1..max_rows rows of `variant`."""
    seen: dict[Choice, int] = {}
    for first, choice in default_bands(H, variant.form, arch=arch):
        if first <= max_rows:
            seen.setdefault(choice, first)
    return sorted(seen.values())
