"""The FP8 1x128 layer input written by the fused kernels (CONTRACT §4b): the bytes against the reference rule applied
to the kernel's own bf16 layer input, exactly (special groups too), at one rank and on simulated ranks, through
BoundaryAllReduce, the scheduler and the custom ops; and a real FP8 GEMM fed with them against the bf16 GEMM."""

from __future__ import annotations

import pytest
import torch

from boundary import (
    Boundaries,
    BoundaryAllReduce,
    DecodeStep,
    Fp8GroupActivation,
    empty_fp8_group_layer_input,
    empty_quantized_layer_input,
)
from boundary import reference as ref
from boundary.toy import ToyConfig, ToyModel, random_tokens
from cute_kernels.boundary import api
from cute_kernels.compile import arch_for_device, warmup
from tests.bf16 import bitwise_equal, max_ulp
from tests.inputs import boundary_inputs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

BF16, F32 = torch.bfloat16, torch.float32
EPS = 1e-6
FORMS = {"fp8_1x128": False, "fp8_1x128_ue8m0": True}  # quantize name -> ue8m0


def inputs(rows: int, hidden: int, seed: int, *, special: bool = False) -> dict[str, torch.Tensor]:
    """A boundary's inputs; `special`: the norm weight makes group 0 all zeros, group 1 hold a NaN, group 2 an
    Inf and group 3 values below the 1e-4 amax floor, in every row."""
    inp = boundary_inputs(rows, hidden, seed, "cuda")
    if special:
        w = inp["norm_weight"]
        w[:128] = 0
        w[128 + 5] = float("nan")
        w[256 + 7] = float("inf")
        w[384:512] = 1e-6
    return inp


def poisoned_fp8(rows: int, hidden: int, ue8m0: bool) -> Fp8GroupActivation:
    """An output buffer full of garbage (NaN bytes and scales), so that every byte the kernel must write is seen."""
    q = empty_fp8_group_layer_input(rows, hidden, "cuda", ue8m0=ue8m0)
    q.data.view(torch.uint8).fill_(0x7F)
    q.scale.fill_(float("nan"))
    return q


def assert_fp8_bytes(q: Fp8GroupActivation, out: torch.Tensor) -> None:
    """The kernel's FP8 1x128 bytes are the reference rule's on its own layer input `out`: the e4m3 data bit for bit,
    the scales bit for bit (a NaN scale as NaN: its payload is no part of the rule), the padding scales 0."""
    data, scale = ref.fp8_group_quantize(out, ue8m0=q.ue8m0)
    got, want = q.data.view(torch.uint8), data.view(torch.uint8)
    assert torch.equal(got, want), f"{int((got != want).sum())} e4m3 bytes differ from the reference rule"
    both_nan = q.scale.isnan() & scale.isnan()
    same = (q.scale.view(torch.int32) == scale.view(torch.int32)) | both_nan
    assert bool(same.all()), f"{int((~same).sum())} scales differ: got {q.scale[~same][:4]}, want {scale[~same][:4]}"


