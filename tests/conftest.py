"""Test setup: the repository on sys.path, GPU tests skipped without CUDA, small shared helpers."""

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

import pytest  # noqa: E402
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
# Spawned workers (multi-rank tests) import the package from the working tree too.
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
