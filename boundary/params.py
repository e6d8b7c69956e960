"""MHCParams: the mHC parameters of one sublayer (CONTRACT §3), the one object the checks, the reference, the direct
path and the custom ops' schema share."""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor


# A NamedTuple, not a frozen dataclass: an engine builds one per boundary (~100 per step), and a frozen dataclass's
# __init__ costs about 1 us more per call.
class MHCParams(NamedTuple):
    """fn [24, hc*H] (or fn_broadcast [24, H]), scale [3], base [24] fp32, the eps values, post multiplier, repeats."""

    fn: Tensor
    scale: Tensor
    base: Tensor
    rms_eps: float
    pre_eps: float
    sinkhorn_eps: float
    post_mult: float
    sinkhorn_repeat: int
