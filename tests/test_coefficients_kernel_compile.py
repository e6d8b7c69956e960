"""The coefficients kernel on the CPU: split choices, every variant compiling for sm_90a and sm_100a, host checks."""

from __future__ import annotations

import pytest
import torch

from cute_kernels import coefficients_kernel as ck
from cute_kernels.coefficients_kernel import CoefficientsConfig, CoefficientsKernel, CoefficientsWorkspace

ARCHS = ("sm_90a", "sm_100a")
BF16, F32 = torch.bfloat16, torch.float32


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
    assert (config.rows_per_tile, config.warps, config.groups) == (64, warps, groups)


@pytest.mark.parametrize("broadcast", [False, True])
def test_default_split_tiles_every_multiple_of_256(broadcast: bool) -> None:
    for H in range(256, 16384 + 1, 256):
        config = CoefficientsConfig.for_shape(H, broadcast)
        config.validate(H, broadcast)
        assert config.groups * ck.CLUSTER * config.warps * ck.CHUNK == ck.projection_width(H, broadcast)


def test_config_validation_names_the_problem() -> None:
    with pytest.raises(ValueError, match="rows_per_tile"):
        CoefficientsConfig(48, 7, 16).validate(7168, False)
    with pytest.raises(ValueError, match="warps"):
        CoefficientsConfig(64, 9, 16).validate(7168, False)
    with pytest.raises(ValueError, match="projection width 28672"):
        CoefficientsConfig(64, 8, 16).validate(7168, False)
    with pytest.raises(ValueError, match="multiple of 256"):
        CoefficientsConfig.for_shape(4000, False)


def test_kernel_rejects_bad_variants() -> None:
    with pytest.raises(ValueError, match="variant"):
        CoefficientsKernel(4096, variant="wide")
    with pytest.raises(ValueError, match="layer_input"):
        CoefficientsKernel(4096, layer_input="own")
    with pytest.raises(ValueError, match="broadcast"):
        CoefficientsKernel(4096, variant="broadcast", layer_input="carried")
    with pytest.raises(ValueError, match="sinkhorn_repeat"):
        CoefficientsKernel(4096, sinkhorn_repeat=0)


@pytest.mark.parametrize("H", (4096, 5120, 7168))
def test_every_call_finds_its_default_among_the_warmup_keys(H: int) -> None:
    # Every call of 1..512 rows, whatever its form, gets a config that the keys compile.
    compiled = {(k[1], k[2], k[4]) for k in ck.coefficients_warmup_keys(H, max_rows=512)}
    for variant, modes in (("standard", ck.LAYER_INPUTS), ("broadcast", ("none", "one_hot"))):
        for mode in modes:
            for rows in range(1, 513):
                config = ck.default_config(H, variant == "broadcast", rows, mode != "none")
                assert (variant, mode, config) in compiled, (variant, mode, rows)


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


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("H,variant,mode,rows,inline", ADDED_DEFAULTS)
def test_added_defaults_compile(H: int, variant: str, mode: str, rows: int, inline: bool, arch: str) -> None:
    config = ck.default_config(H, variant == "broadcast", rows, inline)
    assert callable(ck.compile_coefficients(H, variant, mode, 20, config, arch=arch))


