"""What the kernels' launch shapes need to know about the GPU, read from the device, never hard-coded.

On a machine without the GPU (CPU compiles, CI) the numbers come from $MHC_BOUNDARY_SM_COUNT when set,
else from the arch's flagship part (sm_90a: H100 SXM / H200, 132 SMs; sm_100a: B200, 148 SMs), so that
a compile on the CPU builds the very kernel the GPU would.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

# Per-SM limits that are the same on sm_90a and sm_100a (CUDA programming guide, compute capability 9.0 / 10.0).
MAX_THREADS_PER_SM = 2048
MAX_CTAS_PER_SM = 32
REGISTERS_PER_SM = 65536
SHARED_BYTES_PER_SM = 228 * 1024
SHARED_BYTES_RESERVED_PER_CTA = 1024  # the driver's share of each CTA's shared memory
MAX_CLUSTER = 8  # the portable thread-block cluster size
MAX_GRID_Y = 65535  # a launch grid's y extent
FLAGSHIP_SMS = {"sm_90a": 132, "sm_100a": 148}
SM_COUNT_ENV = "MHC_BOUNDARY_SM_COUNT"


@dataclass(frozen=True)
class Hardware:
    """The numbers of one GPU that size a launch: its SM count and its compile target."""

    arch: str
    sm_count: int


@functools.cache
def _device_sm_count(index: int) -> int:
    import torch

    return torch.cuda.get_device_properties(index).multi_processor_count


def env_int(name: str, minimum: int) -> int | None:
    """Environment variable `name` as an int of at least `minimum`; None where it is unset or empty."""
    raw = os.environ.get(name)
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name} must be an int >= {minimum}, got {raw!r}") from None
    if value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {raw!r}")
    return value


def for_arch(arch: str) -> Hardware:
    """The hardware a kernel for `arch` is sized for: the current GPU if it is of that arch, else the override or
    the flagship."""
    count = env_int(SM_COUNT_ENV, 1)
    if count is not None:
        return Hardware(arch, count)
    import torch

    if torch.cuda.is_available():
        from cute_kernels.compile import arch_for_device

        index = torch.cuda.current_device()
        try:
            if arch_for_device(index) == arch:
                return Hardware(arch, _device_sm_count(index))
        except Exception:  # a GPU the kernels do not run on: size for the named arch's flagship
            pass
    if arch not in FLAGSHIP_SMS:
        raise ValueError(f"no SM count known for arch {arch!r}; set {SM_COUNT_ENV}")
    return Hardware(arch, FLAGSHIP_SMS[arch])


DEFAULT_DEVICE_CONNECTIONS = 8  # the driver's default of CUDA_DEVICE_MAX_CONNECTIONS
MAX_DEVICE_CONNECTIONS = 32  # the most the driver takes


def device_connections() -> int:
    """The hardware work queues CUDA maps a context's streams onto ($CUDA_DEVICE_MAX_CONNECTIONS, read when CUDA
    initialises; the driver's default where unset). Streams beyond it share queues, in launch order."""
    return env_int("CUDA_DEVICE_MAX_CONNECTIONS", 1) or DEFAULT_DEVICE_CONNECTIONS
