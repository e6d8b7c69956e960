"""`make bench`: the boundary benchmarks, with their baselines measured in the same run."""

from cute_kernels.compile import eager_module_loading

# Simulated ranks share one CUDA context: every kernel must be loaded before a boundary spins (CONTRACT §7).
eager_module_loading()