def test_warmup_keys_cover_every_call_path() -> None:
    keys = ck.coefficients_warmup_keys(7168, max_rows=512)
    # (variant, layer input, rows_per_tile, push_vec, row_split, schedule, stage_rows) of each compiled default
    assert [
        (k[1], k[2], k[4].rows_per_tile, k[4].push_vec, k[4].row_split, k[4].schedule, k[4].stage_rows) for k in keys
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
        ("broadcast", "none", 32, False, 2, "partials", False),
        ("broadcast", "none", 32, False, 1, "partials", True),
        ("broadcast", "one_hot", 32, False, 1, "tile", False),
        ("broadcast", "one_hot", 64, True, 1, "tile", False),
    ]
    # Since v10 no default at H 7168 takes a launch bound (the broadcast 64-row tiles of 3 CTAs per SM lost
    # to split and staged 32-row tiles).
    assert [(i, k[4].min_blocks) for i, k in enumerate(keys) if k[4].min_blocks] == []
    # The staging ring with two buffers of warp sums: the standard projection's 256- and 512-row tiles.
    assert [(i, k[4].stage_depth, k[4].sum_buffers) for i, k in enumerate(keys) if k[4].stage_depth] == [
        (3, 2, 2),
        (4, 2, 2),
    ]
    assert ck.default_config(4096, False, 300).min_blocks == 0  # the 512-row ring
    assert ck.default_config(8192, False, 512).min_blocks == 0  # partials
    # With a layer input the partials schedule takes 8-40 and 129-512 rows at H 7168, 12-512 at 5120 and
    # 353-512 at 4096; the first layer's inline form stays on the tile schedule.
    assert ck.default_config(7168, False, 129, inline=True).schedule == "partials"
    assert ck.default_config(7168, False, 16, inline=True).schedule == "partials"
    assert ck.default_config(7168, False, 128, inline=True).schedule == "tile"
    assert ck.default_config(7168, True, 512, inline=True).schedule == "tile"
    assert ck.default_config(5120, False, 512, inline=True).schedule == "partials"
    assert ck.default_config(4096, False, 300, inline=True).schedule == "tile"
    assert all((H, repeat) == (7168, 20) for H, _variant, _mode, repeat, _config in keys)
    # Up to 16 rows: the split partials tile (standard and broadcast), the plain tile and the 32-row
    # partials tile (the inline forms, carried and one-hot; the first layer's only the plain tile).
    assert len(ck.coefficients_warmup_keys(7168, max_rows=16)) == 7
    assert len(ck.coefficients_warmup_keys(5120, max_rows=16)) == 7
    jobs = ck.coefficients_warmup_jobs(7168, arch="sm_90a")
    layer_keys = ck.layer_input_warmup_keys(7168)
    assert [(k[1], k[2]) for k in layer_keys] == [
        ("standard", "carried"),
        ("standard", "one_hot"),
        ("broadcast", "one_hot"),
    ]
    assert len(jobs) == len(keys) + len(layer_keys) and all(dict(job.kwargs) == {"arch": "sm_90a"} for job in jobs)
    assert [job.args for job in jobs] == keys + layer_keys
    assert {job.compile_fn for job in jobs} == {ck.compile_coefficients, ck.compile_layer_input}
    with pytest.raises(ValueError, match="arch"):
        ck.coefficients_warmup_jobs(7168, arch="sm_80")


def test_layer_input_mode() -> None:
    assert ck.layer_input_mode(False, False, True) == "none"
    assert ck.layer_input_mode(False, True, True) == "carried"
    assert ck.layer_input_mode(False, True, False) == "one_hot"
    assert ck.layer_input_mode(True, True, False) == "one_hot"


# --- every variant compiles for both targets --------------------------------------------------------


COMPILE_CASES = [
    (7168, variant, mode)
    for variant, modes in (("standard", ck.LAYER_INPUTS), ("broadcast", ("none", "one_hot")))
    for mode in modes
]
COMPILE_CASES += [(4096, "standard", "none"), (4096, "standard", "carried"), (4096, "broadcast", "one_hot")]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("H,variant,mode", COMPILE_CASES)
def test_variant_compiles(H: int, variant: str, mode: str, arch: str) -> None:
    config = ck.default_config(H, variant == "broadcast", inline=mode != "none")
    compiled = ck.compile_coefficients(H, variant, mode, 20, config, arch=arch)
    assert callable(compiled)


@pytest.mark.parametrize("rows_per_tile", [16, 128])
def test_other_tile_heights_compile(rows_per_tile: int) -> None:
    config = CoefficientsConfig.for_shape(5120, False, rows_per_tile)
    assert callable(ck.compile_coefficients(5120, "standard", "carried", 20, config, arch="sm_90a"))


