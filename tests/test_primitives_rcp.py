"""rcp_newton on the CPU: its PTX run by a float32 emulator, accuracy and special values."""

from __future__ import annotations

import numpy as np
import pytest

from cute_kernels.primitives import RCP_NEWTON_PTX

F32_MIN = np.float32(2.0**-126)
# Measured, exhaustively over the binade [1, 2): 0.7070 ulp, relative 2^-23.734.
MAX_ULP = 0.7071
MAX_REL = 2.0**-23.73


def _ftz(x: np.ndarray) -> np.ndarray:
    """Subnormals to a zero of the same sign, as an .ftz instruction reads and writes them."""
    x = x.astype(np.float32)
    return np.where(np.abs(x) < F32_MIN, np.copysign(np.float32(0.0), x), x).astype(np.float32)


def _fma_ftz(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """fma.rn.ftz.f32: a * b + c rounded once to float32."""
    with np.errstate(all="ignore"):  # NaN guesses may be signalling ones
        a, b, c = (_ftz(v).astype(np.float64) for v in (a, b, c))
        p = a * b  # exact: 48 significant bits
        t = p + c
        tc = t - c
        err = (p - tc) + (c - (t - tc))  # t + err == p + c exactly (TwoSum)
        r = t.astype(np.float32)
        # Rounding t to float32 is the one rounding of p + c unless t landed exactly halfway between
        # two floats: then the sign of err says which neighbour the exact sum is nearer to.
        back = r.astype(np.float64)
        toward = np.where(t > back, np.float32(np.inf), np.float32(-np.inf))
        other = np.nextafter(r, toward)
        halfway = np.isfinite(back) & (t != back) & (2 * t == back + other.astype(np.float64))
        r = np.where(halfway & (err != 0) & (np.sign(err) == np.sign(t - back)), other, r)
    return _ftz(r)


def run_ptx(asm: str, x: np.ndarray) -> np.ndarray:
    """The value of `asm` ($0 from $1) on float32 inputs, for the few PTX instructions it may use."""
    regs = {"$1": np.asarray(x, np.float32).view(np.uint32)}

    def val(tok: str) -> np.ndarray:
        if tok.startswith("0f"):
            return np.full(regs["$1"].shape, int(tok[2:], 16), np.uint32)
        if tok[0].isdigit():
            return np.full(regs["$1"].shape, int(tok, 0), np.uint32)
        return regs[tok]

    def f32(bits: np.ndarray) -> np.ndarray:
        return bits.view(np.float32)

    for line in asm.replace("{", "").replace("}", "").split(";"):
        line = line.strip()
        if not line or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        dst, *src = (a.strip() for a in args.split(","))
        s = [val(a) for a in src]
        if op == "mov.b32":
            out = s[0].copy()
        elif op == "sub.s32":
            out = s[0] - s[1]  # uint32 arithmetic wraps, as sub.s32 does
        elif op == "neg.f32":
            out = s[0] ^ np.uint32(0x80000000)
        elif op == "fma.rn.ftz.f32":
            out = _fma_ftz(f32(s[0]), f32(s[1]), f32(s[2])).view(np.uint32)
        else:
            raise NotImplementedError(op)
        regs[dst] = out
    return f32(regs["$0"])


def rcp_newton(x: np.ndarray) -> np.ndarray:
    """rcp_newton of float32 inputs, as the GPU computes it."""
    return run_ptx(RCP_NEWTON_PTX, np.asarray(x, np.float32))


def errors(x: np.ndarray) -> tuple[float, float]:
    """Max relative error and max error in ulps of the result, against 1/x in float64."""
    y = rcp_newton(x).astype(np.float64)
    exact = 1.0 / x.astype(np.float64)
    rel = np.abs(y - exact) / np.abs(exact)
    ulp = np.abs(y - exact) / np.spacing(np.abs(exact).astype(np.float32)).astype(np.float64)
    return float(rel.max()), float(ulp.max())


def binade(lo: float) -> np.ndarray:
    """Every float32 in [lo, 2 * lo), lo a power of two."""
    first = int(np.float32(lo).view(np.uint32))
    return np.arange(first, first + 2**23, dtype=np.uint32).view(np.float32)


def test_fma_emulation_rounds_once() -> None:
    # a * b = -(2^-24 + 2^-70) exactly ((2^23 + 2^12 + 1)(2^23 - 2^12 + 1) = 2^46 + 1), so a * b + c is
    # 2^-70 below the midpoint of 1 + 2^-23 and 1 + 2^-22: rounded once it is the lower one; rounded in
    # float64 first it would be the midpoint, which ties to the (even) upper one.
    a = np.float32([(2**23 + 2**12 + 1) * 2.0**-23])
    b = np.float32([-(2**23 - 2**12 + 1) * 2.0**-47])
    c = np.float32([1 + 2.0**-22])
    assert _fma_ftz(a, b, c)[0] == np.float32(1 + 2.0**-23)
    assert _fma_ftz(np.float32([1e-39]), np.float32([1.0]), np.float32([0.0]))[0] == 0


@pytest.mark.slow
def test_one_binade_exhaustively() -> None:
    rel, ulp = errors(binade(1.0))
    assert rel <= MAX_REL and ulp <= MAX_ULP, (rel, ulp)


def test_error_does_not_depend_on_the_exponent() -> None:
    x = binade(1.0)[::997]
    base = rcp_newton(x)
    for k in (-126, -100, -20, -1, 1, 20, 100, 124):
        scaled = rcp_newton(x * np.float32(2.0**k))
        assert np.array_equal(scaled, base * np.float32(2.0**-k)), k
    for lo in (2.0**-126, 2.0**124, 2.0**125):
        rel, ulp = errors(binade(lo)[::7])
        assert rel <= MAX_REL and ulp <= MAX_ULP, (lo, rel, ulp)


def test_sinkhorn_range() -> None:
    rng = np.random.default_rng(0)
    x = np.exp(rng.uniform(np.log(1e-6), np.log(1e6), 1_000_000)).astype(np.float32)
    x = np.concatenate([x, np.float32([1e-6, 1.0 + 1e-6, 1.0, 2.0, 4.0 + 1e-6, 1e6])])
    rel, ulp = errors(x)
    assert rel <= MAX_REL and ulp <= MAX_ULP, (rel, ulp)


def test_negative_inputs_mirror_positive_ones() -> None:
    x = binade(1.0)[::101]
    assert np.array_equal(rcp_newton(-x), -rcp_newton(x))


@pytest.mark.parametrize(
    "x", [np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-45, 2.0**-126 * (1 - 2.0**-23), 2.0**127 * 1.5, 3.4e38]
)
def test_special_values_give_nan(x: float) -> None:
    assert np.isnan(rcp_newton(np.float32([x]))[0])


def test_reciprocals_below_the_smallest_normal_flush_to_zero() -> None:
    assert rcp_newton(np.float32([2.0**126]))[0] == np.float32(2.0**-126)
    x = np.concatenate([binade(2.0**126)[1::7], np.float32([2.0**127, 2.0**127 * (1 + 2.0**-23)])])
    assert np.all(rcp_newton(x) == 0)
    assert np.all(np.isnan(rcp_newton(binade(2.0**127)[2::7])))
