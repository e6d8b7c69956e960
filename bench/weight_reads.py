"""Weight-read stand-ins for a DeepSeek-V3-sized layer in the decode step (#30): each sublayer first reads the bytes of
the weights its layer activates for the step's rows at FP8 (a byte a parameter), then returns the boundaries-only
model's fixed output. A decode step at few rows is bound by these reads, so this stands in for a real layer's cost at
the GPU's pace. It leaves out the KV-cache reads and the GEMMs' arithmetic, so the boundaries' share of such a step is
an upper bound. Sizes from DeepSeek-V3's config (hidden 7168): MLA with q_lora_rank 1536, kv_lora_rank 512, 128 heads
of 128 + 64 (rope) query / key dims and 128 value dims; 256 routed experts of intermediate size 2048, 8 per token, and
one shared expert. TP 1: one GPU reads every weight.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch

from boundary.toy import ToyModel

HIDDEN = 7168
O_PROJ_PARAMS = 128 * 128 * HIDDEN  # an attention sublayer's last GEMM
ATTENTION_PARAMS = (
    HIDDEN * 1536  # q_a_proj
    + 1536 * 128 * (128 + 64)  # q_b_proj
    + HIDDEN * (512 + 64)  # kv_a_proj_with_mqa
    + 512 * 128 * (128 + 128)  # kv_b_proj
    + O_PROJ_PARAMS
)
O_PROJ_SHARE = O_PROJ_PARAMS / ATTENTION_PARAMS
EXPERT_PARAMS = 3 * HIDDEN * 2048  # gate, up and down projections
ROUTED_EXPERTS, TOP_K, SHARED_EXPERTS = 256, 8, 1
SCALED_HIDDEN = 5120  # V4.1-Flash's H: V3's layer with its byte counts scaled by H / HIDDEN (no model's real sizes)


def read_scale(hidden: int) -> float | None:
    """The factor on V3's byte counts at `hidden`: 1 at V3's own H, H / HIDDEN at SCALED_HIDDEN, None elsewhere."""
    if hidden == HIDDEN:
        return 1.0
    return hidden / HIDDEN if hidden == SCALED_HIDDEN else None


def routed_experts_read(rows: int) -> float:
    """Expected distinct routed experts among `rows` tokens' top-8 of 256 (routing uniform and independent)."""
    return ROUTED_EXPERTS * (1 - (1 - TOP_K / ROUTED_EXPERTS) ** rows)


def layer_bytes(rows: int) -> tuple[int, int]:
    """(attention, MoE) weight bytes one layer reads for `rows` tokens at FP8."""
    return ATTENTION_PARAMS, round((routed_experts_read(rows) + SHARED_EXPERTS) * EXPERT_PARAMS)


class WeightReads:
    """One device buffer as large as the largest read up to `max_rows` rows, read by every stand-in (far larger than
    L2, so each read streams from HBM)."""

    def __init__(self, device: torch.device, max_rows: int) -> None:
        self.words = torch.zeros(max(layer_bytes(max_rows)) // 4, dtype=torch.float32, device=device)

    def model(
        self,
        free: ToyModel,
        rows: int,
        before_last: Callable[[Any], object] | None = None,
        scale: float = 1.0,
    ) -> ToyModel:
        """A copy of a boundaries-only model whose attention and MoE first read their layer's weight bytes (times
        `scale`, at most 1), in two kernels as a real sublayer ends in a GEMM of its own: attention's last reads
        o_proj, MoE's last the down projections' third. `before_last(layer)`, where given, runs between the two (where
        an engine may join)."""
        if not 0 < scale <= 1:
            raise ValueError(f"scale must be in (0, 1] (the buffer holds V3's reads), got {scale}")
        attention_words, moe_words = (round(n * scale) // 4 for n in layer_bytes(rows))
        attention_split = attention_words - round(attention_words * O_PROJ_SHARE)
        moe_split = moe_words - moe_words // 3
        words = self.words
        reading = copy.copy(free)

        def read(layer: Any, split: int, end: int) -> None:
            torch.amax(words[:split])
            if before_last is not None:
                before_last(layer)
            torch.amax(words[split:end])

        def attention(layer: Any, x: torch.Tensor) -> Any:
            read(layer, attention_split, attention_words)
            return free.attention(layer, x)

        def moe(layer: Any, x: torch.Tensor) -> Any:
            read(layer, moe_split, moe_words)
            return free.moe(layer, x)

        reading.attention = attention  # type: ignore[method-assign]
        reading.moe = moe  # type: ignore[method-assign]
        return reading