KNOBS = [
    (7168, "standard", "none", dict(handoff="ticket")),
    (7168, "standard", "carried", dict(handoff="ticket")),
    (7168, "broadcast", "one_hot", dict(handoff="ticket")),
    (7168, "standard", "carried", dict(norm_order="front", norm_rows=2)),
    (5120, "standard", "one_hot", dict(norm_rows=16)),
    (7168, "standard", "none", dict(handoff="ticket", push_vec=True, row_split=2, min_blocks=2)),
    (7168, "standard", "carried", dict(rows_per_tile=32, handoff="ticket", push_vec=True, row_split=2)),
    (4096, "broadcast", "one_hot", dict(rows_per_tile=128, prefetch=True, push_vec=True, row_split=4)),
    (5120, "standard", "none", dict(rows_per_tile=32, push_vec=True, min_blocks=4)),
    (7168, "standard", "carried", dict(rows_per_tile=32, handoff="ticket", comb_lanes=2)),
    (4096, "broadcast", "none", dict(handoff="ticket", comb_lanes=4)),
    (7168, "standard", "none", dict(rows_per_tile=32, handoff="ticket", sinkhorn_unroll=2)),
    (4096, "broadcast", "one_hot", dict(rows_per_tile=128, prefetch=True, row_split=4, projection="fma")),
]


@pytest.mark.parametrize("H,variant,mode,knobs", KNOBS)
def test_knob_configs_compile(H: int, variant: str, mode: str, knobs: dict) -> None:
    config = CoefficientsConfig.for_shape(H, variant == "broadcast", **knobs)
    assert callable(ck.compile_coefficients(H, variant, mode, 20, config, arch="sm_90a"))


# The projection on the CUDA cores (an A/B alternative with its own bits), on both targets.
FMA_CASES = [
    (7168, "standard", "none", dict(rows_per_tile=32, handoff="ticket")),
    (7168, "broadcast", "none", dict(handoff="ticket")),
    (7168, "standard", "carried", dict(rows_per_tile=32, handoff="ticket", push_vec=True)),
]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("H,variant,mode,knobs", FMA_CASES)
def test_fma_projection_compiles(H: int, variant: str, mode: str, knobs: dict, arch: str) -> None:
    config = CoefficientsConfig.for_shape(H, variant == "broadcast", projection="fma", **knobs)
    assert callable(ck.compile_coefficients(H, variant, mode, 20, config, arch=arch))


def test_projection_knob_is_validated_and_never_a_default() -> None:
    assert CoefficientsConfig(64, 7, 16).projection == "mma"
    for broadcast in (False, True):
        for inline in (False, True):
            for rows in ck.default_row_classes(7168, broadcast, inline, 512):
                assert ck.default_config(7168, broadcast, rows, inline).projection == "mma"
    for bad in ("wgmma", "FMA", None, 1):
        config = CoefficientsConfig.for_shape(7168, False, projection=bad)
        with pytest.raises(ValueError, match=r"projection must be one of \('mma', 'fma'\)"):
            config.validate(7168, False)
        with pytest.raises(ValueError, match="projection"):
            CoefficientsKernel(7168, config=config)


@pytest.mark.parametrize("handoff", ck.HANDOFFS)
def test_prefetched_tall_tiles_compile(handoff: str) -> None:
    config = CoefficientsConfig.for_shape(7168, False, 128, prefetch=True, handoff=handoff)
    assert callable(ck.compile_coefficients(7168, "standard", "none", 20, config, arch="sm_90a"))


def test_v3_knobs_compile_for_blackwell() -> None:
    config = CoefficientsConfig.for_shape(7168, False, handoff="ticket", push_vec=True, row_split=2, min_blocks=2)
    assert config.threads == 448
    assert callable(ck.compile_coefficients(7168, "standard", "carried", 20, config, arch="sm_100a"))


def test_ticket_handoff_compiles_for_blackwell() -> None:
    config = CoefficientsConfig.for_shape(4096, False, handoff="ticket")
    assert callable(ck.compile_coefficients(4096, "standard", "carried", 20, config, arch="sm_100a"))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("variant", ("standard", "broadcast"))
