"""`python -m bench`: the main job. On an sm_90a/sm_100a GPU it benchmarks the fused kernels; elsewhere it
runs the toy decode demo on the CPU and says why."""

from __future__ import annotations

import sys

import torch


def gpu_arch() -> str | None:
    """The compile target of the GPU in hand, or None (with the reason printed) when there is none."""
    if not torch.cuda.is_available():
        print(
            "make bench: no CUDA GPU found. The fused CuTe DSL kernels need an sm_90a (H100/H200) or "
            "sm_100a (B200) GPU; running the toy decode demo on the CPU (reference path) instead."
        )
        return None
    from cute_kernels.compile import UnsupportedGPUError, arch_for_device

    try:
        return arch_for_device(torch.cuda.current_device())
    except UnsupportedGPUError as exc:
        print(f"make bench: {exc}\nRunning the toy decode demo on the reference path instead.")
        return None


def main(argv: list[str] | None = None) -> int:
    """Entry point: the command line is the GPU benchmark's, checked (and --help answered) before anything runs."""
    from bench import run

    argv = sys.argv[1:] if argv is None else argv
    run.parse_args(argv)
    arch = gpu_arch()
    if arch is None:
        from boundary import demo

        if argv:
            print(f"make bench: the options {' '.join(argv)} are the GPU benchmark's; the demo runs without them.")
        return demo.main(["--device", "cpu"])
    return run.main(argv, arch=arch)


if __name__ == "__main__":
    sys.exit(main())
