"""The vLLM module's own call sequence (SPEC §5 as the module spells it) runs unchanged and gives the plain step's bits.

An engine that imports this package in place of `specialized_decode/boundary` calls it exactly like this: positional
`first(layer, x, step)`, `sublayer(layer, ffn, state, step, quantize=<bool>, capture_aux=<bool>)`, a `BoundaryState`
built by keyword, `empty_quantized_layer_input(num_tokens, hidden_size, device)` passed positionally to the
`BoundaryAllReduce` call, and the model's final collapse after `post_only`.
"""

from __future__ import annotations

import pytest
import torch

from boundary import (
    Boundaries,
    BoundaryAllReduce,
    BoundaryState,
    DecodeStep,
    QuantizedActivation,
    empty_quantized_layer_input,
)
from boundary import reference as ref
from boundary.toy import StepOutput, ToyConfig, ToyModel, decode_step, decode_step_plain, random_tokens
from tests.bf16 import bitwise_equal

CONFIG = ToyConfig(hidden_size=512, num_layers=3, vocab=64)  # an Engram seam at layer 1, as the real models have


def module_step(
    model: ToyModel,
    boundaries: Boundaries,
    all_reduce: BoundaryAllReduce,
    tokens: torch.Tensor,
    overlap_max_rows: int | None = None,
):
    """One decode step spelled as the module spells it; returns what an engine would keep of it."""
    hidden_size = all_reduce.hidden_size
    step = DecodeStep.for_rows(tokens.shape[0], overlap_max_rows)
    layers = model.layers
    state, x = boundaries.first(layers[0], model.embed[tokens], step)
    last = len(layers) - 1
    kept = {}
    for i, layer in enumerate(layers):
        if i > 0 and layer.engram:
            streams = boundaries.post_only(state)
            streams = model.engram_inject(layer, streams, tokens)
            # The mixes the engine carries across the seam, in a state of its own making.
            carried = BoundaryState(residual=streams, post=state.post, comb=state.comb, pre=state.pre, pending=None)
            state, x = boundaries.pre(layer, streams, carried, step)
        elif i > 0:
            state, x, q, aux = boundaries.sublayer(layer, False, state, step, quantize=False, capture_aux=False)
            assert q is None and aux is None
        state.pending = model.attention(layer, x)
        boundaries.join(layer, step)
        before = BoundaryState(
            residual=state.residual, post=state.post, comb=state.comb, pre=state.pre, pending=state.pending
        )
        state, x, q, aux = boundaries.sublayer(layer, True, state, step, quantize=i == last, capture_aux=i == last)
        if i == last:
            assert isinstance(q, QuantizedActivation) and aux is not None
            # The module's BoundaryAllReduce call on the same inputs, its MXFP8 buffer from empty_quantized_layer_input.
            buffer = empty_quantized_layer_input(tokens.shape[0], hidden_size, all_reduce.device)
            norm = layer.ffn_norm
            residual, out = all_reduce(
                before.pending, before.residual, before.post, before.comb, before.pre, norm.weight,
                norm.variance_epsilon, buffer,
            )  # fmt: skip
            kept.update(moe_input=q, aux=aux, direct=(residual, out, buffer), sublayer=(state.residual, x))
        else:
            assert q is None and aux is None
        state.pending = model.moe(layer, x)
        boundaries.join(layer, step)
    # SPEC §4c's one launch, `final(state, norm)`, on a copy of the state built by keyword; and the layer loop's own
    # ending: post_only, then the model's final norm of the collapse with state.pre.
    copy = BoundaryState(
        residual=state.residual, post=state.post, comb=state.comb, pre=state.pre, pending=state.pending
    )
    kept["final"] = boundaries.final(copy, model.final_norm)
    streams = boundaries.post_only(state)
    kept["hidden"] = ref.final_collapse(streams, state.pre, model.final_norm.weight, model.final_norm.variance_epsilon)
    return kept


def assert_same_mxfp8(a: QuantizedActivation, b: QuantizedActivation) -> None:
    assert torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8))
    assert torch.equal(a.scale, b.scale)


def assert_same_step(kept: dict, want: StepOutput) -> None:
    """The module's step (module_step's) holds `want`'s bits: the final hidden state, aux and the last MXFP8 input,
    and its direct BoundaryAllReduce call gives the sublayer's bits."""
    assert bitwise_equal(kept["final"], want.hidden)
    assert bitwise_equal(kept["aux"], want.aux)
    assert_same_mxfp8(kept["moe_input"], want.moe_input_mxfp8)
    residual, out, buffer = kept["direct"]
    assert bitwise_equal(residual, kept["sublayer"][0]) and bitwise_equal(out, kept["sublayer"][1])
    assert_same_mxfp8(buffer, want.moe_input_mxfp8)


@pytest.mark.parametrize("rows", [1, 3])
def test_the_modules_call_sequence_gives_the_plain_steps_bits(rows: int) -> None:
    model = ToyModel(CONFIG)
    all_reduce = BoundaryAllReduce(CONFIG.hidden_size, group=None, max_rows=8, hc_mult=4, device="cpu")
    boundaries = Boundaries(all_reduce)
    for index in range(2):
        tokens = random_tokens(model, rows, index)
        kept = module_step(model, boundaries, all_reduce, tokens)
        plain = decode_step_plain(model, tokens)
        assert bitwise_equal(kept["hidden"], plain.hidden)  # the layer loop's own ending: post_only, then the norm
        assert_same_step(kept, plain)


@pytest.mark.gpu
@pytest.mark.parametrize("rows, overlap_max_rows", [(1, None), (16, 16)])
def test_the_modules_call_sequence_on_the_kernels_gives_the_schedulers_bits(rows: int, overlap_max_rows: int) -> None:
    """On the GPU the module's spelling launches the same kernels as the toy's own driver: the same bits (the default
    step, inline; and with the side streams)."""
    model = ToyModel(CONFIG, device="cuda")
    all_reduce = BoundaryAllReduce(CONFIG.hidden_size, max_rows=16, device="cuda")
    boundaries = Boundaries(all_reduce)
    tokens = random_tokens(model, rows, 0)
    kept = module_step(model, boundaries, all_reduce, tokens, overlap_max_rows)
    ours = decode_step(model, boundaries, tokens, DecodeStep.for_rows(rows, overlap_max_rows))
    torch.cuda.synchronize()
    assert_same_step(kept, ours)
