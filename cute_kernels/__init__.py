"""The CuTe DSL kernels of the mHC decode boundary and their compile cache."""

HC = 4  # residual streams per token (mHC hc_mult) of the models these kernels serve
VEC = 8  # bf16 elements per thread vector: one 16-byte access
MXFP8_BLOCK = 32  # elements sharing one E8M0 scale (CONTRACT §4)
SCALE_WORD_COLS = 4 * MXFP8_BLOCK  # columns of one 4-byte word of MXFP8 scales
FP8_GROUP = 128  # columns sharing one fp32 scale in the FP8 1x128 form (CONTRACT §4b)
E4M3_MAX = 448.0  # the largest finite e4m3 value


def mxfp8_scale_bytes(num_tokens: int, hidden_size: int) -> int:
    """Bytes of the swizzled 128x4 E8M0 scale buffer of a [num_tokens, hidden_size] MXFP8 tensor (CONTRACT §4): rows
    padded to 128, H/32 scale columns (rounded up) padded to 4."""
    cols = -(-hidden_size // MXFP8_BLOCK)
    return -(-num_tokens // 128) * 128 * (-(-cols // 4) * 4)
