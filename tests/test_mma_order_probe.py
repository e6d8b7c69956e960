"""bench.experiments.mma_order_probe: its kernel compiles for both targets, its fragments follow the mma.sync layout."""

from __future__ import annotations

import cutlass.cute as cute
import numpy as np
import pytest
from cutlass import Float32, Int32

from bench.experiments.mma_order_probe import MmaProbe, _bf16_bits, fragments, permutations, random_values
from cute_kernels.compile import compile_kernel, fake_stream, fake_tensor

ARCHS = ("sm_90a", "sm_100a")


def _bf16_values(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def mma_from_fragments(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """D [n, 16, 8] rebuilt from per-lane m16n8k16 fragments by the PTX ISA's layout (fp64 sums)."""
    n = a.shape[0]
    A = np.zeros((n, 16, 16))
    B = np.zeros((n, 16, 8))
    C = np.zeros((n, 16, 8))
    lo = lambda w: _bf16_values((w & 0xFFFF).astype(np.uint16))  # noqa: E731
    hi = lambda w: _bf16_values((w >> 16).astype(np.uint16))  # noqa: E731
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for i, (row, k) in enumerate(((g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8))):
            A[:, row, k], A[:, row, k + 1] = lo(a[:, lane, i]), hi(a[:, lane, i])
        for i, k in enumerate((2 * t, 2 * t + 8)):
            B[:, k, g], B[:, k + 1, g] = lo(b[:, lane, i]), hi(b[:, lane, i])
        for i, (row, col) in enumerate(((g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t), (g + 8, 2 * t + 1))):
            C[:, row, col] = c[:, lane, i]
    return A @ B + C


def test_fragments_follow_the_mma_layout() -> None:
    rng = np.random.default_rng(3)
    A = _bf16_bits(random_values(rng, (4, 16, 16), 4))
    B = _bf16_bits(random_values(rng, (4, 16, 8), 4))
    C = random_values(rng, (4, 16, 8), 4).astype(np.float32)
    want = _bf16_values(A).astype(np.float64) @ _bf16_values(B).astype(np.float64) + C
    np.testing.assert_array_equal(mma_from_fragments(*fragments(A, B, C)), want)


def test_permutations_are_permutations_of_k() -> None:
    perms = permutations(np.random.default_rng(0), 3)
    assert len(perms) == 7
    assert all(sorted(p.tolist()) == list(range(16)) for p in perms.values())
    assert any(p.tolist() != list(range(16)) for p in perms.values())


@pytest.mark.parametrize("arch", ARCHS)
def test_probe_kernel_compiles(arch: str) -> None:
    i32 = fake_tensor(Int32, (cute.sym_int(), 32, 4), divisibility=4)
    f32 = fake_tensor(Float32, (cute.sym_int(), 32, 4), divisibility=4)
    b32 = fake_tensor(Int32, (cute.sym_int(), 32, 2), divisibility=2)
    assert callable(compile_kernel(MmaProbe(), i32, b32, f32, f32, fake_stream(), arch=arch))
