"""Does a bf16 m16n8k16 MMA's fp32 result depend on the order of k inside the instruction?

`python -m bench.experiments.mma_order_probe` runs many random 16x16 @ 16x8 (+ C) tiles through
mma.sync twice: once with k in natural order and once with the same k permuted (columns of A and rows
of B together, so the exact result is the same), and counts the outputs whose bits differ. The
projection's k layout inside one MMA may be changed without changing its bits only if the count
is 0 for every permutation tried (docs/perf-log.md, v10).
"""

from __future__ import annotations

import argparse

import cutlass
import cutlass.cute as cute
import numpy as np
import torch
from cutlass import Float32, Int32

from cute_kernels.compile import arch_for_device, compile_kernel, fake_stream, fake_tensor
from cute_kernels.ptx import mma_bf16 as _mma_bf16


class MmaProbe:
    """D = A @ B + C for one m16n8k16 tile per warp, fragments read as prepared by the host."""

    @cute.jit
    def __call__(self, mA: cute.Tensor, mB: cute.Tensor, mC: cute.Tensor, mD: cute.Tensor, stream) -> None:
        self.kernel(mA, mB, mC, mD).launch(grid=[mA.shape[0], 1, 1], block=[32, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mA: cute.Tensor, mB: cute.Tensor, mC: cute.Tensor, mD: cute.Tensor) -> None:
        lane, _, _ = cute.arch.thread_idx()
        tile, _, _ = cute.arch.block_idx()
        a = tuple(Int32(mA[tile, lane, i]) for i in range(4))
        b = tuple(Int32(mB[tile, lane, i]) for i in range(2))
        c = tuple(Float32(mC[tile, lane, i]) for i in range(4))
        d = _mma_bf16(a, b, c)
        for i in cutlass.range_constexpr(4):
            mD[tile, lane, i] = d[i]


def _bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even fp32 -> bf16 bit patterns (uint16)."""
    u = x.astype(np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def fragments(A: np.ndarray, B: np.ndarray, C: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-lane mma.sync m16n8k16 fragments of A [n,16,16], B [n,16,8] (bf16 bits) and C [n,16,8] fp32."""
    n = A.shape[0]
    a = np.zeros((n, 32, 4), np.uint32)
    b = np.zeros((n, 32, 2), np.uint32)
    c = np.zeros((n, 32, 4), np.float32)
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for i, (row, k) in enumerate(((g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8))):
            a[:, lane, i] = A[:, row, k].astype(np.uint32) | (A[:, row, k + 1].astype(np.uint32) << 16)
        for i, k in enumerate((2 * t, 2 * t + 8)):
            b[:, lane, i] = B[:, k, g].astype(np.uint32) | (B[:, k + 1, g].astype(np.uint32) << 16)
        for i, (row, col) in enumerate(((g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t), (g + 8, 2 * t + 1))):
            c[:, lane, i] = C[:, row, col]
    return a, b, c


def random_values(rng: np.random.Generator, shape: tuple, spread: int) -> np.ndarray:
    """Random signs and mantissas with exponents spread over 2^-spread .. 2^spread."""
    return rng.choice([-1.0, 1.0], shape) * rng.uniform(1, 2, shape) * 2.0 ** rng.integers(-spread, spread + 1, shape)


def permutations(rng: np.random.Generator, random_perms: int) -> dict[str, np.ndarray]:
    """Four structured k permutations and `random_perms` random ones."""
    perms = {
        "reverse": np.arange(16)[::-1].copy(),
        "swap halves": np.r_[8:16, 0:8],
        "pairs kept, pairs permuted": np.concatenate([[2 * p, 2 * p + 1] for p in (3, 0, 6, 1, 5, 2, 7, 4)]),
        "within pairs swapped": np.concatenate([[2 * p + 1, 2 * p] for p in range(8)]),
    }
    for i in range(random_perms):
        perms[f"random {i}"] = rng.permutation(16)
    return perms


def differing_outputs(
    tiles: int, random_perms: int, spreads: tuple[int, ...], report: bool = False
) -> dict[tuple[int, str], int]:
    """(spread, permutation) -> how many of the tiles * 512 outputs change bits when k is permuted."""
    dev = torch.device("cuda")
    arch = arch_for_device(dev)
    compiled = compile_kernel(
        MmaProbe(), fake_tensor(Int32, (cute.sym_int(), 32, 4), divisibility=4),
        fake_tensor(Int32, (cute.sym_int(), 32, 2), divisibility=2),
        fake_tensor(Float32, (cute.sym_int(), 32, 4), divisibility=4),
        fake_tensor(Float32, (cute.sym_int(), 32, 4), divisibility=4), fake_stream(), arch=arch,
    )  # fmt: skip
    rng = np.random.default_rng(0)
    perms = permutations(rng, random_perms)

    def run(A: np.ndarray, B: np.ndarray, C: np.ndarray) -> np.ndarray:
        a, b, c = fragments(A, B, C)
        tc = torch.from_numpy(c).to(dev)
        td = torch.empty_like(tc)
        compiled(torch.from_numpy(a.view(np.int32)).to(dev), torch.from_numpy(b.view(np.int32)).to(dev), tc, td)
        torch.cuda.synchronize()
        return td.cpu().numpy()

    counts = {}
    for spread in spreads:
        A = _bf16_bits(random_values(rng, (tiles, 16, 16), spread))
        B = _bf16_bits(random_values(rng, (tiles, 16, 8), spread))
        C = random_values(rng, (tiles, 16, 8), spread).astype(np.float32)
        base = run(A, B, C)
        for name, p in perms.items():
            other = run(A[:, :, p], B[:, p, :], C)
            counts[(spread, name)] = int((base.view(np.uint32) != other.view(np.uint32)).sum())
            if report:
                print(f"spread 2^+-{spread:2d}  {name:28s} outputs differing: {counts[(spread, name)]} of {base.size}")
    return counts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiles", type=int, default=20000)
    parser.add_argument("--perms", type=int, default=8, help="random k permutations besides the structured ones")
    args = parser.parse_args()
    counts = differing_outputs(args.tiles, args.perms, (0, 4, 12, 30), report=True)
    print(f"{sum(counts.values())} outputs differing in all; {len(counts)} (spread, permutation) pairs")
    return 0 if not any(counts.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