def test_partials_schedule_compiles(variant: str, arch: str) -> None:
    config = CoefficientsConfig.for_shape(7168, variant == "broadcast", 64, schedule="partials")
    assert callable(ck.compile_coefficients(7168, variant, "none", 20, config, arch=arch))
    with pytest.raises(ValueError, match="push_vec does not apply"):
        CoefficientsConfig.for_shape(7168, False, 64, push_vec=True, schedule="partials").validate(7168, False)
    assert callable(ck.compile_coefficients(7168, variant, "one_hot", 20, config, arch=arch))
    with pytest.raises(ValueError, match="schedule must be one of"):
        CoefficientsConfig.for_shape(7168, False, schedule="stream").validate(7168, False)
    with pytest.raises(ValueError, match="schedule 'partials' needs"):
        CoefficientsConfig.for_shape(7168, False, schedule="partials", projection="fma").validate(7168, False)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("H,variant,knobs", [
    (7168, "standard", dict(rows_per_tile=256)),
    (4096, "standard", dict(rows_per_tile=64, min_blocks=3, stage_rows=True)),
    (7168, "standard", dict(rows_per_tile=32, row_split=2, stage_rows=True)),
    (4096, "broadcast", dict(rows_per_tile=128, stage_rows=True)),
    (7168, "standard", dict(rows_per_tile=512, row_split=2, stage_rows=True, stage_depth=2)),  # a staging ring
    (4096, "broadcast", dict(rows_per_tile=256, row_split=4, stage_rows=True, stage_depth=3)),
    (7168, "standard", dict(rows_per_tile=512, row_split=4, stage_rows=True, stage_depth=2, sum_buffers=2)),
    (5120, "standard", dict(rows_per_tile=128, row_split=2, sum_buffers=2)),
])  # fmt: skip
def test_partials_tall_and_staged_tiles_compile(H: int, variant: str, knobs: dict, arch: str) -> None:
    config = CoefficientsConfig.for_shape(H, variant == "broadcast", schedule="partials", **knobs)
    assert callable(ck.compile_coefficients(H, variant, "none", 20, config, arch=arch))


def test_partials_staging_and_tall_tiles_are_validated() -> None:
    base = CoefficientsConfig.for_shape(7168, False, 128, schedule="partials", stage_rows=True)
    base.validate(7168, False)
    for knobs, message in (
        (dict(stage_rows=1), "stage_rows must be a bool"),
        (dict(prefetch=True), "no prefetch"),
        (dict(schedule="tile"), "needs schedule 'partials'"),
        (dict(rows_per_tile=1024), "rows_per_tile must be"),
        (dict(stage_depth=5), "stage_depth must be one of"),
        (dict(stage_depth=2), "less than the 2 batches of a 128-row tile"),
        (dict(rows_per_tile=512, stage_depth=2, stage_rows=False), "stage_depth needs stage_rows"),
        (dict(sum_buffers=3), "sum_buffers must be 1 or 2"),
        (dict(rows_per_tile=64, sum_buffers=2), "more than one 64-row batch"),
    ):
        with pytest.raises(ValueError, match=message):
            CoefficientsConfig(**{**base.__dict__, **knobs}).validate(7168, False)
    for config in (base, CoefficientsConfig.for_shape(7168, False, 256, schedule="partials")):
        with pytest.raises(ValueError, match="without a layer input"):
            ck.CoefficientsKernel(7168, layer_input="carried", config=config)
    # Tiles above 128 rows exist for the partials schedule only.
    with pytest.raises(ValueError, match="needs schedule 'partials'"):
        CoefficientsConfig.for_shape(7168, False, 256).validate(7168, False)


def test_trace_build_compiles() -> None:
    config = CoefficientsConfig.for_shape(7168, False, 32, handoff="ticket", trace=True)
    assert callable(ck.compile_coefficients(7168, "standard", "none", 20, config, arch="sm_90a"))
    inline = CoefficientsConfig.for_shape(5120, False, handoff="ticket", trace=True)
    assert callable(ck.compile_coefficients(5120, "standard", "carried", 20, inline, arch="sm_100a"))


