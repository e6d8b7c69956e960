"""The fused boundary kernel on the GPU against the reference: variants, shapes, invariance, graphs, edge values."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch
from torch import Tensor

from boundary import reference as ref
from cute_kernels import mxfp8_scale_bytes
from cute_kernels.boundary import api
from cute_kernels.boundary.config import BoundaryConfig, default_config
from tests.bf16 import bitwise_equal, max_ulp, ulp_distance

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

BF16, F32 = torch.bfloat16, torch.float32
EPS = 1e-6
POISON_BF16 = 0x4641  # 12352.0: finite, and far from anything these inputs produce
POISON_FP8 = 0x55  # a finite e4m3 byte (13.0), so an unwritten NaN block shows
POISON_SCALE = 0xAA
MAIN = api.BoundaryVariant("x", shared=False, pre=True, mxfp8=True, aux=False)


@pytest.fixture(scope="module")
def arch() -> str:
    from cute_kernels.compile import arch_for_device

    return arch_for_device(torch.device("cuda"))


@dataclass
class Inputs:
    """One boundary's inputs; x or moe is set, shared is the addend (or the MoE shared output)."""

    residual: Tensor
    post: Tensor
    comb: Tensor
    pre: Tensor
    w: Tensor
    x: Tensor | None = None
    shared: Tensor | None = None
    moe: tuple[Tensor, Tensor, Tensor] | None = None

    def rows(self, index: Tensor | slice) -> Inputs:
        """The same inputs restricted to some rows (gemm2_permuted stays whole: idx points into it)."""

        def take(t: Tensor | None) -> Tensor | None:
            return None if t is None else t[index].contiguous()

        moe = None if self.moe is None else (self.moe[0], take(self.moe[1]), take(self.moe[2]))
        return Inputs(
            take(self.residual),
            take(self.post),
            take(self.comb),
            take(self.pre),
            self.w,
            take(self.x),
            take(self.shared),
            moe,
        )


