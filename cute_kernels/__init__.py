"""The CuTe DSL kernels of the mHC decode boundary and their compile cache."""

HC = 4  # residual streams per token (mHC hc_mult) of the models these kernels serve
VEC = 8  # bf16 elements per thread vector: one 16-byte access
MXFP8_BLOCK = 32  # elements sharing one E8M0 scale (CONTRACT §4)
SCALE_WORD_COLS = 4 * MXFP8_BLOCK  # columns of one 4-byte word of MXFP8 scales
