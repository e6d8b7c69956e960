"""The CuTe DSL kernels of the mHC decode boundary and their compile cache."""