def make_inputs(
    T: int, H: int, variant: api.BoundaryVariant, *, seed: int = 0, top_k: int = 8, drop: float = 0.25
) -> Inputs:
    """Random inputs of realistic magnitude: streams ~N(0,1), post in (0,2), softmax comb rows, pre in (0,1)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=gen, device="cuda")

    def rand(*shape: int) -> Tensor:
        return torch.rand(*shape, generator=gen, device="cuda")

    inp = Inputs(
        residual=randn(T, 4, H).to(BF16),
        post=rand(T, 4) * 2,
        comb=torch.softmax(randn(T, 4, 4), dim=-1),
        pre=rand(T, 4),
        w=(1 + 0.1 * randn(H)).to(BF16),
    )
    if variant.shared:
        inp.shared = (0.5 * randn(T, H)).to(BF16)
    if variant.y_source == "x":
        inp.x = randn(T, H).to(BF16)
    else:
        rows = max(1, T * top_k)
        gemm2 = randn(rows, H).to(BF16)
        weights = rand(T, top_k) / top_k
        idx = torch.randperm(rows, generator=gen, device="cuda")[: T * top_k].view(T, top_k).to(torch.int32)
        idx = torch.where(rand(T, top_k) < drop, torch.full_like(idx, -1), idx)
        inp.moe = (gemm2, weights, idx)
    return inp


@dataclass
class Outputs:
    """What one launch wrote."""

    new_residual: Tensor
    out: Tensor | None
    data: Tensor | None
    scale: Tensor | None
    aux: Tensor | None
    fp8_data: Tensor | None = None  # the FP8 1x128 form (variant.fp8)
    fp8_scale: Tensor | None = None


def _poisoned(shape: tuple[int, ...]) -> Tensor:
    return torch.full(shape, POISON_BF16, dtype=torch.int16, device="cuda").view(BF16)


def empty_outputs(T: int, H: int, variant: api.BoundaryVariant) -> Outputs:
    """Output buffers filled with poison, so that anything the kernel skips shows."""
    data = scale = None
    if variant.mxfp8:
        data = torch.full((T, H), POISON_FP8, dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)
        scale = torch.full((mxfp8_scale_bytes(T, H),), POISON_SCALE, dtype=torch.uint8, device="cuda")
    fp8_data = fp8_scale = None
    if variant.fp8:
        fp8_data = torch.full((T, H), POISON_FP8, dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)
        fp8_scale = torch.full((H // 128, ref.fp8_group_scale_rows(T)), float("nan"), device="cuda")
    return Outputs(
        new_residual=_poisoned((T, 4, H)),
        out=_poisoned((T, H)) if variant.pre else None,
        data=data,
        scale=scale,
        aux=_poisoned((T, H)) if variant.aux else None,
        fp8_data=fp8_data,
        fp8_scale=fp8_scale,
    )


def launch(inp: Inputs, variant: api.BoundaryVariant, res: Outputs, arch: str, config: BoundaryConfig | None = None):
    """One fused_boundary call writing into `res`; with `config`, the kernel compiled for that launch shape
    (e.g. the cluster cap of a GPU with fewer SMs), called with the positional tuple fused_boundary passes."""
    pre, w = (inp.pre, inp.w) if variant.pre else (None, None)
    x = inp.x if variant.y_source == "x" else None
    shared = inp.shared if variant.shared else None
    moe = inp.moe if variant.y_source == "moe" else None
    error = torch.zeros(4, dtype=torch.int32, device="cuda") if moe is not None else None
    if config is None:
        api.fused_boundary(
            variant,
            residual=inp.residual,
            post=inp.post,
            comb=inp.comb,
            pre=pre,
            norm_weight=w,
            norm_eps=EPS,
            x=x,
            shared=shared,
            moe=moe,
            new_residual=res.new_residual,
            out=res.out,
            mxfp8_data=res.data,
            mxfp8_scale=res.scale,
            fp8_data=res.fp8_data,
            fp8_scale=res.fp8_scale,
            aux=res.aux,
            error=error,
            arch=arch,
        )
    else:
        H = inp.residual.shape[-1]
        g, ew, idx = moe if moe is not None else (None, None, None)
        fn = api.compile_fused_boundary(H, *variant, config, 1, "oneshot", arch=arch)
        fn(
            *api.BoundaryArgs(
                residual=inp.residual,
                post=inp.post.view(-1, 4),
                comb=inp.comb,
                pre=pre,
                norm_weight=w,
                x=x,
                shared=shared,
                gemm2_permuted=g,
                expert_weights=ew,
                idx=idx,
                new_residual=res.new_residual,
                out=res.out,
                mxfp8_data=res.data,
                mxfp8_scale=res.scale,
                fp8_data=res.fp8_data,
                fp8_scale=res.fp8_scale,
                aux=res.aux,
                error=error,
                eps=EPS,
            )
        )
    if error is not None:
        torch.cuda.synchronize()
        assert not bool(error.any()), f"the kernel reported an error word {error.tolist()} on valid MoE indices"


def run(inp: Inputs, variant: api.BoundaryVariant, arch: str, config: BoundaryConfig | None = None) -> Outputs:
    """Launch on fresh poisoned buffers and wait."""
    T, _, H = inp.residual.shape
    res = empty_outputs(T, H, variant)
    launch(inp, variant, res, arch, config)
    torch.cuda.synchronize()
    return res


def reference_y(inp: Inputs, variant: api.BoundaryVariant) -> Tensor:
    shared = inp.shared if variant.shared else None
    if variant.y_source == "moe":
        return ref.moe_finalize(*inp.moe, shared)
    return ref.add_shared(inp.x, shared)


def check_mxfp8(out: Tensor, data: Tensor, scale: Tensor) -> None:
    """The MXFP8 bytes of the kernel's own bf16 out, exactly (NaN blocks: every byte NaN, E = 255)."""
    data_ref, scale_ref = ref.mxfp8_quantize(out)
    assert torch.equal(scale, scale_ref), "scale bytes (padding included) differ from mxfp8_quantize(out)"
    got, want = data.view(torch.uint8), data_ref.view(torch.uint8)
    got_nan, want_nan = (got & 0x7F) == 0x7F, (want & 0x7F) == 0x7F
    assert torch.equal(got_nan, want_nan), "NaN data bytes differ"
    assert torch.equal(got[~want_nan], want[~want_nan]), "e4m3 data bytes differ"


