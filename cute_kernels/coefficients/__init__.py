"""The mHC coefficients kernels (CONTRACT §3): projection + Sinkhorn in one or two launches, and the layer input."""

from cute_kernels.coefficients.api import (
    MAX_ROWS,
    CoefficientsWorkspace,
    compile_coefficients,
    compile_layer_input,
    grid_clusters,
    mhc_coefficients,
    mhc_layer_input,
    warmup_jobs,
)
from cute_kernels.coefficients.config import CoefficientsConfig, projection_split, projection_width
from cute_kernels.coefficients.projection import SENTINEL
from cute_kernels.coefficients.tuning import coefficients_config
from cute_kernels.coefficients.variant import FORM_VARIANTS, VARIANTS, CoefficientsVariant

__all__ = [
    "FORM_VARIANTS",
    "MAX_ROWS",
    "VARIANTS",
    "SENTINEL",
    "CoefficientsConfig",
    "CoefficientsVariant",
    "CoefficientsWorkspace",
    "compile_coefficients",
    "compile_layer_input",
    "coefficients_config",
    "grid_clusters",
    "mhc_coefficients",
    "mhc_layer_input",
    "projection_split",
    "projection_width",
    "warmup_jobs",
]