def call(ar: BoundaryAllReduce, inp: dict, q: Fp8GroupActivation | None, mxfp8=None, x=None):
    """One boundary of `ar` on `inp` (its own partial `x` when given) writing `q` (and MXFP8)."""
    x = inp["x"] if x is None else x
    return ar(x, inp["residual"], inp["post"], inp["comb"], inp["pre"], inp["norm_weight"], EPS, mxfp8, fp8_out=q)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize(
    ("hidden", "rows"),
    [
        (4096, 1),
        (4096, 2),
        (4096, 3),
        (4096, 16),
        (4096, 512),
        (7168, 1),
        (7168, 6),
        (7168, 17),
        (7168, 128),
        (4352, 5),
        (2560, 64),
    ],
)
def test_one_rank_writes_the_reference_bytes(form: str, hidden: int, rows: int) -> None:
    """At one rank, alone and beside MXFP8; the bf16 layer input is the same bits with or without it. The rows put
    the last one at each place of its chunk of 4 scales (1, 5, 17: first; 2, 6: second; 3: third; 16, 64: last), which
    decides how its padding is written."""
    ar = BoundaryAllReduce(hidden, max_rows=512, device="cuda")
    inp = inputs(rows, hidden, seed=rows + hidden)
    q = poisoned_fp8(rows, hidden, FORMS[form])
    new, out = call(ar, inp, q)
    assert_fp8_bytes(q, out)
    _, plain = call(ar, inp, None)
    assert bitwise_equal(out, plain), "writing FP8 1x128 changed the bf16 layer input"
    assert max_ulp(out, ref.rms_norm(ref.collapse(new, inp["pre"]), inp["norm_weight"], EPS)) <= 1
    q2, mx = poisoned_fp8(rows, hidden, FORMS[form]), empty_quantized_layer_input(rows, hidden, "cuda")
    _, out2 = call(ar, inp, q2, mxfp8=mx)
    assert bitwise_equal(out2, out)
    assert_fp8_bytes(q2, out2)
    data, scale = ref.mxfp8_quantize(out2)
    assert bitwise_equal(mx.scale, scale) and torch.equal(mx.data.view(torch.uint8), data.view(torch.uint8))


def test_a_misaligned_scale_buffer_is_refused_before_any_launch() -> None:
    """The scales go out in 16-byte stores: a buffer off that boundary is a ValueError at the public call, and at the
    kernel entry TVM-FFI's alignment check (the kernel is compiled for 16-byte aligned scales), never a misaligned
    store, which would end the CUDA context; the next calls on the same GPU are exact."""
    rows, hidden = 5, 4096
    ar = BoundaryAllReduce(hidden, max_rows=8, device="cuda")
    inp = inputs(rows, hidden, seed=3)
    q = poisoned_fp8(rows, hidden, False)
    raw = torch.zeros(q.scale.numel() + 4, device="cuda")
    off = Fp8GroupActivation(q.data, raw[1 : 1 + q.scale.numel()].view(q.scale.shape), BF16, q.orig_shape, q.quant_key)
    with pytest.raises(ValueError, match="fp8_out.scale must start on a 16-byte boundary"):
        call(ar, inp, off)
    new = torch.empty(rows, 4, hidden, dtype=BF16, device="cuda")
    out = torch.empty(rows, hidden, dtype=BF16, device="cuda")
    entry = dict(
        residual=inp["residual"], post=inp["post"], comb=inp["comb"], pre=inp["pre"], norm_weight=inp["norm_weight"]
    )
    entry |= dict(norm_eps=EPS, x=inp["x"], new_residual=new, out=out, fp8_data=q.data)
    arch, variant = arch_for_device(torch.device("cuda")), api.BoundaryVariant("x", fp8="fp8_1x128")
    with pytest.raises(ValueError, match="Misaligned Tensor data"):
        api.fused_boundary(variant, **entry, fp8_scale=off.scale, arch=arch)
    api.fused_boundary(variant, **entry, fp8_scale=q.scale, arch=arch)
    torch.cuda.synchronize()
    assert_fp8_bytes(q, out)
    assert bool((raw == 0).all()), "the refused call wrote to the misaligned buffer"
    q2 = poisoned_fp8(rows, hidden, False)
    _, out2 = call(ar, inp, q2)
    assert bitwise_equal(out2, out)
    assert_fp8_bytes(q2, out2)