def check(inp: Inputs, variant: api.BoundaryVariant, res: Outputs) -> None:
    """R' within 1 ulp of the reference; out, aux and MXFP8 against the reference on the kernel's own R'."""
    r_ref = ref.mhc_post(reference_y(inp, variant), inp.residual, inp.post, inp.comb)
    assert max_ulp(res.new_residual, r_ref) <= 1
    if variant.aux:
        assert max_ulp(res.aux, ref.mean_of_streams(res.new_residual)) <= 1
    if variant.pre:
        out_ref = ref.rms_norm(ref.collapse(res.new_residual, inp.pre), inp.w, EPS)
        dist = ulp_distance(res.out, out_ref)
        assert int(dist.max()) <= 1
        # The kernel rounds where the reference does; only the RMS sum order may differ, so flips are rare.
        assert float((dist != 0).float().mean()) < 0.02
    if variant.mxfp8:
        check_mxfp8(res.out, res.data, res.scale)
    if variant.fp8:
        check_fp8_group(res.out, res.fp8_data, res.fp8_scale, variant.fp8 == "fp8_1x128_ue8m0")


def check_fp8_group(out: Tensor, data: Tensor, scale: Tensor, ue8m0: bool) -> None:
    """The FP8 1x128 bytes of the kernel's own bf16 out, exactly: the e4m3 data and the scales bit for bit (a NaN scale
    as NaN), the padding scales 0."""
    data_ref, scale_ref = ref.fp8_group_quantize(out, ue8m0=ue8m0)
    got, want = data.view(torch.uint8), data_ref.view(torch.uint8)
    assert torch.equal(got, want), f"{int((got != want).sum())} e4m3 bytes differ from the reference rule"
    same = (scale.view(torch.int32) == scale_ref.view(torch.int32)) | (scale.isnan() & scale_ref.isnan())
    assert bool(same.all()), f"{int((~same).sum())} FP8 1x128 scales differ"


def _variant_id(v: api.BoundaryVariant) -> str:
    return api.variant_name(v).replace(" ", "-")


@pytest.mark.parametrize("variant", api.ENGINE_VARIANTS, ids=_variant_id)
def test_every_variant_h5120(variant: api.BoundaryVariant, arch: str) -> None:
    inp = make_inputs(9, 5120, variant, seed=1)
    check(inp, variant, run(inp, variant, arch))


@pytest.mark.parametrize("rows", [1, 2, 7, 16, 64, 129, 512])
@pytest.mark.parametrize("H", [2560, 4096, 5120, 7168])
def test_main_variant_shapes(H: int, rows: int, arch: str) -> None:
    inp = make_inputs(rows, H, MAIN, seed=rows)
    check(inp, MAIN, run(inp, MAIN, arch))


def _row_outputs(res: Outputs, r: int, T: int, H: int) -> list[Tensor]:
    parts = [res.new_residual[r], res.out[r], res.data[r].view(torch.uint8)]
    parts.append(res.scale[ref.swizzled_scale_offsets(T, H, "cuda")[r]])
    if res.aux is not None:
        parts.append(res.aux[r])
    return parts


@pytest.mark.parametrize(
    "variant",
    [api.BoundaryVariant("x", False, True, True, True), api.BoundaryVariant("moe", True, True, True, False)],
    ids=_variant_id,
)
@pytest.mark.parametrize("H", [5120, 7168])
def test_batch_invariance(H: int, variant: api.BoundaryVariant, arch: str) -> None:
    big = make_inputs(512, H, variant, seed=7)
    full = run(big, variant, arch)
    assert_rows_alone_match(big, variant, arch, full, (0, 5, 63))
    check(big, variant, full)


def assert_rows_alone_match(
    big: Inputs, variant: api.BoundaryVariant, arch: str, full: Outputs, rows: tuple[int, ...]
) -> None:
    """Each of `rows` run alone (default config) gives the bits it has among the first 64 rows (default
    config) and in `full`, a run of all 512 rows of `big`."""
    H = big.residual.shape[-1]
    first64 = run(big.rows(slice(0, 64)), variant, arch)
    for r in rows:
        alone = run(big.rows(slice(r, r + 1)), variant, arch)
        want = _row_outputs(alone, 0, 1, H)
        for T, res in ((64, first64), (512, full)):
            for got, exp in zip(_row_outputs(res, r, T, H), want):
                assert bitwise_equal(got, exp), f"row {r} differs between T=1 and T={T}"