def test_knob_validation_names_the_problem() -> None:
    base = CoefficientsConfig.for_shape(7168, False)
    for knobs, message in (
        (dict(handoff="spin"), "handoff"),
        (dict(prefetch=1), "prefetch"),
        (dict(norm_rows=3), "norm_rows"),
        (dict(norm_order="back"), "norm_order"),
        (dict(rows_per_tile=16, norm_rows=32), "norm_rows"),
        (dict(row_split=3), "row_split"),
        (dict(rows_per_tile=32, row_split=4), "row_split"),
        (dict(push_vec=1), "push_vec"),
        (dict(rows_per_tile=16, push_vec=True), "push_vec"),
        (dict(min_blocks=5), "min_blocks"),
        (dict(row_split=4, min_blocks=3), "threads per SM"),
        (dict(trace=1), "trace"),
        (dict(rows_per_tile=32.0), "rows_per_tile"),
        (dict(row_split=2.0), "row_split"),
        (dict(comb_lanes=2.0), "comb_lanes"),
        (dict(sinkhorn_unroll=4.0), "sinkhorn_unroll"),
        (dict(min_blocks=2.0), "min_blocks"),
        (dict(comb_lanes=3), "comb_lanes"),
        (dict(sinkhorn_unroll=3), "sinkhorn_unroll"),
        (dict(comb_lanes=True), "comb_lanes"),
        (dict(rows_per_tile=128, comb_lanes=4), "exceed a warp"),
        (dict(projection="tensor"), "projection"),
    ):
        fields = {**base.__dict__, **knobs}
        with pytest.raises(ValueError, match=message):
            CoefficientsConfig(**fields).validate(7168, False)
    CoefficientsConfig(16, 7, 16, norm_rows=16).validate(7168, False)  # every allowed norm_rows fits any tile


def test_norm_rows_per_cluster() -> None:
    # Inline form (the projection's block): 2 vectors per thread carried, 4 one-hot.
    assert ck.norm_rows_per_cluster(7168, 224, "carried") == 4
    assert ck.norm_rows_per_cluster(7168, 224, "one_hot") == 8
    assert ck.norm_rows_per_cluster(4096, 128, "carried") == 4
    assert ck.norm_rows_per_cluster(7168, 64, "one_hot") == 2
    assert ck.norm_rows_per_cluster(256, 64, "one_hot") == 16  # capped
    assert ck.norm_rows_per_cluster(7168, 224, "carried", requested=16) == 16
    for H in range(256, 16384 + 1, 256):
        for mode in ("carried", "one_hot"):
            rows = ck.norm_rows_per_cluster(H, 224, mode)
            assert rows in ck.NORM_ROWS[1:] and 64 % rows == 0


def test_compile_rejects_an_unknown_arch() -> None:
    with pytest.raises(ValueError, match="arch"):
        ck.compile_coefficients(4096, "standard", "none", 20, ck.default_config(4096, False), arch="sm_89")


# --- the layer-input-only kernel ----------------------------------------------------------------


LAYER_INPUT_CASES = [(7168, "standard", "carried"), (7168, "standard", "one_hot"), (7168, "broadcast", "one_hot")]
LAYER_INPUT_CASES += [(4096, "standard", "carried"), (5120, "broadcast", "one_hot")]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("H,variant,mode", LAYER_INPUT_CASES)
def test_layer_input_kernel_compiles(H: int, variant: str, mode: str, arch: str) -> None:
    compiled = ck.compile_layer_input(H, variant, mode, ck.LayerInputConfig(), arch=arch)
    assert callable(compiled)


def test_layer_input_kernel_rejects_bad_variants() -> None:
    with pytest.raises(ValueError, match="layer_input"):
        ck.LayerInputKernel(4096, layer_input="none")
    with pytest.raises(ValueError, match="broadcast"):
        ck.LayerInputKernel(4096, variant="broadcast", layer_input="carried")
    with pytest.raises(ValueError, match="variant"):
        ck.LayerInputKernel(4096, variant="wide")
    with pytest.raises(ValueError, match="multiple of 256"):
        ck.LayerInputKernel(1000)
    with pytest.raises(ValueError, match="warps"):
        ck.LayerInputKernel(4096, config=ck.LayerInputConfig(warps=9))
    with pytest.raises(ValueError, match="norm_rows"):
        ck.LayerInputKernel(4096, config=ck.LayerInputConfig(norm_rows=5))


def layer_input_args(rows: int = 3, H: int = 256, *, broadcast: bool = False, carried: bool = True):
    x = torch.zeros((rows, H) if broadcast else (rows, 4, H), dtype=BF16)
    pre_mix = torch.rand(rows, 4) if carried else None
    return (x, pre_mix, torch.ones(H, dtype=BF16), 1e-6, torch.empty(rows, H, dtype=BF16)), dict(
        arch="sm_90a", broadcast=broadcast
    )


@pytest.mark.parametrize("broadcast,carried", [(False, True), (False, False), (True, False)])
def test_layer_input_cpu_call_fails_only_on_the_device(broadcast: bool, carried: bool) -> None:
    args, kwargs = layer_input_args(broadcast=broadcast, carried=carried)
    with pytest.raises(ValueError, match="x must be on a CUDA device"):
        ck.mhc_layer_input(*args, **kwargs)


