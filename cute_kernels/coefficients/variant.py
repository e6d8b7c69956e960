"""The coefficients family's variant space, named once: what a launch projects and which layer input it writes.

The compiles and their cache keys, the warmup jobs, the calls, the tuning tables' forms and the bench's columns all
take this one type; the kernel classes get its `projection` and `layer_input` strings as their compile-time
configuration.
"""

from __future__ import annotations

from typing import NamedTuple

from cute_kernels.coefficients.layer_input import UNNORMED

COLLAPSES = ("none", "carried", "one_hot", "own")


class CoefficientsVariant(NamedTuple):
    """One compile-time variant of the coefficients kernels.

    `broadcast`: the projection reads the first layer's embedding [T, H] with fn_broadcast, else the streams
    [T, 4, H]. `collapse`: the layer input written in the same launch (the inline form): "none", "carried" (the
    carried pre-mix collapse), "one_hot" (stream 0, or the embedding row itself) or "own" (DeepSeek-V4: the streams
    collapsed with the pre the launch computes, by the CTAs that finish the rows). `normed`: that layer input is
    RMSNorm'd (False: the collapse itself, with no norm weight); True when there is none. `quant`: "own" only, the
    layer input's quantized form beside bf16 (None, or one of QUANT_FORMS).
    """

    broadcast: bool = False
    collapse: str = "none"
    normed: bool = True
    quant: str | None = None

    @classmethod
    def of(cls, broadcast: bool, inline: bool, carried: bool = False, normed: bool = True) -> CoefficientsVariant:
        """The variant of a call: with a layer input (`inline`), from a carried pre-mix, with a norm weight. The
        first layer's collapse is its embedding row (one-hot) whatever it is given."""
        if not inline:
            return cls(broadcast)
        return cls(broadcast, "carried" if carried and not broadcast else "one_hot", normed)

    @classmethod
    def own(cls, quant: str | None = None) -> CoefficientsVariant:
        """DeepSeek-V4's variant: the streams' mixes and the layer input collapsed with their own pre, normed, with
        the quantized form `quant` beside bf16."""
        return cls(False, "own", True, quant)

    @property
    def inline(self) -> bool:
        """Whether the launch writes a layer input."""
        return self.collapse != "none"

    @property
    def projection(self) -> str:
        """The kernels' `variant` argument: "standard" (the streams) or "broadcast" (the embedding)."""
        return "broadcast" if self.broadcast else "standard"

    @property
    def layer_input(self) -> str:
        """The kernels' `layer_input` argument: "none", "carried", "one_hot" ("_unnormed" appended without norm) or
        "own"."""
        return self.collapse + ("" if self.normed or not self.inline else UNNORMED)

    @property
    def form(self) -> str:
        """The tuning tables' key: "standard", "broadcast", "inline", "first inline" (broadcast and inline) or "own"."""
        if self.collapse == "own":
            return "own"
        if self.inline:
            return "first inline" if self.broadcast else "inline"
        return self.projection

    @property
    def name(self) -> str:
        """How warmup jobs and messages name it."""
        return f"{self.projection} layer_input={self.layer_input}" + (f" {self.quant}" if self.quant else "")


def _every() -> tuple[CoefficientsVariant, ...]:
    out = []
    for broadcast in (False, True):
        collapses = ("one_hot",) if broadcast else ("carried", "one_hot")
        out.append(CoefficientsVariant(broadcast))
        out += [CoefficientsVariant(broadcast, c, normed) for normed in (True, False) for c in collapses]
    return tuple(out)


VARIANTS = _every()
"""Every variant of the V4.1 scheme: the streams with no layer input, the carried or one-hot collapse, normed or not;
the embedding with no layer input or its one-hot row, normed or not (DeepSeek-V4's own-pre variants: `own`)."""

OWN_VARIANTS = tuple(CoefficientsVariant.own(q) for q in (None, "mxfp8", "fp8_1x128", "fp8_1x128_ue8m0"))
"""DeepSeek-V4's own-pre variants: bf16 alone and with each quantized form."""

FORM_VARIANTS = {
    "standard": CoefficientsVariant(),
    "broadcast": CoefficientsVariant(True),
    "inline": CoefficientsVariant(False, "carried"),
    "first inline": CoefficientsVariant(True, "one_hot"),
    "own": CoefficientsVariant.own(),
}
"""The variant the bench and the tools time for each tuning form (normed; inline: the carried collapse)."""