def test_cuda_graph_replay_with_inputs_changed_in_place(arch: str) -> None:
    variant = api.BoundaryVariant("x", True, True, True, True)
    T, H = 16, 5120
    inp = make_inputs(T, H, variant, seed=3)
    res = empty_outputs(T, H, variant)
    launch(inp, variant, res, arch)  # compile and load outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch(inp, variant, res, arch)
    for seed in (11, 12, 13):
        fresh = make_inputs(T, H, variant, seed=seed)
        for name in ("residual", "post", "comb", "pre", "w", "x", "shared"):
            getattr(inp, name).copy_(getattr(fresh, name))
        for t in (res.new_residual, res.out, res.aux):
            t.view(torch.int16).fill_(POISON_BF16)
        res.data.view(torch.uint8).fill_(POISON_FP8)
        res.scale.fill_(POISON_SCALE)
        graph.replay()
        torch.cuda.synchronize()
        check(inp, variant, res)


def test_special_values(arch: str) -> None:
    variant = api.BoundaryVariant("x", False, True, True, True)
    T, H = 8, 5120
    inp = make_inputs(T, H, variant, seed=5)
    inp.residual[1, 2, 100] = float("nan")  # row 1: NaN everywhere after the RMS
    inp.x[2, 5] = float("inf")  # row 2: an Inf stream value, an Inf RMS sum
    inp.residual[3] = -0.0  # row 3: all -0.0
    inp.x[3] = -0.0
    inp.residual[4], inp.x[4], inp.post[4] = 1.0, 0.0, 0.0  # row 4: collapse 1.003 -> bf16 1.0
    inp.comb[4] = torch.eye(4, device="cuda")
    inp.pre[4] = torch.tensor([1.003, 0.0, 0.0, 0.0], device="cuda")
    inp.w[0:32] = 3e38  # block 0 overflows: Inf amax (E = 254) or near the top of the range
    inp.w[32:64] = 1e-38  # descale below 2^-127: E = 0
    inp.w[64:96] = 1e-35  # a small normal scale
    res = run(inp, variant, arch)
    check(inp, variant, res)
    negative_zero = torch.tensor(-0.0, dtype=BF16, device="cuda")
    assert bitwise_equal(res.new_residual[3], negative_zero.expand(4, H))
    assert bitwise_equal(res.out[3], negative_zero.expand(H))
    assert bitwise_equal(res.aux[3], negative_zero.expand(H))
    assert bool((res.data[3].view(torch.uint8) == 0x80).all())
    assert torch.isnan(res.out[1]).all() and torch.isinf(res.new_residual[2, :, 5]).all()
    offsets = ref.swizzled_scale_offsets(T, H, "cuda")
    scales = res.scale[offsets]
    assert bool((scales[1] == 255).all()) and int(scales[2, 0]) == 255
    assert bool((scales[:, 0] == 254).any()) and bool((scales[[0, 4, 5, 6, 7], 1] == 0).all())
    # Row 4's collapse is bf16(1.003) = 1.0 everywhere: the norm of a row of ones.
    assert max_ulp(res.out[4], ref.rms_norm(torch.ones(1, H, dtype=BF16, device="cuda"), inp.w, EPS)[0]) <= 1


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("top_k", [1, 6, 8, 9, 16])
def test_moe_indices(top_k: int, shared: bool, arch: str) -> None:
    variant = api.BoundaryVariant("moe", shared, True, False, False)
    inp = make_inputs(7, 5120, variant, seed=top_k, top_k=top_k, drop=0.3)
    inp.moe[2][3] = -1  # a row with no expert at all
    check(inp, variant, run(inp, variant, arch))


def test_moe_residual_only_with_an_empty_gather(arch: str) -> None:
    variant = api.BoundaryVariant("moe", True, False, False, True)
    inp = make_inputs(5, 2560, variant, seed=9, top_k=4)
    inp.moe[2].fill_(-1)
    check(inp, variant, run(inp, variant, arch))


def test_post_with_a_trailing_one_and_zero_rows(arch: str) -> None:
    inp = make_inputs(4, 5120, MAIN, seed=2)
    plain = run(inp, MAIN, arch)
    trailing = run(replace(inp, post=inp.post.unsqueeze(-1).contiguous()), MAIN, arch)
    assert bitwise_equal(plain.new_residual, trailing.new_residual) and bitwise_equal(plain.out, trailing.out)
    empty = make_inputs(0, 5120, MAIN)
    run(empty, MAIN, arch)  # no launch, no error


# ---------------------------------------------------------------------------------------------
# Row schedules: the cluster cap (read from the SM count: a GPU with fewer SMs gets a smaller one)
# changes no bit of any output (the per-row arithmetic and the RMS reduction order are the same).
# Tiny caps make each cluster loop over many rows (T=512: 171 and 103 rows), both parities.