BAD_LAYER_INPUT_CALLS = [
    ("x dtype", lambda a: (a[0].float(), *a[1:]), {}, TypeError, "x must have dtype torch.bfloat16"),
    ("x shape", lambda a: (a[0][:, :2], *a[1:]), {}, ValueError, r"x must have shape \[\*, 4, \*\]"),
    ("pre_mix shape", lambda a: (a[0], a[1][:, :3], *a[2:]), {}, ValueError, r"pre_mix must have shape \[3, 4\]"),
    ("pre_mix dtype", lambda a: (a[0], a[1].double(), *a[2:]), {}, TypeError, "pre_mix must have dtype"),
    ("weight", lambda a: (*a[:2], torch.ones(128, dtype=BF16), *a[3:]), {}, ValueError, "norm_weight must have shape"),
    ("eps", lambda a: (*a[:3], -1.0, a[4]), {}, ValueError, "norm_eps must be >= 0"),
    ("eps type", lambda a: (*a[:3], None, a[4]), {}, TypeError, "norm_eps must be a float"),
    (
        "out shape",
        lambda a: (*a[:4], torch.empty(3, 255, dtype=BF16)),
        {},
        ValueError,
        r"out must have shape \[3, 256\]",
    ),
    ("out dtype", lambda a: (*a[:4], torch.empty(3, 256)), {}, TypeError, "out must have dtype"),
    ("arch", None, {"arch": "sm_89"}, ValueError, "arch must be one of"),
    ("config", None, {"config": CoefficientsConfig(64, 1, 4)}, TypeError, "LayerInputConfig"),
    ("config warps", None, {"config": ck.LayerInputConfig(warps=0)}, ValueError, "warps"),
    ("stream", None, {"stream": 3}, TypeError, "stream must be a torch.cuda.Stream"),
    ("broadcast pre", None, {"broadcast": True}, ValueError, r"x must have shape \[\*, \*\]"),
]


@pytest.mark.parametrize(
    "name,edit,edit_kwargs,error,message", BAD_LAYER_INPUT_CALLS, ids=[c[0] for c in BAD_LAYER_INPUT_CALLS]
)
def test_layer_input_bad_input_raises_a_clear_error(name, edit, edit_kwargs, error, message) -> None:
    args, kwargs = layer_input_args()
    if edit is not None:
        args = edit(args)
    kwargs.update(edit_kwargs)
    with pytest.raises(error, match=message):
        ck.mhc_layer_input(*args, **kwargs)


def test_layer_input_broadcast_takes_no_pre_mix() -> None:
    args, kwargs = layer_input_args(broadcast=True, carried=False)
    with pytest.raises(ValueError, match="pre_mix must be None with broadcast"):
        ck.mhc_layer_input(args[0], torch.rand(3, 4), *args[2:], **kwargs)


# --- host checks: a clear error before any launch ----------------------------------------------


def call_args(rows: int = 3, H: int = 256, *, broadcast: bool = False, inline: bool = False, carried: bool = False):
    """Well-formed CPU arguments (the device check comes last, so every other check is reachable)."""
    width = H if broadcast else 4 * H
    kwargs = dict(
        rms_eps=1e-6,
        pre_eps=1e-6,
        sinkhorn_eps=1e-6,
        post_mult=2.0,
        sinkhorn_repeat=20,
        broadcast=broadcast,
        workspace=CoefficientsWorkspace(H, 16, "cpu"),
        post_out=torch.empty(rows, 4),
        comb_out=torch.empty(rows, 4, 4),
        pre_out=torch.empty(rows, 4),
        arch="sm_90a",
    )
    if inline:
        kwargs.update(
            norm_weight=torch.ones(H, dtype=BF16), norm_eps=1e-6, layer_input_out=torch.empty(rows, H, dtype=BF16)
        )
        if carried:
            kwargs["pre_mix"] = torch.rand(rows, 4)
    x = torch.zeros((rows, H) if broadcast else (rows, 4, H), dtype=BF16)
    return (x, torch.zeros(24, width), torch.ones(3), torch.zeros(24)), kwargs


