"""The CuTe DSL kernels of the mHC decode boundary and their compile cache."""

HC = 4  # residual streams per token (mHC hc_mult) of the models these kernels serve
