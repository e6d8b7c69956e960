"""`make bench`: the boundary benchmarks, with their baselines measured in the same run."""

import os

# Simulated ranks share one CUDA context: every kernel must be loaded before a boundary spins (CONTRACT §7). Set
# before anything (cutlass's import included) initialises CUDA; an explicit $CUDA_MODULE_LOADING wins.
os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")
# ... and its streams must not share hardware queues (a rank's kernel behind a peer's spinning boundary): the most.
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")