ALL_OUTPUTS = api.BoundaryVariant("x", shared=True, pre=True, mxfp8=True, aux=True)


def _capped(H: int, max_clusters: int) -> BoundaryConfig:
    """The shipped launch shape under a smaller cluster cap."""
    return replace(default_config(H, "sm_90a"), max_clusters=max_clusters)


def _all_outputs(res: Outputs) -> list[Tensor]:
    return [t for t in (res.new_residual, res.out, res.data, res.scale, res.aux) if t is not None]


@pytest.mark.parametrize("rows", [1, 7, 129, 512])
@pytest.mark.parametrize("H", [2560, 7168])
def test_cluster_caps_are_bit_identical_to_the_default(H: int, rows: int, arch: str) -> None:
    inp = make_inputs(rows, H, ALL_OUTPUTS, seed=rows + 100)
    base = run(inp, ALL_OUTPUTS, arch)
    check(inp, ALL_OUTPUTS, base)
    for cap in (2, 3, 5):
        res = run(inp, ALL_OUTPUTS, arch, config=_capped(H, cap))
        for got, want in zip(_all_outputs(res), _all_outputs(base), strict=True):
            assert bitwise_equal(got, want), f"cap {cap} differs from the default at H={H}, T={rows}"


@pytest.mark.parametrize(
    "variant",
    [
        api.BoundaryVariant("moe", True, True, True, True),
        api.BoundaryVariant("x", False, False, False, True),
        api.BoundaryVariant("moe", False, False, False, False),
        MAIN,
    ],
    ids=_variant_id,
)
def test_looping_variants_are_bit_identical_to_the_default(variant: api.BoundaryVariant, arch: str) -> None:
    H, rows = 5120, 129
    inp = make_inputs(rows, H, variant, seed=17)
    base = run(inp, variant, arch)
    check(inp, variant, base)
    res = run(inp, variant, arch, config=_capped(H, 4))
    for got, want in zip(_all_outputs(res), _all_outputs(base), strict=True):
        assert bitwise_equal(got, want), "a cap of 4 clusters differs from the default"


@pytest.mark.parametrize("H", [2560, 7168])
def test_looping_batch_invariance(H: int, arch: str) -> None:
    """A row's bits are the same alone, among 64 rows, or among 512 rows on 5 clusters of ~103 rows."""
    variant = ALL_OUTPUTS
    looping = _capped(H, 5)
    big = make_inputs(512, H, variant, seed=23)
    full = run(big, variant, arch, config=looping)
    assert_rows_alone_match(big, variant, arch, full, (0, 4, 5, 63))
    check(big, variant, full)


def test_looping_cuda_graph_replay(arch: str) -> None:
    """Replays of a looping launch: the mbarrier phases start afresh in every launch."""
    variant = ALL_OUTPUTS
    T, H = 300, 4096
    config = _capped(H, 7)
    inp = make_inputs(T, H, variant, seed=31)
    res = empty_outputs(T, H, variant)
    launch(inp, variant, res, arch, config)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(3):
            launch(inp, variant, res, arch, config)
    for seed in (32, 33):
        fresh = make_inputs(T, H, variant, seed=seed)
        for name in ("residual", "post", "comb", "pre", "w", "x", "shared"):
            getattr(inp, name).copy_(getattr(fresh, name))
        for t in _all_outputs(res):
            t.view(torch.uint8).fill_(0xAA)
        graph.replay()
        torch.cuda.synchronize()
        check(inp, variant, res)


def test_scale_padding_with_an_unaligned_buffer(arch: str) -> None:
    """The scale padding falls back to 4-byte stores when the scale buffer is only 4-byte aligned."""
    variant = MAIN
    T, H = 5, 2560
    inp = make_inputs(T, H, variant, seed=41)
    want = run(inp, variant, arch)
    res = empty_outputs(T, H, variant)
    backing = torch.full((res.scale.numel() + 4,), POISON_SCALE, dtype=torch.uint8, device="cuda")
    res.scale = backing[4:]  # 4 bytes past a 256-byte aligned allocation
    launch(inp, variant, res, arch)
    torch.cuda.synchronize()
    assert bitwise_equal(res.scale, want.scale) and bitwise_equal(res.data, want.data)
