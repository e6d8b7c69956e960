"""What a Python custom op's dispatch costs on this host (#45): a no-op op of `boundary_ready`'s schema, registered
under each dispatch key in turn, against the plain function, median us per call, plain and under
torch.inference_mode() (CPU tensors: the dispatch alone, no kernel).

    python -m bench.experiments.op_dispatch [--rounds 15] [--calls 3000]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from torch import Tensor

from boundary.ops import boundary_ready

KEYS = ("CompositeExplicitAutograd", "CompositeImplicitAutograd", "CPU", "Autograd+CPU")


def ready_like(handle: int, x: Tensor, residual: Tensor, *rest: object) -> tuple[Tensor, Tensor]:
    """boundary_ready's arguments, doing nothing."""
    return residual, x


def register(key: str) -> Callable[..., object]:
    """The no-op as mhc_dispatch_<key>::f, implemented under `key` ("A+B": both)."""
    name = "mhc_dispatch_" + key.replace("+", "_")
    lib = torch.library.Library(name, "DEF")
    lib.define("f" + torch.library.infer_schema(boundary_ready, mutates_args=()))  # its very schema
    for k in key.split("+"):
        lib.impl("f", ready_like, k)
    register.libs.append(lib)  # a Library unregisters its ops when it goes
    return getattr(torch.ops, name).f


register.libs = []


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--calls", type=int, default=3000)
    args = ap.parse_args(argv)
    x, residual = torch.randn(1, 4096).bfloat16(), torch.randn(1, 4, 4096).bfloat16()
    mix, comb, w = torch.rand(1, 4), torch.rand(1, 4, 4), torch.rand(4096).bfloat16()
    operands = (1, x, residual, mix, comb, mix, w, 1e-6)
    calls = {"function": ready_like, **{key: register(key) for key in KEYS}}
    for mode in ("plain", "inference_mode"):
        samples: dict[str, list[float]] = {name: [] for name in calls}
        for _ in range(args.rounds):
            for name, fn in calls.items():
                with torch.inference_mode(mode == "inference_mode"):
                    t0 = time.perf_counter_ns()
                    for _ in range(args.calls):
                        fn(*operands)
                    samples[name].append((time.perf_counter_ns() - t0) / args.calls / 1000)
        print(mode + ": " + ", ".join(f"{n} {statistics.median(v):.2f} us" for n, v in samples.items()))


if __name__ == "__main__":
    main()
