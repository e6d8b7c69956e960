"""The fused mHC decode boundary for DeepSeek-V4.1-style models (and V4's own-pre scheme): the public names of
CONTRACT §5."""

from boundary.all_reduce import BoundaryAllReduce, BoundaryPath
from boundary.mhc import mhc_post, mhc_pre_delayed, mhc_pre_delayed_overlap
from boundary.params import MHCParams
from boundary.reference import mxfp8_scale_bytes
from boundary.scheduler import MHC_OVERLAP_MAX_ROWS, Boundaries, BoundaryState, DecodeStep
from boundary.types import (
    Fp8GroupActivation,
    MoEOutput,
    QuantizedActivation,
    UnfinalizedMoEOutput,
    empty_fp8_group_layer_input,
    empty_quantized_layer_input,
)
from boundary.v4 import V4Boundaries, V4Head

__all__ = [
    "MHC_OVERLAP_MAX_ROWS",
    "BoundaryAllReduce",
    "BoundaryPath",
    "Boundaries",
    "BoundaryState",
    "DecodeStep",
    "Fp8GroupActivation",
    "MHCParams",
    "MoEOutput",
    "QuantizedActivation",
    "UnfinalizedMoEOutput",
    "V4Boundaries",
    "V4Head",
    "empty_fp8_group_layer_input",
    "empty_quantized_layer_input",
    "mhc_post",
    "mhc_pre_delayed",
    "mhc_pre_delayed_overlap",
    "mxfp8_scale_bytes",
]
