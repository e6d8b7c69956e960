"""The one choice between the CuTe DSL kernels and the torch reference, made per device and backend name."""

from __future__ import annotations

import functools

import torch

from cute_kernels.compile import arch_for_device

BACKENDS = ("auto", "kernel", "reference")


@functools.cache
def _device_arch(device: torch.device) -> str:
    return arch_for_device(device)


def kernel_arch(device: torch.device, backend: str) -> str | None:
    """The compile target the kernels take on `device` under `backend` (the mHC ops' and BoundaryAllReduce's one
    choice), or None for the torch reference."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "reference" or (backend == "auto" and device.type != "cuda"):
        return None
    if device.type != "cuda":
        raise ValueError(f"backend='kernel' needs a CUDA device, got {device}")
    return _device_arch(device)  # raises, naming the GPU, where the kernels do not run