def test_trace_buffer_goes_with_a_trace_config() -> None:
    # Checked on every call (validate=False too): a trace build needs its buffer, others take none.
    args, kwargs = call_args(H=7168)
    plain = CoefficientsConfig.for_shape(7168, False, 32, handoff="ticket")
    traced = CoefficientsConfig.for_shape(7168, False, 32, handoff="ticket", trace=True)
    buffer = torch.zeros(ck.trace_slots(3, traced, False, False), dtype=torch.int64)
    with pytest.raises(ValueError, match="trace must be given exactly when config.trace is set"):
        ck.mhc_coefficients(*args, **kwargs, config=traced, validate=False)
    with pytest.raises(ValueError, match="trace must be given exactly when config.trace is set"):
        ck.mhc_coefficients(*args, **kwargs, config=plain, trace=buffer, validate=False)
    with pytest.raises(ValueError, match="int64 tensor of >= 3072 entries"):
        ck.mhc_coefficients(*args, **kwargs, config=traced, trace=buffer[:10], validate=False)
    assert buffer.numel() == 16 * 8 * ck.TRACE_SLOTS  # one tile of G = 16 clusters of 8 CTAs


@pytest.mark.parametrize("broadcast,inline,carried", [(False, False, False), (False, True, True), (True, True, False)])
def test_well_formed_cpu_call_fails_only_on_the_device(broadcast: bool, inline: bool, carried: bool) -> None:
    args, kwargs = call_args(broadcast=broadcast, inline=inline, carried=carried)
    with pytest.raises(ValueError, match="x must be on a CUDA device"):
        ck.mhc_coefficients(*args, **kwargs)


def test_post_may_have_a_trailing_one() -> None:
    args, kwargs = call_args()
    kwargs["post_out"] = torch.empty(3, 4, 1)
    with pytest.raises(ValueError, match="CUDA device"):
        ck.mhc_coefficients(*args, **kwargs)


BAD_CALLS = [
    ("x dtype", lambda a, k: (a[0].float(), *a[1:]), {}, TypeError, "x must have dtype torch.bfloat16"),
    ("x shape", lambda a, k: (a[0][:, :3], *a[1:]), {}, ValueError, r"x must have shape \[\*, 4, \*\]"),
    (
        "x strided",
        lambda a, k: (a[0].transpose(0, 1).contiguous().transpose(0, 1), *a[1:]),
        {},
        ValueError,
        "x must be contiguous",
    ),
    ("H", lambda a, k: (a[0][..., :128].contiguous(), *a[1:]), {}, ValueError, "multiple of 256"),
    (
        "fn width",
        lambda a, k: (a[0], a[1][:, :256].contiguous(), *a[2:]),
        {},
        ValueError,
        r"fn must have shape \[24, 1024\]",
    ),
    ("fn dtype", lambda a, k: (a[0], a[1].double(), *a[2:]), {}, TypeError, "fn must have dtype torch.float32"),
    ("scale", lambda a, k: (a[0], a[1], torch.ones(4), a[3]), {}, ValueError, "scale must have shape"),
    ("base", lambda a, k: (*a[:3], "base"), {}, TypeError, "base must be a torch.Tensor"),
    ("comb", None, {"comb_out": torch.empty(3, 16)}, ValueError, "comb_out must have shape"),
    ("post rows", None, {"post_out": torch.empty(2, 4)}, ValueError, "post_out must have shape"),
    ("pre dtype", None, {"pre_out": torch.empty(3, 4, dtype=torch.float16)}, TypeError, "pre_out must have dtype"),
    ("eps", None, {"rms_eps": float("nan")}, ValueError, "rms_eps must be finite"),
    ("eps type", None, {"sinkhorn_eps": "1e-6"}, TypeError, "sinkhorn_eps must be a float"),
    ("negative eps", None, {"pre_eps": -1.0}, ValueError, "pre_eps must be >= 0"),
    ("repeat", None, {"sinkhorn_repeat": 0}, ValueError, "sinkhorn_repeat"),
    ("arch", None, {"arch": "sm_80"}, ValueError, "arch must be one of"),
    ("broadcast", None, {"broadcast": 1}, TypeError, "broadcast must be a bool"),
    ("workspace type", None, {"workspace": object()}, TypeError, "workspace must be a CoefficientsWorkspace"),
    ("workspace H", None, {"workspace": CoefficientsWorkspace(512, 16, "cpu")}, ValueError, "workspace is for H=512"),
    (
        "capacity",
        None,
        {"workspace": CoefficientsWorkspace(256, 2, "cpu")},
        ValueError,
        "exceed the workspace capacity",
    ),
    ("config", None, {"config": CoefficientsConfig(64, 3, 16)}, ValueError, "projection width"),
    ("pre_mix alone", None, {"pre_mix": torch.rand(3, 4)}, ValueError, "pre_mix is only used by the inline form"),
    ("norm_eps alone", None, {"norm_eps": 1e-6}, ValueError, "norm_eps is only used by the inline form"),
    ("no norm weight", None, {"layer_input_out": torch.empty(3, 256, dtype=BF16)}, ValueError, "needs norm_weight"),
    ("stream", None, {"stream": 7}, TypeError, "stream must be a torch.cuda.Stream"),
]