@pytest.mark.parametrize("form", FORMS)
def test_zero_nan_inf_and_tiny_groups(form: str) -> None:
    """A group of zeros (scale 1e-4/448, data 0), a NaN (the group's scale and data NaN), an Inf (scale Inf, the
    Inf element NaN, the rest zero) and one below the amax floor, in every row, exactly as torch evaluates the rule."""
    rows, hidden = 6, 4096
    ar = BoundaryAllReduce(hidden, max_rows=8, device="cuda")
    inp = inputs(rows, hidden, seed=5, special=True)
    q = poisoned_fp8(rows, hidden, FORMS[form])
    _, out = call(ar, inp, q)
    assert bool((out[:, :128] == 0).all()) and bool(out[:, 133].isnan().all()) and bool(out[:, 263].isinf().all())
    assert bool((out[:, 384:512].abs().float() < 1e-4).all())
    assert_fp8_bytes(q, out)
    assert bool(q.scale[1, :rows].isnan().all()) and bool(q.scale[2, :rows].isinf().all())


def test_a_moe_boundary_writes_it_too() -> None:
    rows, hidden, top_k = 9, 7168, 4
    ar = BoundaryAllReduce(hidden, max_rows=16, device="cuda")
    inp = inputs(rows, hidden, seed=3)
    g = torch.Generator(device="cuda").manual_seed(4)
    gemm2 = torch.randn(rows * top_k, hidden, generator=g, device="cuda").to(BF16)
    weights = torch.rand(rows, top_k, generator=g, device="cuda") / top_k
    idx = torch.randperm(rows * top_k, generator=g, device="cuda").view(rows, top_k).to(torch.int32)
    q = poisoned_fp8(rows, hidden, True)
    _, out = ar.finalize(
        gemm2,
        weights,
        idx,
        inp["x"],
        inp["residual"],
        inp["post"],
        inp["comb"],
        inp["pre"],
        inp["norm_weight"],
        EPS,
        None,
        fp8_out=q,
    )
    assert_fp8_bytes(q, out)


@pytest.mark.parametrize("world", [2, 4, 8])
def test_simulated_ranks_write_the_same_reference_bytes(world: int) -> None:
    """Every rank of the peer path writes the same FP8 1x128 bytes, the reference rule's on its layer input, with
    each protocol (one-shot and two-shot, the staged schedule at many rows)."""
    hidden = 4096
    ranks = BoundaryAllReduce.simulated(hidden, world, max_rows=512, device="cuda")
    arch = arch_for_device(torch.device("cuda"))
    variants = [api.BoundaryVariant(fp8=form) for form in FORMS]
    warmup(
        api.warmup_jobs(hidden, arch=arch, world_size=world, ranks_per_device=world, variants=variants),
        progress=False,
        device=torch.device("cuda"),
    )
    for protocol in ("oneshot", "twoshot"):
        for ar in ranks:
            ar.protocol = protocol
        for rows in (1, 16, 300):
            for ue8m0 in FORMS.values():
                inp = inputs(rows, hidden, seed=world * rows)
                parts = [torch.randn(rows, hidden, device="cuda").to(BF16) for _ in range(world)]
                qs = [poisoned_fp8(rows, hidden, ue8m0) for _ in range(world)]
                outs = BoundaryAllReduce.run_simulated(
                    ranks,
                    [lambda ar, inp=inp, qs=qs, parts=parts: call(ar, inp, qs[ar.rank], x=parts[ar.rank])] * world,
                )
                torch.cuda.synchronize()
                for ar in ranks:
                    ar.check()
                for (_, out), q in zip(outs, qs, strict=True):
                    assert bitwise_equal(out, outs[0][1]) and bitwise_equal(q.data, qs[0].data)
                    assert_fp8_bytes(q, out)


@pytest.mark.parametrize("custom_ops", [False, True])
@pytest.mark.parametrize("form", FORMS)
def test_the_scheduler_returns_it(form: str, custom_ops: bool) -> None:
    """sublayer(quantize=...) on the kernels: the FP8 1x128 form of the layer input it returns, through the direct
    path and the custom ops."""
    model = ToyModel(ToyConfig(hidden_size=4096, num_layers=2, vocab=64), device="cuda")
    b = Boundaries(BoundaryAllReduce(4096, max_rows=8, device="cuda"), custom_ops=custom_ops)
    rows = 5
    step = DecodeStep(rows=rows, side_stream=False)
    state, x = b.first(model.layers[0], model.embed[random_tokens(model, rows, 0)], step)
    state.pending = model.attention(model.layers[0], x)
    _, x, q, _ = b.sublayer(model.layers[0], True, state, step, quantize=form)
    torch.cuda.synchronize()
    assert isinstance(q, Fp8GroupActivation) and q.ue8m0 is FORMS[form]
    assert_fp8_bytes(q, x)


