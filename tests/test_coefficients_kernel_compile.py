"""The coefficients kernels on the CPU: the split, the shipped defaults, every variant compiling for sm_90a (and for
sm_100a a covering subset: tests/compile_cover.py), the workspace, and the checks of the public edge (boundary/mhc.py)
that the kernels rely on."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from boundary import mhc
from cute_kernels import hardware
from cute_kernels.coefficients import api, tuning
from cute_kernels.coefficients.config import CHUNK, CLUSTER, CoefficientsConfig, projection_width
from cute_kernels.coefficients.layer_input import INLINE_BUDGET, INPUT_ONLY_BUDGET, norm_rows_per_cluster
from cute_kernels.coefficients.projection import SENTINEL
from cute_kernels.coefficients.variant import OWN_VARIANTS, VARIANTS, CoefficientsVariant
from tests.bf16 import exported
from tests.compile_cover import covering

BF16, F32 = torch.bfloat16, torch.float32
# The tables below name a variant by the two strings its kernels take (projection, layer input).
FORMS = tuple((p, tuple(v.layer_input for v in VARIANTS if v.projection == p)) for p in ("standard", "broadcast"))


def V(variant: str, mode: str) -> CoefficientsVariant:
    """The variant whose kernels take `variant` and `mode`."""
    return CoefficientsVariant(variant == "broadcast", mode.removesuffix("_unnormed"), not mode.endswith("_unnormed"))


def default(H: int, variant: str, rows: int = 1, inline: bool = False, arch: str = "sm_90a") -> CoefficientsConfig:
    return tuning.coefficients_config(H, CoefficientsVariant.of(variant == "broadcast", inline, True), rows, arch=arch)


# --- the split along K (a function of H only) ----------------------------------------------------


@pytest.mark.parametrize(
    "H,broadcast,warps,groups",
    [
        (4096, False, 4, 16),
        (5120, False, 5, 16),
        (7168, False, 7, 16),
        (4096, True, 2, 8),
        (5120, True, 2, 10),
        (7168, True, 2, 14),
    ],
)
def test_default_split_for_the_real_hidden_sizes(H: int, broadcast: bool, warps: int, groups: int) -> None:
    config = CoefficientsConfig.for_shape(H, broadcast)
    assert (config.rows_per_tile, config.warps, config.groups) == (32, warps, groups)
    assert config == tuning.T32.config(H, broadcast)  # the default knobs are the shipped 32-row tile


@pytest.mark.parametrize("broadcast", [False, True])
def test_default_split_tiles_every_multiple_of_256(broadcast: bool) -> None:
    for H in range(256, 16384 + 1, 256):
        config = CoefficientsConfig.for_shape(H, broadcast)
        assert config.groups * CLUSTER * config.warps * CHUNK == projection_width(H, broadcast)
        assert 1 <= config.warps <= 8


def test_choice_is_the_config_without_the_split() -> None:
    config_fields = [f.name for f in dataclasses.fields(CoefficientsConfig)]
    choice_fields = [f.name for f in dataclasses.fields(tuning.Choice)]
    assert choice_fields == [f for f in config_fields if f not in ("warps", "groups")]
    assert dataclasses.asdict(tuning.Choice()) == {
        f.name: f.default for f in dataclasses.fields(CoefficientsConfig) if f.name in choice_fields[1:]
    } | {"rows_per_tile": 32}


# --- the shipped defaults ------------------------------------------------------------------------


def test_sm100a_takes_the_sm90a_table() -> None:
    assert tuning.TABLES["sm_100a"] is tuning.TABLES["sm_90a"]
    assert default(7168, "standard", 300, arch="sm_100a") == default(7168, "standard", 300)


def test_every_default_is_well_formed() -> None:
    # What config.validate used to check on every call, checked once on the whole table: the kernels
    # trust their configs.
    for H in range(256, 16384 + 1, 256):
        for form in tuning.FORMS:
            broadcast, inline = form in ("broadcast", "first inline"), "inline" in form
            for _first, choice in tuning.default_bands(H, form, arch="sm_90a"):
                config = choice.config(H, broadcast)
                tm = config.rows_per_tile
                assert tm in (16, 32, 64, 128, 256, 512) and (tm <= 128 or config.schedule == "partials")
                assert config.row_split in (1, 2, 4) and min(4, tm // 16) % config.row_split == 0
                assert not config.push_vec or (tm >= 32 and config.schedule == "tile")
                assert config.min_blocks * config.threads <= hardware.MAX_THREADS_PER_SM
                assert not config.stage_rows or config.schedule == "partials"
                assert not config.stage_depth or (config.stage_rows and config.stage_depth < tm // 64)
                assert config.sum_buffers == 1 or (config.schedule == "partials" and tm > 64)
                if inline:  # staging and tiles above 128 rows exist for the projection alone
                    assert not config.stage_rows and tm <= 128
                if config.schedule == "tile":  # one lane of the epilogue warp per row a CTA finishes
                    assert tm // CLUSTER <= 32


@pytest.mark.parametrize("H", (4096, 5120, 7168))
def test_every_call_finds_its_default_among_the_warmup_jobs(H: int) -> None:
    # Every call of 1..512 rows, whatever its form, gets a config that the warmup compiles.
    jobs = api.warmup_jobs(H, arch="sm_90a", max_rows=512, unnormed=True)
    compiled = {(job.args[1], job.args[3]) for job in jobs if job.compile_fn is api.compile_coefficients}
    for variant, modes in FORMS:
        for mode in modes:
            for rows in range(1, 513):
                assert (V(variant, mode), default(H, variant, rows, mode != "none")) in compiled, (variant, mode, rows)


def test_the_warmup_compiles_for_the_layers_sinkhorn_count() -> None:
    """The Sinkhorn count is compiled into the coefficients kernels: warmup compiles the one it is given (the
    models' 20 unless told), so a model with another count loads nothing at its first call."""
    default = [job.args[2] for job in mhc.warmup_jobs(7168, "sm_90a", 64) if job.compile_fn is api.compile_coefficients]
    other = mhc.warmup_jobs(7168, "sm_90a", 64, sinkhorn_repeat=7)
    assert set(default) == {20} and {job.args[2] for job in other if job.compile_fn is api.compile_coefficients} == {7}
    assert len(default) == sum(job.compile_fn is api.compile_coefficients for job in other)


def test_warmup_jobs_cover_every_call_path() -> None:
    jobs = api.warmup_jobs(7168, arch="sm_90a", max_rows=512, unnormed=True)
    # Without `unnormed` (the scheduler's warmup) the unnormed layer-input modes are left out, nothing else.
    normed = api.warmup_jobs(7168, arch="sm_90a", max_rows=512)
    assert [j.args for j in normed] == [j.args for j in jobs if j.args[1].normed] and len(normed) == 20
    keys = [job.args for job in jobs if job.compile_fn is api.compile_coefficients]
    # (variant, layer input, rows_per_tile, push_vec, row_split, schedule, stage_rows) of each compiled default
    assert [
        (k[1].projection, k[1].layer_input, k[3].rows_per_tile, k[3].push_vec, k[3].row_split, k[3].schedule)
        + (k[3].stage_rows,)
        for k in keys
    ] == [
        ("standard", "none", 32, False, 2, "partials", False),
        ("standard", "none", 16, False, 1, "partials", False),
        ("standard", "none", 32, False, 1, "partials", False),
        ("standard", "none", 256, False, 4, "partials", True),
        ("standard", "none", 512, False, 4, "partials", True),
        ("standard", "carried", 32, False, 1, "tile", False),
        ("standard", "carried", 32, False, 1, "partials", False),
        ("standard", "carried", 32, True, 1, "tile", False),
        ("standard", "carried", 64, False, 1, "partials", False),
        ("standard", "one_hot", 32, False, 1, "tile", False),
        ("standard", "one_hot", 32, False, 1, "partials", False),
        ("standard", "one_hot", 32, True, 1, "tile", False),
        ("standard", "one_hot", 64, False, 1, "partials", False),
        # Without a norm weight (the collapse itself): the configs of the normalised forms.
        ("standard", "carried_unnormed", 32, False, 1, "tile", False),
        ("standard", "carried_unnormed", 32, False, 1, "partials", False),
        ("standard", "carried_unnormed", 32, True, 1, "tile", False),
        ("standard", "carried_unnormed", 64, False, 1, "partials", False),
        ("standard", "one_hot_unnormed", 32, False, 1, "tile", False),
        ("standard", "one_hot_unnormed", 32, False, 1, "partials", False),
        ("standard", "one_hot_unnormed", 32, True, 1, "tile", False),
        ("standard", "one_hot_unnormed", 64, False, 1, "partials", False),
        ("broadcast", "none", 32, False, 2, "partials", False),
        ("broadcast", "none", 32, False, 1, "partials", True),
        ("broadcast", "one_hot", 32, False, 1, "tile", False),
        ("broadcast", "one_hot", 64, True, 1, "tile", False),
        ("broadcast", "one_hot_unnormed", 32, False, 1, "tile", False),
        ("broadcast", "one_hot_unnormed", 64, True, 1, "tile", False),
    ]
    # Since v10 no default at H 7168 takes a launch bound (the broadcast 64-row tiles of 3 CTAs per SM lost
    # to split and staged 32-row tiles).
    assert [(i, k[3].min_blocks) for i, k in enumerate(keys) if k[3].min_blocks] == []
    # The staging ring with two buffers of warp sums: the standard projection's 256- and 512-row tiles.
    assert [(i, k[3].stage_depth, k[3].sum_buffers) for i, k in enumerate(keys) if k[3].stage_depth] == [
        (3, 2, 2),
        (4, 2, 2),
    ]
    assert default(4096, "standard", 300).min_blocks == 0  # the 512-row ring
    assert default(8192, "standard", 512).min_blocks == 0  # partials
    # With a layer input the partials schedule takes 8-40 and 129-512 rows at H 7168, 12-512 at 5120 and
    # 353-512 at 4096; the first layer's inline form stays on the tile schedule.
    assert default(7168, "standard", 129, inline=True).schedule == "partials"
    assert default(7168, "standard", 16, inline=True).schedule == "partials"
    assert default(7168, "standard", 128, inline=True).schedule == "tile"
    assert default(7168, "broadcast", 512, inline=True).schedule == "tile"
    assert default(5120, "standard", 512, inline=True).schedule == "partials"
    assert default(4096, "standard", 300, inline=True).schedule == "tile"
    assert all((H, repeat) == (7168, 20) for H, _variant, repeat, _config in keys)
    # Up to 16 rows: the split partials tile (standard and broadcast), the plain tile and the 32-row
    # partials tile (the inline forms, carried and one-hot, normalised or not; the first layer's only the plain
    # tile): 1 + 2 x 2 x 2 + 1 + 2.
    for H in (7168, 5120):
        few = api.warmup_jobs(H, arch="sm_90a", max_rows=16, unnormed=True)
        assert len([job for job in few if job.compile_fn is api.compile_coefficients]) == 12
    # Then the layer-input-only kernels, in their three modes, normalised and not.
    assert [job.args for job in jobs if job.compile_fn is api.compile_layer_input] == [
        (7168, V("standard", "carried")),
        (7168, V("standard", "one_hot")),
        (7168, V("standard", "carried_unnormed")),
        (7168, V("standard", "one_hot_unnormed")),
        (7168, V("broadcast", "one_hot")),
        (7168, V("broadcast", "one_hot_unnormed")),
    ]
    assert len(jobs) == len(keys) + 6 and all(dict(job.kwargs) == {"arch": "sm_90a"} for job in jobs)
    assert {job.compile_fn for job in jobs} == {api.compile_coefficients, api.compile_layer_input}


def test_the_v4_kernels_join_the_warmup_only_when_asked() -> None:
    """mhc.warmup_jobs(own_pre=True): hc_head's standard variant with one Sinkhorn repeat (per row class, as the
    layers' standard variant) and the carried layer input in each quantized form named; nothing of it by default, and
    no quantized layer input at an H the kernel refuses them at."""
    from boundary import mhc

    plain = mhc.warmup_jobs(7168, "sm_90a", 512, quantized=("mxfp8", "fp8_1x128"))
    v4 = mhc.warmup_jobs(7168, "sm_90a", 512, own_pre=True, quantized=("mxfp8", "fp8_1x128"))
    added = [job.args for job in v4 if job.args not in [j.args for j in plain]]
    standard = [
        job.args for job in plain if job.compile_fn is api.compile_coefficients and job.args[1] == CoefficientsVariant()
    ]
    head = [(H, v, mhc.HEAD_SINKHORN_REPEAT, config) for H, v, _, config in standard]
    own = [CoefficientsVariant.own(q) for q in (None, "mxfp8", "fp8_1x128")]
    classes = tuning.default_row_classes(7168, own[0], 512, arch="sm_90a")
    configs = [tuning.coefficients_config(7168, own[0], rows, arch="sm_90a") for rows in classes]
    assert configs[0].schedule == "tile"  # one launch for the mixes and the layer input at one row
    carried = V("standard", "carried")
    assert added == [(7168, v, 20, c) for v in own for c in configs] + head + [
        *((7168, own[0], mhc.HEAD_SINKHORN_REPEAT, c) for c in configs),
        (7168, carried, "mxfp8"),
        (7168, carried, "fp8_1x128"),
    ]
    odd = mhc.warmup_jobs(1536, "sm_90a", 16, own_pre=True, quantized=("mxfp8",))
    assert not [job for job in odd if len(job.args) == 3]  # H 1536: no quantized layer input
    assert not [job for job in odd if len(job.args) == 4 and job.args[1].quant is not None]
    first = next(job for job in v4 if job.args == head[0])
    assert exported(first.compile_fn(*first.args, **dict(first.kwargs)))  # one Sinkhorn repeat compiles


def test_a_calls_variant_and_its_names() -> None:
    """CoefficientsVariant.of decides a call's variant once; its kernels' strings, its tuning form and the warmup list
    (VARIANTS: every valid one) follow from it."""
    of = CoefficientsVariant.of
    assert of(False, False, True) == CoefficientsVariant() and of(False, False, True).layer_input == "none"
    assert of(False, True, True).layer_input == "carried" and of(False, True, True).form == "inline"
    assert of(False, True, False).layer_input == "one_hot"
    assert of(True, True, True) == CoefficientsVariant(True, "one_hot")  # the first layer's collapse: its embedding row
    assert of(True, True, False, normed=False).layer_input == "one_hot_unnormed"
    assert of(True, True, False).form == "first inline" and of(True, False, False).form == "broadcast"
    assert {v.form for v in VARIANTS + OWN_VARIANTS} == set(tuning.FORMS)
    assert len(set(VARIANTS)) == len(VARIANTS) == 8
    own = CoefficientsVariant.own("fp8_1x128")
    assert own.layer_input == "own" and own.form == "own" and own.inline
    assert own.name == "standard layer_input=own fp8_1x128"


# --- every variant compiles (sm_90a; sm_100a at the end of the section) --------------------------------------------------------


COMPILE_CASES = [(7168, variant, mode) for variant, modes in FORMS for mode in modes]
COMPILE_CASES += [(4096, "standard", "none"), (4096, "standard", "carried"), (4096, "broadcast", "one_hot")]


@pytest.mark.parametrize("H,variant,mode", COMPILE_CASES)
def test_variant_compiles(H: int, variant: str, mode: str) -> None:
    config = default(H, variant, inline=mode != "none")
    assert exported(api.compile_coefficients(H, V(variant, mode), 20, config, arch="sm_90a"))


@pytest.mark.parametrize(
    "H,variant",
    [(H, v) for H in (4096, 7168) for v in OWN_VARIANTS] + [(5120, OWN_VARIANTS[0]), (1024, OWN_VARIANTS[1])],
)
def test_own_pre_variants_compile(H: int, variant: CoefficientsVariant) -> None:
    """DeepSeek-V4's own-pre variant, bf16 alone and with each quantized form, at its shipped tile config; and at the
    partials schedule (its finish kernel collapses the row)."""
    config = tuning.coefficients_config(H, variant, 1, arch="sm_90a")
    assert exported(api.compile_coefficients(H, variant, 20, config, arch="sm_90a"))
    if variant.quant in (None, "mxfp8"):
        partials = tuning.Choice(32, schedule="partials").config(H, False)
        assert exported(api.compile_coefficients(H, variant, 20, partials, arch="sm_90a"))


@pytest.mark.parametrize(
    "quant,schedule", [(None, "tile"), ("mxfp8", "partials"), ("fp8_1x128", "tile"), ("fp8_1x128_ue8m0", "partials")]
)
def test_own_pre_variants_compile_for_sm100a(quant: str | None, schedule: str) -> None:
    """The second target's cover of the own-pre variant: each quantized form once, the tile CTA's and the finish
    kernel's layer input each twice."""
    variant = CoefficientsVariant.own(quant)
    config = tuning.Choice(32, push_vec=schedule == "tile", schedule=schedule).config(7168, False)
    assert exported(api.compile_coefficients(7168, variant, 20, config, arch="sm_100a"))


def test_a_row_split_that_leaves_a_warp_without_m_tiles_is_refused() -> None:
    """row_split must divide a batch's 16-row m-tiles (min(4, rows_per_tile / 16)): a 16-row tile split over two warps
    would leave one warp's columns out of every row's mixes (an A/B timed such configs on 2026-12-04; the GPU test of
    the own-pre variant caught their wrong mixes)."""
    from cute_kernels.coefficients.kernel import CoefficientsKernel

    for tm, split in ((16, 2), (16, 4), (32, 4)):
        with pytest.raises(ValueError, match=f"row_split {split} must divide"):
            CoefficientsKernel(4096, config=CoefficientsConfig.for_shape(4096, False, tm, row_split=split))
    CoefficientsKernel(4096, config=CoefficientsConfig.for_shape(4096, False, 64, row_split=4))  # 4 m-tiles: fine


def test_the_own_pre_variant_refuses_what_it_cannot_write() -> None:
    """A quantized form at an H whose 8 column slices are not whole 128-column groups, a quantized form without the
    own-pre layer input, the own-pre collapse of the broadcast embedding: ValueErrors naming the rule."""
    from cute_kernels.coefficients.kernel import CoefficientsKernel

    with pytest.raises(ValueError, match="multiple of 1024"):
        CoefficientsKernel(1536, layer_input="own", quant="mxfp8")
    with pytest.raises(ValueError, match="needs the own-pre layer input"):
        CoefficientsKernel(4096, layer_input="carried", quant="mxfp8")
    with pytest.raises(ValueError, match="standard"):
        CoefficientsKernel(4096, variant="broadcast", layer_input="own")


# The defaults of v10 (default_bands) at the three model sizes, one row count per band that
# test_variant_compiles (1 row) does not reach: (H, variant, layer-input mode, rows, inline).
ADDED_DEFAULTS = [
    # standard: split and 16- / 32-row partials tiles, staged 32-row tiles, the 256- and 512-row rings
    (7168, "standard", "none", 30, False),
    (7168, "standard", "none", 60, False),
    (7168, "standard", "none", 100, False),
    (7168, "standard", "none", 200, False),
    (7168, "standard", "none", 512, False),
    (5120, "standard", "none", 60, False),
    (5120, "standard", "none", 150, False),
    (5120, "standard", "none", 200, False),
    (5120, "standard", "none", 300, False),
    (4096, "standard", "none", 16, False),
    (4096, "standard", "none", 60, False),
    (4096, "standard", "none", 150, False),
    (4096, "standard", "none", 300, False),
    # broadcast: split partials tiles, then staged 32-row tiles
    (7168, "broadcast", "none", 200, False),
    (7168, "broadcast", "none", 400, False),
    (5120, "broadcast", "none", 500, False),
    (4096, "broadcast", "none", 512, False),
    # inline: 32-row partials tiles, the 32-row tile with pushes, 64-row partials tiles, the 64-row tile
    (7168, "standard", "carried", 16, True),
    (7168, "standard", "carried", 100, True),
    (7168, "standard", "carried", 150, True),
    (7168, "standard", "carried", 300, True),
    (5120, "standard", "carried", 16, True),
    (5120, "standard", "carried", 300, True),
    (4096, "standard", "carried", 200, True),
    (4096, "standard", "carried", 400, True),
]


@pytest.mark.parametrize("H,variant,mode,rows,inline", ADDED_DEFAULTS)
def test_added_defaults_compile(H: int, variant: str, mode: str, rows: int, inline: bool) -> None:
    config = default(H, variant, rows, inline)
    assert exported(api.compile_coefficients(H, V(variant, mode), 20, config, arch="sm_90a"))


# Shipped knobs away from the defaults of their H (the GPU tests check these give the default's bits).
KNOBS = [
    (5120, "standard", "carried", dict(rows_per_tile=16)),
    (5120, "standard", "carried", dict(rows_per_tile=128)),
    (7168, "standard", "none", dict(rows_per_tile=64, push_vec=True, row_split=2, min_blocks=2)),
    (7168, "standard", "carried", dict(push_vec=True, row_split=2)),
    (4096, "broadcast", "one_hot", dict(rows_per_tile=128, push_vec=True, row_split=4)),
    (5120, "standard", "none", dict(push_vec=True, min_blocks=4)),
    (7168, "standard", "carried", dict(rows_per_tile=64, push_vec=True, row_split=2, min_blocks=2)),
]


@pytest.mark.parametrize("H,variant,mode,knobs", KNOBS)
def test_knob_configs_compile(H: int, variant: str, mode: str, knobs: dict) -> None:
    config = CoefficientsConfig.for_shape(H, variant == "broadcast", **knobs)
    assert exported(api.compile_coefficients(H, V(variant, mode), 20, config, arch="sm_90a"))


@pytest.mark.parametrize("variant", ("standard", "broadcast"))
def test_partials_schedule_compiles(variant: str) -> None:
    config = CoefficientsConfig.for_shape(7168, variant == "broadcast", 64, schedule="partials")
    assert exported(api.compile_coefficients(7168, V(variant, "none"), 20, config, arch="sm_90a"))
    assert exported(api.compile_coefficients(7168, V(variant, "one_hot"), 20, config, arch="sm_90a"))


TALL_AND_STAGED = [
    (7168, "standard", dict(rows_per_tile=256)),
    (4096, "standard", dict(rows_per_tile=64, min_blocks=3, stage_rows=True)),
    (7168, "standard", dict(rows_per_tile=32, row_split=2, stage_rows=True)),
    (4096, "broadcast", dict(rows_per_tile=128, stage_rows=True)),
    (7168, "standard", dict(rows_per_tile=512, row_split=2, stage_rows=True, stage_depth=2)),  # a staging ring
    (4096, "broadcast", dict(rows_per_tile=256, row_split=4, stage_rows=True, stage_depth=3)),
    (7168, "standard", dict(rows_per_tile=512, row_split=4, stage_rows=True, stage_depth=2, sum_buffers=2)),
    (5120, "standard", dict(rows_per_tile=128, row_split=2, sum_buffers=2)),
]


@pytest.mark.parametrize("H,variant,knobs", TALL_AND_STAGED)
def test_partials_tall_and_staged_tiles_compile(H: int, variant: str, knobs: dict) -> None:
    config = CoefficientsConfig.for_shape(H, variant == "broadcast", schedule="partials", **knobs)
    assert exported(api.compile_coefficients(H, V(variant, "none"), 20, config, arch="sm_90a"))


def _all_compile_cases() -> list[tuple[int, str, str, CoefficientsConfig]]:
    """Every (H, variant, layer input, config) the sm_90a compile tests above build."""
    cases = [(H, v, m, default(H, v, inline=m != "none")) for H, v, m in COMPILE_CASES]
    cases += [(H, v, m, default(H, v, rows, inline)) for H, v, m, rows, inline in ADDED_DEFAULTS]
    cases += [(H, v, m, CoefficientsConfig.for_shape(H, v == "broadcast", **k)) for H, v, m, k in KNOBS]
    for v in ("standard", "broadcast"):
        config = CoefficientsConfig.for_shape(7168, v == "broadcast", 64, schedule="partials")
        cases += [(7168, v, "none", config), (7168, v, "one_hot", config)]
    cases += [
        (H, v, "none", CoefficientsConfig.for_shape(H, v == "broadcast", schedule="partials", **k))
        for H, v, k in TALL_AND_STAGED
    ]
    return cases


def _choices(case: tuple[int, str, str, CoefficientsConfig]) -> set:
    """A case's compile-time choices: its variant and layer input, and every knob of its config but the split along K
    (a function of H, which the main cases above reach at every model size)."""
    _, variant, mode, config = case
    knobs = {(f.name, getattr(config, f.name)) for f in dataclasses.fields(config) if f.name not in ("warps", "groups")}
    return {("variant", variant), ("layer_input", mode)} | knobs


SM100A_CASES = covering(_all_compile_cases(), _choices)


def test_the_sm100a_cases_make_every_choice_of_the_sm90a_ones() -> None:
    everything = set().union(*map(_choices, _all_compile_cases()))
    assert set().union(*map(_choices, SM100A_CASES)) == everything
    assert len(SM100A_CASES) <= len(_all_compile_cases()) // 4


@pytest.mark.parametrize(
    "case", SM100A_CASES, ids=lambda c: f"{c[0]}-{c[1]}-{c[2]}-{c[3].schedule}-{c[3].rows_per_tile}"
)
def test_sm100a_compiles_every_choice(case: tuple[int, str, str, CoefficientsConfig]) -> None:
    H, variant, mode, config = case
    assert exported(api.compile_coefficients(H, V(variant, mode), 20, config, arch="sm_100a"))


def test_compile_rejects_an_unknown_arch() -> None:
    with pytest.raises(ValueError, match="arch"):
        api.compile_coefficients(4096, V("standard", "none"), 20, default(4096, "standard"), arch="sm_89")
    with pytest.raises(KeyError, match="sm_80"):  # no defaults table (the public edge passes a device's arch)
        api.warmup_jobs(7168, arch="sm_80", max_rows=16)


def test_norm_rows_per_cluster() -> None:
    # Inline form (the projection's block): 2 vectors per thread carried, 4 one-hot.
    assert norm_rows_per_cluster(7168, 224, "carried", INLINE_BUDGET) == 4
    assert norm_rows_per_cluster(7168, 224, "one_hot", INLINE_BUDGET) == 8
    assert norm_rows_per_cluster(4096, 128, "carried", INLINE_BUDGET) == 4
    assert norm_rows_per_cluster(7168, 64, "one_hot", INLINE_BUDGET) == 2
    assert norm_rows_per_cluster(256, 64, "one_hot", INLINE_BUDGET) == 16  # capped
    assert norm_rows_per_cluster(7168, 256, "carried", INPUT_ONLY_BUDGET) == 4  # the layer-input-only kernel
    for H in range(256, 16384 + 1, 256):
        for mode in ("carried", "one_hot"):
            rows = norm_rows_per_cluster(H, 224, mode, INLINE_BUDGET)
            assert rows in (1, 2, 4, 8, 16) and 64 % rows == 0


# --- the layer-input-only kernel ----------------------------------------------------------------


LAYER_INPUT_CASES = [(7168, "standard", "carried"), (7168, "standard", "one_hot"), (7168, "broadcast", "one_hot")]
LAYER_INPUT_CASES += [(4096, "standard", "carried"), (5120, "broadcast", "one_hot")]


LAYER_INPUT_ARCH_CASES = [(*case, "sm_90a") for case in LAYER_INPUT_CASES]
LAYER_INPUT_ARCH_CASES += [(*case, "sm_100a") for case in covering(LAYER_INPUT_CASES, lambda c: enumerate(c[1:]))]


@pytest.mark.parametrize("H,variant,mode,arch", LAYER_INPUT_ARCH_CASES)
def test_layer_input_kernel_compiles(H: int, variant: str, mode: str, arch: str) -> None:
    assert exported(api.compile_layer_input(H, V(variant, mode), arch=arch))


# --- the workspace ------------------------------------------------------------------------------


def test_workspace_shapes() -> None:
    ws = api.CoefficientsWorkspace(7168, 100, "cpu")
    assert ws.partials.shape == (16, 100, 25) and ws.partials.dtype == F32
    assert ws.counters.shape == (7 * 8,) and ws.counters.dtype == torch.int32 and not ws.counters.any()
    assert ws.rank_partials.shape == (16 * 8, 100, 25)
    # Both splits of H fit: the broadcast one has fewer groups at every H.
    for H in range(256, 16384 + 1, 256):
        assert api.CoefficientsWorkspace(H, 1, "meta").groups == CoefficientsConfig.for_shape(H, False).groups


def test_workspace_partials_hold_the_sentinel() -> None:
    ws = api.CoefficientsWorkspace(4096, 20, "cpu")
    bits = ws.partials.view(torch.int32)
    assert bool((bits == SENTINEL).all()) and bool(ws.partials.isnan().all())
    assert SENTINEL & 0xFFFFFFFF == 0xFFC0DEAD  # never the GPU's canonical NaN 0x7FFFFFFF
    ws.partials.zero_()
    ws.counters.fill_(3)
    ws.reset()
    assert bool((bits == SENTINEL).all()) and not ws.counters.any()


# --- the public edge: what the kernels need, checked once in boundary/mhc.py ---------------------------


def kernel_args(rows: int = 3, H: int = 256, *, broadcast: bool = False, offset: dict | None = None) -> tuple:
    """Well-formed arguments of mhc._check_kernel_args; `offset` shifts named tensors by that many elements."""

    def make(name: str, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        k = (offset or {}).get(name, 0)
        return torch.zeros(k + int(torch.Size(shape).numel()), dtype=dtype)[k:].view(shape)

    residual = make("residual", (rows, 4, H), BF16)
    x = make("x", (rows, H), BF16) if broadcast else None
    fn = make("fn", (24, H if broadcast else 4 * H), F32)
    return residual, x, fn, make("pre_mix", (rows, 4), F32), make("norm_weight", (H,), BF16)


@pytest.mark.parametrize("broadcast", (False, True))
def test_the_edge_takes_well_formed_kernel_arguments(broadcast: bool) -> None:
    args = kernel_args(broadcast=broadcast)
    for inline in (False, True):
        mhc._check_kernel_args(*args, "sm_90a", inline=inline, layer_input_kernel=inline)


@pytest.mark.parametrize(
    "name,broadcast",
    [
        ("residual", False),
        ("x", True),
        ("fn", False),
        ("fn", True),
        ("pre_mix", False),
        ("norm_weight", False),
        ("norm_weight", True),
    ],
)
def test_the_edge_rejects_a_misaligned_tensor_the_kernels_read_16_bytes_at_a_time(name: str, broadcast: bool) -> None:
    args = kernel_args(broadcast=broadcast, offset={name: 1})
    with pytest.raises(ValueError, match=f"{name} must start on a 16-byte boundary"):
        mhc._check_kernel_args(*args, "sm_90a", inline=True, layer_input_kernel=True)


def test_the_edge_lets_pass_what_no_kernel_reads() -> None:
    # The first layer's kernels read x, not the streams, and no pre_mix; without a layer-input kernel
    # (torch computes the collapse) neither pre_mix nor norm_weight reach a kernel.
    mhc._check_kernel_args(
        *kernel_args(broadcast=True, offset={"residual": 1, "pre_mix": 1}),
        "sm_90a",
        inline=True,
        layer_input_kernel=True,
    )
    mhc._check_kernel_args(
        *kernel_args(offset={"pre_mix": 1, "norm_weight": 1}), "sm_90a", inline=False, layer_input_kernel=False
    )


def test_the_edge_rejects_shapes_the_kernels_do_not_serve() -> None:
    with pytest.raises(ValueError, match="positive multiple of 256"):
        mhc._check_kernel_args(*kernel_args(H=384), "sm_90a", inline=False, layer_input_kernel=False)
    with pytest.raises(ValueError, match="positive multiple of 256"):
        mhc.warmup_jobs(0, "sm_90a", 16)


def test_the_edge_holds_the_row_limit() -> None:
    # The largest workspace, and 32-bit row offsets (rows * 4H elements).
    assert mhc.kernel_row_limit(7168) == api.MAX_ROWS
    assert mhc.kernel_row_limit(2**20) == (2**31 - 1) // 2**22 == 511
    rows = api.MAX_ROWS + 1
    residual = torch.empty(rows, 4, 256, dtype=BF16, device="meta")
    fn, weight = torch.empty(24, 1024, device="meta"), torch.empty(256, dtype=BF16, device="meta")
    with pytest.raises(ValueError, match=f"at most {api.MAX_ROWS} rows at H=256, got {rows}"):
        mhc._check_kernel_args(residual, None, fn, None, weight, "sm_90a", inline=False, layer_input_kernel=False)
    with pytest.raises(ValueError, match="at most 511 rows at H=1048576, got 512"):
        mhc.prepare_workspace(2**20, 512, torch.device("cpu"))
    with pytest.raises(ValueError, match=f"at most {api.MAX_ROWS} rows"):
        mhc.warmup_jobs(7168, "sm_90a", rows)


def test_the_edge_holds_the_cluster_limit() -> None:
    # Up to H 32768, at every row count up to the row limit, no shipped launch exceeds 65535 clusters ...
    for H in range(256, 32768 + 1, 256):
        limit = mhc.kernel_row_limit(H)
        for variant in VARIANTS:
            if variant.normed:
                bands = tuning.default_bands(H, variant.form, arch="sm_90a")
                # A band's largest count is at its last row.
                for rows in [first - 1 for first, _ in bands[1:] if first - 1 <= limit] + [limit]:
                    assert api.grid_clusters(H, variant, rows, arch="sm_90a") <= mhc.MAX_GRID_Y, (H, variant, rows)
    # ... (the layer-input-only kernel runs one cluster per 1-16 rows) but above it some do: the broadcast
    # projection at H 33536 x 16008 rows (32-row staged tiles of 131 groups), or one row at H 2^25 (2^16 groups).
    assert api.grid_clusters(33536, V("broadcast", "none"), 16008, arch="sm_90a") == 65631
    for H, rows, clusters, broadcast in ((33536, 16008, 65631, True), (2**25, 1, 65536, False)):
        width = H if broadcast else 4 * H
        residual = torch.empty(rows, 4, H, dtype=BF16, device="meta")
        x = torch.empty(rows, H, dtype=BF16, device="meta") if broadcast else None
        fn, weight = torch.empty(24, width, device="meta"), torch.empty(H, dtype=BF16, device="meta")
        with pytest.raises(ValueError, match=f"{rows} rows at H={H} need {clusters} clusters, more than the 65535"):
            mhc._check_kernel_args(residual, x, fn, None, weight, "sm_90a", inline=False, layer_input_kernel=False)


def test_grid_clusters_counts_the_launch() -> None:
    # 100 rows at H 7168 inline: the 32-row tile with pushes, 4 tiles of 16 projection + 8 layer-input clusters.
    assert api.grid_clusters(7168, V("standard", "carried"), 100, arch="sm_90a") == 4 * (16 + 8)
    assert api.grid_clusters(7168, V("standard", "none"), 512, arch="sm_90a") == 16  # one 512-row ring tile
    assert api.grid_clusters(7168, V("standard", "none"), 0, arch="sm_90a") == 0
