"""The layer-input kernel's quantized forms (DeepSeek-V4's own-pre layer input, `boundary.mhc.collapse_norm`): the
bf16 output within 1 ulp of the reference collapse and norm, and its MXFP8 / FP8 1x128 bytes exactly the reference
quantization of that very output (CONTRACT §4, §4b), every byte of the buffers written (scale padding included).

Run: python -m pytest -q -m gpu tests/test_layer_input_quant_gpu.py
"""

from __future__ import annotations

import pytest
import torch

from boundary import mhc
from boundary import reference as ref
from boundary.types import empty_layer_input_form, quant_form
from tests.bf16 import max_ulp
from tests.inputs import boundary_inputs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"),
]

BF16, F32 = torch.bfloat16, torch.float32
FORMS = ("mxfp8", "fp8_1x128", "fp8_1x128_ue8m0")
EPS = 1e-6


def inputs(rows: int, H: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Streams [T, 4, H] bf16, a pre [T, 4] fp32 and a norm weight [H] bf16 (tests/inputs.py's)."""
    inp = boundary_inputs(rows, H, seed, device="cuda")
    return inp["residual"], inp["pre"] + 1e-6, inp["norm_weight"]


def poisoned(rows: int, H: int, form: str):
    """An empty quantized layer input whose every byte is 0xFF, so that a byte the kernel skips shows."""
    out = empty_layer_input_form(form, rows, H, torch.device("cuda"))
    out.data.view(torch.uint8).fill_(0xFF)
    out.scale.view(torch.uint8).fill_(0xFF)
    return out


def assert_exact_form(layer_input: torch.Tensor, out) -> None:
    """The quantized bytes are the reference quantization of the kernel's own bf16 output, padding included."""
    data = torch.empty_like(out.data)
    scale = torch.empty_like(out.scale)
    ref.quantize_into(layer_input, data, scale, quant_form(out))
    assert torch.equal(out.data.view(torch.uint8), data.view(torch.uint8))
    assert torch.equal(out.scale.view(torch.uint8), scale.view(torch.uint8))


@pytest.mark.parametrize("H", (4096, 7168))
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("rows", (1, 3, 16, 129, 512))
def test_the_quantized_layer_input_is_the_reference_quantization_of_its_bf16_output(
    H: int, form: str, rows: int
) -> None:
    residual, pre, weight = inputs(rows, H, seed=rows + H)
    out = poisoned(rows, H, form)
    layer_input = mhc.collapse_norm(residual, pre, weight, EPS, quantized_out=out)
    want = ref.rms_norm(ref.collapse(residual, pre), weight, EPS)
    assert max_ulp(layer_input, want) <= 1
    assert_exact_form(layer_input, out)
    # The same bf16 bits as the kernel without a quantized form.
    assert torch.equal(layer_input.view(torch.int16), mhc.collapse_norm(residual, pre, weight, EPS).view(torch.int16))


@pytest.mark.parametrize("form", FORMS)
def test_adversarial_rows_quantize_as_the_reference(form: str) -> None:
    """A zero row (zero scales, the FP8 amax floor), a row with a NaN (NaN blocks), one with an Inf, tiny and huge
    values, and a single large element per 128-column group."""
    H, rows = 4096, 8
    residual, pre, weight = inputs(rows, H, seed=7)
    residual[0] = 0
    residual[1, 2, 100] = float("nan")
    residual[2, 0, 4000] = float("inf")
    residual[3] *= 1e-30
    residual[4] *= 1e30
    residual[5] *= 1e-3
    residual[5, :, ::128] = 1e3
    pre[6] = torch.tensor([1.0, -1.0, 1.0, -1.0], device="cuda")
    residual[6, 1] = residual[6, 0]  # a row whose collapse cancels to (mostly) zero
    out = poisoned(rows, H, form)
    layer_input = mhc.collapse_norm(residual, pre, weight, EPS, quantized_out=out)
    want = ref.rms_norm(ref.collapse(residual, pre), weight, EPS)
    assert max_ulp(layer_input, want) <= 1  # NaN where the reference has NaN
    assert_exact_form(layer_input, out)


def test_the_quantized_layer_input_replays_in_a_cuda_graph() -> None:
    H, rows = 7168, 16
    residual, pre, weight = inputs(rows, H, seed=3)
    out = poisoned(rows, H, "fp8_1x128")
    mhc.collapse_norm(residual, pre, weight, EPS, quantized_out=out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        layer_input = mhc.collapse_norm(residual, pre, weight, EPS, quantized_out=out)
    for seed in (11, 12):
        r, p, _ = inputs(rows, H, seed)
        residual.copy_(r)
        pre.copy_(p)
        graph.replay()
        torch.cuda.synchronize()
        assert max_ulp(layer_input, ref.rms_norm(ref.collapse(residual, pre), weight, EPS)) <= 1
        assert_exact_form(layer_input, out)


def test_a_quantized_layer_input_on_the_kernels_needs_h_a_multiple_of_1024() -> None:
    residual, pre, weight = inputs(2, 1536, seed=1)
    with pytest.raises(ValueError, match="multiple of 1024"):
        mhc.collapse_norm(residual, pre, weight, EPS, quantized_out=poisoned(2, 1536, "mxfp8"))
