"""The boundary that computes its own pre (DeepSeek-V4, CONTRACT §4d): `BoundaryAllReduce(..., mix=)` writes the new
streams R', the pre of R' (`pre = sigmoid(scale * (fn . R') * rsqrt(mean(R'^2) + rms_eps) + base) + eps`, fn the
pre mixes' 4 rows or hc_head's) and the layer input collapsed with that pre, in one launch on the kernels.

The rounding contract: R' within §2's 1 ulp; the pre within fp32 of the formula (the dot products' order is the
kernel's: 1e-5 relative, as §4d's weights); the layer input is the reference's collapse and norm applied to the
kernel's own R' and pre (1 ulp), and its quantized forms the reference quantization of it, byte for byte."""

from __future__ import annotations

import pytest
import torch

from boundary import BoundaryAllReduce, mhc
from boundary import reference as ref
from boundary.types import MixWeights, QuantizedActivation, empty_fp8_group, empty_quantized, quant_form
from tests.bf16 import exported, max_ulp
from tests.inputs import boundary_inputs

BF16, F32 = torch.bfloat16, torch.float32
HAS_GPU = torch.cuda.is_available()


def weights(hidden: int, device: str, seed: int = 0) -> MixWeights:
    g = torch.Generator(device=device).manual_seed(seed)
    fn = torch.randn(24, 4 * hidden, generator=g, device=device) * 1e-2
    scale = torch.rand(3, generator=g, device=device) + 0.5
    base = torch.randn(24, generator=g, device=device)
    return mhc.mix_weights(fn[:4], scale[:1], base[:4], 1e-6, 1e-6)  # a layer's pre rows, as V4Boundaries takes them


def own_pre_reference(y, inp, mix: MixWeights, eps: float):
    """(R', pre, layer input) by the torch reference."""
    streams = ref.mhc_post(y, inp["residual"], inp["post"], inp["comb"])
    pre = ref.hc_head_mix(streams, mix.fn, mix.scale, mix.base, mix.rms_eps, mix.eps)
    return streams, pre, ref.rms_norm(ref.collapse(streams, pre), inp["norm_weight"], eps)


def own_call(ar: BoundaryAllReduce, inp, mix: MixWeights, pre, mxfp8=None, **kw):
    """The boundary on inp's ready partial, computing its own pre into `pre`."""
    streams = (inp["residual"], inp["post"], inp["comb"])
    return ar(inp["x"], *streams, None, inp["norm_weight"], 1e-6, mxfp8, mix=mix, pre_out=pre, **kw)


def test_the_reference_path_writes_the_own_pre_and_collapses_with_it() -> None:
    hidden, rows = 256, 3
    ar = BoundaryAllReduce(hidden, max_rows=8, device="cpu")
    inp, mix = boundary_inputs(rows, hidden, 0, "cpu"), weights(hidden, "cpu")
    pre = torch.full((rows, 4), float("nan"))
    new, out = own_call(ar, inp, mix, pre)
    want_new, want_pre, want_out = own_pre_reference(inp["x"], inp, mix, 1e-6)
    assert torch.equal(new, want_new) and torch.equal(pre, want_pre) and torch.equal(out, want_out)


def test_the_own_pre_call_refuses_what_it_cannot_mean() -> None:
    hidden, rows = 256, 2
    ar = BoundaryAllReduce(hidden, max_rows=8, device="cpu")
    inp, mix = boundary_inputs(rows, hidden, 0, "cpu"), weights(hidden, "cpu")
    call = (inp["x"], inp["residual"], inp["post"], inp["comb"])
    with pytest.raises(ValueError, match="pass pre=None"):
        ar(*call, inp["pre"], inp["norm_weight"], 1e-6, None, mix=mix)
    with pytest.raises(ValueError, match="needs mix"):
        ar(*call, inp["pre"], inp["norm_weight"], 1e-6, None, pre_out=torch.empty(rows, 4))
    with pytest.raises(TypeError, match="MixWeights"):
        ar(*call, None, inp["norm_weight"], 1e-6, None, mix=(mix.fn, mix.params))
    with pytest.raises(ValueError, match="pre_out"):
        ar(*call, None, inp["norm_weight"], 1e-6, None, mix=mix, pre_out=torch.empty(rows + 1, 4))
    with pytest.raises(ValueError, match="fn"):
        mhc.mix_weights(mix.fn.t().contiguous().t(), mix.scale, mix.base, 1e-6, 1e-6)  # [4, 4H] but not contiguous


