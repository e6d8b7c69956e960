"""Test setup: the repository on sys.path, GPU tests skipped without CUDA, small shared helpers.

The kernels the tests compile go to the package's disk cache ($MHC_BOUNDARY_CACHE_DIR, else the per-user folder), whose
entries are keyed by a fingerprint of the kernel sources and the DSL's version: each variant compiles once however many
tests and xdist workers use it, and a later run of the same sources only loads it. The cache tests use folders of
their own."""

from __future__ import annotations

import os
import sys
from pathlib import Path

# Simulated ranks share one CUDA context: every kernel (torch's and cuBLAS's too) must load before a boundary spins,
# so CUDA loads modules eagerly here (CONTRACT §7). Set before anything initialises CUDA; $CUDA_MODULE_LOADING wins.
os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")
# ... and maps their streams onto this many hardware queues: with fewer queues than streams, a rank's kernel can queue
# behind a peer's spinning boundary (CONTRACT §7). 32 is the driver's most; $CUDA_DEVICE_MAX_CONNECTIONS wins.
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")
# Under pytest-xdist each worker takes one core: torch's CPU ops, Inductor's compile pool and the processes a test
# spawns stay on one thread each, so that the workers do not spin on each other's cores (OpenMP threads busy-wait).
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
# Spawned workers (multi-rank tests) import the package from the working tree too.
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        # Under xdist (--dist loadgroup) the GPU tests all run on one worker, one after another: simulated ranks spin
        # on the GPU and must not share it with another test's kernels.
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(pytest.mark.xdist_group("gpu"))
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