def _scaled_mm():
    """torch's block-scaled FP8 GEMM (1x128 activation scales, 128x128 weight scales), or None where this torch or GPU
    lacks it."""
    try:
        from torch.nn.functional import ScalingType, scaled_mm
    except ImportError:
        return None
    if torch.cuda.get_device_capability() != (9, 0):
        return None
    return scaled_mm, ScalingType


@pytest.mark.parametrize("ue8m0", [False, True])
def test_a_real_fp8_gemm_reads_the_bytes(ue8m0: bool) -> None:
    """torch.nn.functional.scaled_mm (cuBLAS's block-scaled FP8 GEMM on SM90: the activation with the boundary's 1x128
    scales, column-major as DeepGEMM reads them, a weight with 128x128 block scales) matches the same GEMM done in
    fp32 on the dequantised operands closely, and the bf16 GEMM of the bf16 layer input within FP8 error."""
    found = _scaled_mm()
    if found is None:
        pytest.fail(
            f"torch {torch.__version__} on this GPU has no block-scaled scaled_mm: the FP8 GEMM test cannot run"
        )
    scaled_mm, ScalingType = found
    rows, hidden, n = 128, 7168, 2048  # rows a multiple of 4: T_pad = T, so scale.t() has the strides cuBLAS takes
    ar = BoundaryAllReduce(hidden, max_rows=rows, device="cuda")
    inp = inputs(rows, hidden, seed=11)
    q = empty_fp8_group_layer_input(rows, hidden, "cuda", ue8m0=ue8m0)
    _, out = call(ar, inp, q)
    g = torch.Generator(device="cuda").manual_seed(12)
    weight = (torch.randn(n, hidden, generator=g, device="cuda") * 0.02).to(BF16)
    blocks = weight.float().view(n // 128, 128, hidden // 128, 128)
    w_sf = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-4) / 448.0  # [N/128, K/128]
    w_q = (blocks / w_sf[:, None, :, None]).view(n, hidden).to(torch.float8_e4m3fn)
    a_scale = q.scale.t()[:rows]  # [T, K/128], strides (1, T_pad): the column-major layout
    assert a_scale.stride() == (1, rows)
    # 128x128 scales go K-major: [K/128 (padded to 4), N/128] with strides (1, K/128 padded).
    k_blocks = -(-(hidden // 128) // 4) * 4
    b_scale = torch.nn.functional.pad(w_sf, (0, k_blocks - hidden // 128)).t()
    got = scaled_mm(
        q.data, w_q.t(), a_scale, ScalingType.BlockWise1x128, b_scale, ScalingType.BlockWise128x128, output_dtype=BF16
    )
    a_deq = (q.data.float().view(rows, hidden // 128, 128) * q.scale[:, :rows].t()[:, :, None]).view(rows, hidden)
    w_deq = (w_q.float().view(n // 128, 128, hidden // 128, 128) * w_sf[:, None, :, None]).view(n, hidden)
    emulated = a_deq @ w_deq.t()
    exact = out.float() @ weight.float().t()
    rel = lambda a, b: float((a.float() - b).norm() / b.norm())  # noqa: E731
    assert rel(got, emulated) < 1e-2, f"the GEMM read other bytes or scales than written: {rel(got, emulated):.4f}"
    assert rel(got, exact) < 0.08, f"FP8 error beyond e4m3's: {rel(got, exact):.4f}"
