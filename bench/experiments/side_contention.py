"""What the side-stream coefficients cost the sublayer they overlap (#46, step 4): contention, measured.

In a CUDA graph of REPEATS repeats, each repeat is (A) a sublayer stand-in alone: the weight bytes a DeepSeek-V3
attention layer reads at FP8 (`bench.weight_reads`, one read over the whole layer, each repeat its own slice of a
buffer far larger than L2), (B) the coefficients kernel alone (`mhc.mixes`: the projection of fn over the streams,
RMS, Sinkhorn; H 7168), or (C) both: the coefficients forked onto a side stream beside the sublayer, joined after it,
as the scheduler overlaps them. Per repeat, us: A, B, C; `C - A` is what the overlap adds to the sublayer's critical
path (contention for HBM and SMs, and the fork and join); `A + B - C` is what overlapping saves against running the
coefficients inline after the sublayer; `fork only - A` is the fork and join alone (the side stream with no kernel).

    python -m bench.experiments.side_contention [--rows 1 4 16 64 128] [--hidden 7168]
"""

from __future__ import annotations

import argparse

import torch

from bench import weight_reads
from bench.timing import GraphTimer
from boundary import mhc
from boundary.params import MHCParams

REPEATS = 8


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64, 128])
    ap.add_argument("--hidden", type=int, default=weight_reads.HIDDEN)
    args = ap.parse_args(argv)
    device = torch.device("cuda")
    timer = GraphTimer(device, replays=15)
    H = args.hidden
    attention_words = weight_reads.layer_bytes(1)[0] // 4
    words = torch.zeros(REPEATS * attention_words, dtype=torch.float32, device=device)
    g = torch.Generator(device=device).manual_seed(0)
    params = MHCParams(
        torch.randn(24, 4 * H, generator=g, device=device) * 1e-2,
        torch.full((3,), 0.5, device=device),
        torch.randn(24, generator=g, device=device) * 0.5,
        1e-6,
        1e-6,
        1e-6,
        2.0,
        20,
    )
    side = torch.cuda.Stream(device)
    print(f"side-stream contention: {torch.cuda.get_device_name()}, H {H}, {attention_words * 4 / 1e6:.1f} MB read")
    print(" rows |  sublayer (A) | coefficients (B) | overlapped (C) | fork only-A |  C - A | A + B - C")
    for rows in args.rows:
        residual = (torch.randn(rows, 4, H, generator=g, device=device) * 0.5).bfloat16()
        mhc.mixes(residual, params)  # compiled and loaded before any capture

        def sublayer(i: int) -> None:
            torch.amax(words[i * attention_words : (i + 1) * attention_words])

        def alone() -> None:
            for i in range(REPEATS):
                sublayer(i)

        def coefficients(residual: torch.Tensor = residual) -> None:
            for _ in range(REPEATS):
                mhc.mixes(residual, params)

        def overlapped(residual: torch.Tensor = residual) -> None:
            main = torch.cuda.current_stream()
            for i in range(REPEATS):
                side.wait_stream(main)
                with torch.cuda.stream(side):
                    mhc.mixes(residual, params)
                sublayer(i)
                main.wait_stream(side)

        def forked() -> None:
            main = torch.cuda.current_stream()
            for i in range(REPEATS):
                side.wait_stream(main)
                sublayer(i)
                main.wait_stream(side)

        a, b, c, d = (timer.per_call_us([f], REPEATS) for f in (alone, coefficients, overlapped, forked))
        print(f"{rows:5d} | {a:13.2f} | {b:16.2f} | {c:14.2f} | {d - a:11.2f} | {c - a:6.2f} | {a + b - c:9.2f}")


if __name__ == "__main__":
    main()