def test_mix_weights_are_built_once_and_rewritten_in_place_after_an_update() -> None:
    """Built once per set of tensors; an in-place update torch sees (or a new storage under `.data`) rewrites the
    kernel form in place, at the same address, so that a CUDA graph captured before reads it."""
    mix = weights(256, "cpu")
    again = mhc.mix_weights(mix.fn, mix.scale, mix.base, 1e-6, 1e-6)
    assert again.params is mix.params and again.fn is mix.fn
    assert mix.params.tolist()[5:] == pytest.approx([1e-6, 1e-6, 0.0])
    mix.base.add_(1.0)
    rebuilt = mhc.mix_weights(mix.fn, mix.scale, mix.base, 1e-6, 1e-6)
    assert rebuilt.params is mix.params and torch.equal(rebuilt.params[1:5], mix.base)
    mix.scale.data = torch.full((1,), 3.0)  # a new storage under the same tensor object (Module._apply, assign=)
    assert mhc.mix_weights(mix.fn, mix.scale, mix.base, 1e-6, 1e-6).params[0].item() == 3.0


def test_an_update_torch_does_not_see_needs_weights_updated() -> None:
    """A loader's `param.data.copy_` or a collective writes without a version bump: V4Boundaries.weights_updated()
    rewrites the copies in place (the same tensors), in both caches."""
    from boundary import V4Boundaries

    fn, scale, base = torch.randn(4, 4 * 256), torch.full((1,), 0.5), torch.zeros(4)
    params = mhc.mix_weights(fn, scale, base, 1e-6, 1e-6).params
    fn24, scale3, base24 = mhc._head_weights(fn, scale, base)
    scale.data.copy_(torch.full((1,), 2.0))
    base.data.copy_(torch.ones(4))
    fn.data.zero_()
    assert params[0].item() == 0.5  # unseen: the negative control
    V4Boundaries(BoundaryAllReduce(256, max_rows=4, device="cpu")).weights_updated()
    assert mhc.mix_weights(fn, scale, base, 1e-6, 1e-6).params is params
    assert params[:5].tolist() == [2.0, 1.0, 1.0, 1.0, 1.0]
    assert mhc._head_weights(fn, scale, base)[0] is fn24 and not fn24.any() and scale3[0] == 2.0 and base24[:4].all()


def test_the_kept_copies_are_bounded_and_leave_parameters_swappable() -> None:
    """At most 32 sets of weights are kept (strongly: no id of a kept tensor is reused; no weak reference left on a
    parameter, which torch.utils.swap_tensors, Module._apply's swap path, refuses); inference tensors have no version
    counter and are taken too."""
    for _ in range(40):
        mhc.mix_weights(torch.randn(4, 4 * 256), torch.ones(1), torch.zeros(4), 1e-6, 1e-6)
    assert len(mhc._MIX_WEIGHTS.entries) == 32
    head = torch.nn.Module()
    head.fn, head.scale, head.base = (
        torch.nn.Parameter(t) for t in (torch.randn(4, 1024), torch.ones(1), torch.zeros(4))
    )
    mhc.mix_weights(head.fn, head.scale, head.base, 1e-6, 1e-6)
    mhc._head_weights(head.fn, head.scale, head.base)
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        head.double()
    finally:
        torch.__future__.set_swap_module_params_on_conversion(False)
    with torch.inference_mode():
        fn, scale, base = torch.randn(4, 1024), torch.ones(1), torch.zeros(4)
    assert mhc.mix_weights(fn, scale, base, 1e-6, 1e-6).params[0].item() == 1.0
    assert mhc._head_weights(fn, scale, base)[1][0].item() == 1.0