@pytest.mark.parametrize("name,edit_args,edit_kwargs,error,message", BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_bad_input_raises_a_clear_error(name, edit_args, edit_kwargs, error, message) -> None:
    args, kwargs = call_args()
    if edit_args is not None:
        args = edit_args(args, kwargs)
    kwargs.update(edit_kwargs)
    with pytest.raises(error, match=message):
        ck.mhc_coefficients(*args, **kwargs)


def test_inline_form_checks() -> None:
    args, kwargs = call_args(inline=True, carried=True)
    kwargs["pre_mix"] = torch.rand(3, 4).double()
    with pytest.raises(TypeError, match="pre_mix must have dtype"):
        ck.mhc_coefficients(*args, **kwargs)
    args, kwargs = call_args(inline=True)
    kwargs["layer_input_out"] = torch.empty(3, 255, dtype=BF16)
    with pytest.raises(ValueError, match=r"layer_input_out must have shape \[3, 256\]"):
        ck.mhc_coefficients(*args, **kwargs)
    args, kwargs = call_args(inline=True)
    kwargs["norm_eps"] = None
    with pytest.raises(TypeError, match="norm_eps must be a float"):
        ck.mhc_coefficients(*args, **kwargs)
    args, kwargs = call_args(inline=True, carried=True)
    kwargs["pre_out"] = kwargs["pre_mix"]
    with pytest.raises(ValueError, match="pre_out must not alias pre_mix"):
        ck.mhc_coefficients(*args, **kwargs)
    args, kwargs = call_args(broadcast=True, inline=True)
    kwargs["pre_mix"] = torch.rand(3, 4)
    with pytest.raises(ValueError, match="pre_mix must be None with broadcast"):
        ck.mhc_coefficients(*args, **kwargs)
    args, kwargs = call_args(broadcast=True)
    with pytest.raises(ValueError, match=r"fn_broadcast must have shape \[24, 256\]"):
        ck.mhc_coefficients(args[0], torch.zeros(24, 1024), *args[2:], **kwargs)


def test_workspace_checks_its_size() -> None:
    with pytest.raises(ValueError, match="max_rows"):
        CoefficientsWorkspace(4096, 0, "cpu")
    with pytest.raises(ValueError, match="max_rows"):
        CoefficientsWorkspace(4096, ck.MAX_ROWS + 1, "cpu")
    with pytest.raises(ValueError, match="multiple of 256"):
        CoefficientsWorkspace(1000, 16, "cpu")
    ws = CoefficientsWorkspace(7168, 100, "cpu")
    assert ws.partials.shape == (16, 100, 25) and ws.partials.dtype == F32
    assert ws.counters.shape == (7 * 8,) and ws.counters.dtype == torch.int32 and not ws.counters.any()


def test_workspace_partials_hold_the_sentinel() -> None:
    ws = CoefficientsWorkspace(4096, 20, "cpu")
    bits = ws.partials.view(torch.int32)
    assert bool((bits == ck.SENTINEL).all()) and bool(ws.partials.isnan().all())
    assert ck.SENTINEL & 0xFFFFFFFF == 0xFFC0DEAD  # never the GPU's canonical NaN 0x7FFFFFFF
    ws.partials.zero_()
    ws.counters.fill_(3)
    ws.reset()
    assert bool((bits == ck.SENTINEL).all()) and not ws.counters.any()