def test_a_new_scale_or_base_with_a_freed_ones_id_is_not_a_hit(monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine that replaces hc_head's scale (or base) by a new tensor, keeping fn: CPython may give the new tensor
    the freed one's id (it often does), which must not return the old values, in both caches (the kernel params and
    the 24-mix form). The reuse is made certain here: `id` in mhc answers the same for the old and the new tensor."""
    import builtins

    fn = torch.randn(4, 4 * 256)
    for name in ("scale", "base"):
        old = {"scale": torch.full((1,), 0.5), "base": torch.zeros(4)}
        new = {**old, name: torch.full(old[name].shape, 2.0)}
        alias = {builtins.id(old[name]), builtins.id(new[name])}
        monkeypatch.setattr(mhc, "id", lambda o, a=alias: -1 if builtins.id(o) in a else builtins.id(o), raising=False)
        mhc.mix_weights(fn, old["scale"], old["base"], 1e-6, 1e-6)
        mhc._head_weights(fn, old["scale"], old["base"])
        params = mhc.mix_weights(fn, new["scale"], new["base"], 1e-6, 1e-6).params
        _, scale3, base24 = mhc._head_weights(fn, new["scale"], new["base"])
        if name == "scale":
            assert params[0].item() == 2.0 and scale3[0].item() == 2.0
        else:
            assert torch.equal(params[1:5], new["base"]) and torch.equal(base24[:4], new["base"])
        monkeypatch.undo()


@pytest.mark.parametrize("world", [1, 2])
def test_the_own_pre_kernel_compiles(world: int) -> None:
    from cute_kernels.boundary import api
    from cute_kernels.boundary.args import BoundaryVariant
    from cute_kernels.boundary.config import default_config

    variant = BoundaryVariant("x", pre=True, own_pre=True)
    config = default_config(4096, "sm_90a", 1, world)
    extra = () if world == 1 else (False,)
    assert exported(api.compile_fused_boundary(4096, *variant, config, world, "oneshot", *extra, arch="sm_90a"))


gpu = pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU")


def check(y, inp, mix, new, pre, out, eps, q=None):
    want_new, _, _ = own_pre_reference(y, inp, mix, eps)
    assert max_ulp(new, want_new) <= 1
    # The pre of the kernel's own R', in float64: fp32 within 1e-5 relative.
    want_pre = ref.hc_head_mix(new, mix.fn, mix.scale, mix.base, mix.rms_eps, mix.eps)
    exact = (
        torch.sigmoid(
            (new.double().reshape(new.shape[0], -1) @ mix.fn.double().t())
            * torch.rsqrt(new.double().reshape(new.shape[0], -1).square().mean(-1, keepdim=True) + mix.rms_eps)
            * mix.scale.double()
            + mix.base.double()
        )
        + mix.eps
    )
    assert torch.allclose(pre.double(), exact, rtol=1e-5, atol=1e-6), (pre - exact).abs().max()
    assert torch.allclose(pre, want_pre, rtol=1e-5, atol=1e-6)
    assert max_ulp(out, ref.rms_norm(ref.collapse(new, pre), inp["norm_weight"], eps)) <= 1
    if q is not None:  # the reference quantization of the kernel's own layer input, padding zeros included
        data, scale = torch.empty_like(q.data), torch.zeros_like(q.scale)
        ref.quantize_into(out, data, scale, quant_form(q))
        assert torch.equal(q.data.view(torch.uint8), data.view(torch.uint8))
        assert torch.equal(q.scale.view(torch.uint8), scale.view(torch.uint8))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("hidden", [4096, 7168])
@pytest.mark.parametrize("rows", [1, 3, 16, 129])
def test_the_kernel_computes_its_own_pre_and_collapses_with_it(hidden: int, rows: int) -> None:
    ar = BoundaryAllReduce(hidden, max_rows=256, device="cuda")
    inp, mix = boundary_inputs(rows, hidden, rows, "cuda"), weights(hidden, "cuda", rows)
    pre = torch.full((rows, 4), float("nan"), device="cuda")
    new, out = own_call(ar, inp, mix, pre)
    check(inp["x"], inp, mix, new, pre, out, 1e-6)
    # With the shared addend and each quantized form.
    y = ref.add_shared(inp["x"], inp["shared"])
    for q in (empty_quantized(rows, hidden, "cuda"), empty_fp8_group(rows, hidden, "cuda", False)):
        mx = q if isinstance(q, QuantizedActivation) else None
        new, out = own_call(ar, inp, mix, pre, mx, shared_output=inp["shared"], fp8_out=None if mx else q)
        check(y, inp, mix, new, pre, out, 1e-6, q)


@gpu
@pytest.mark.gpu
def test_the_own_pre_boundary_replays_in_a_cuda_graph_with_new_inputs() -> None:
    hidden, rows = 7168, 4
    ar = BoundaryAllReduce(hidden, max_rows=8, device="cuda")
    inp, mix = boundary_inputs(rows, hidden, 0, "cuda"), weights(hidden, "cuda")
    pre = torch.empty(rows, 4, device="cuda")

    def call():
        return own_call(ar, inp, mix, pre)

    call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        new, out = call()
    for seed in range(3):
        fresh = boundary_inputs(rows, hidden, 10 + seed, "cuda")
        for k in inp:
            inp[k].copy_(fresh[k])
        graph.replay()
        torch.cuda.synchronize()
        check(inp["x"], inp, mix, new, pre, out, 1e-6)
