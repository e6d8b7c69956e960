"""The fused boundary kernel on a GPU-less box: every variant compiles, the call path and host checks hold."""

from __future__ import annotations

import ctypes
from dataclasses import replace

import pytest
import torch

from cute_kernels import boundary_kernel as bk

ARCHS = ("sm_90a", "sm_100a")
MAIN = bk.BoundaryVariant("x", shared=False, pre=True, mxfp8=True, aux=False)
# Each variant compiles once per arch, the hidden sizes taking turns; the main variant at every H.
VARIANT_H = (5120, 4096, 256)
MAIN_H = (256, 2560, 4096, 5120, 7168)


@pytest.fixture(autouse=True)
def _no_disk_cache(monkeypatch) -> None:
    monkeypatch.setenv("MHC_BOUNDARY_DISK_CACHE", "0")


def _compile(H: int, variant: bk.BoundaryVariant, arch: str, config: bk.BoundaryConfig | None = None):
    fn = bk.compiled_boundary(H, variant, arch=arch, config=config)
    assert callable(fn)
    return fn


@pytest.mark.parametrize(
    ("H", "expected"),
    [(256, (1, 32)), (1024, (2, 64)), (2560, (5, 64)), (4096, (4, 128)), (5120, (5, 128)), (6144, (6, 128)),
     (7168, (7, 128)), (8192, (8, 128))],
)  # fmt: skip
def test_default_config_depends_on_h_only(H: int, expected: tuple[int, int]) -> None:
    config = bk.default_config(H)
    assert (config.cluster_n, config.threads) == expected
    config.validate(H)
    assert H // config.cluster_n % 128 == 0  # whole MXFP8 scale words per CTA


def test_other_configs() -> None:
    assert bk.BoundaryConfig.single_cta(7168) == bk.BoundaryConfig(1, 448)  # 2 vectors per thread
    assert bk.BoundaryConfig.single_cta(4096) == bk.BoundaryConfig(1, 512)
    assert bk.BoundaryConfig(1, 448).vecs_per_thread(7168) == 2
    assert bk.BoundaryConfig.for_cluster(7168, 7) == bk.BoundaryConfig(7, 128)
    assert bk.BoundaryConfig.for_cluster(5120, 5) == bk.BoundaryConfig(5, 128)
    assert bk.BoundaryConfig(5, 96).vecs_per_thread(5120) == 2  # an idle tail on the second vector
    with pytest.raises(ValueError, match="cluster_n"):
        bk.BoundaryConfig.for_cluster(2560, 8)  # 320 columns: a scale word would straddle two CTAs


@pytest.mark.parametrize(
    ("H", "cluster_n", "threads", "match"),
    [
        (5120, 3, 128, "cluster_n"),
        (5120, 16, 32, "cluster_n"),
        (5120, 5, 160, "threads"),  # a whole idle warp
        (5120, 8, 128, "threads"),
        (5120, 5, 48, "threads"),
        (2560, 8, 64, "cluster_n"),
        (4096, 8, 2048, "threads"),
        (1000, 1, 32, "multiple of 256"),
    ],
)
def test_config_validation(H: int, cluster_n: int, threads: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        bk.BoundaryConfig(cluster_n, threads).validate(H)


@pytest.mark.parametrize(
    ("knobs", "match"),
    [
        (dict(max_clusters=-1), "max_clusters"),
        (dict(max_clusters=True), "max_clusters"),
        (dict(prefetch=1), "prefetch needs looping"),
        (dict(max_clusters=8, prefetch=3, scale_pad="early"), "prefetch must be one of"),
        (dict(cache_hints="some"), "cache_hints"),
        (dict(scale_pad="late"), "scale_pad must be one of"),
        (dict(max_clusters=8), 'scale_pad="tail"'),
        (dict(min_ctas_per_sm=17), "min_ctas_per_sm"),
    ],
)
def test_schedule_validation(knobs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        replace(bk.BoundaryConfig.baseline(7168), **knobs).validate(7168)


def test_default_schedule() -> None:
    for H in (256, 2560, 4096, 5120, 7168):
        config, base = bk.default_config(H), bk.BoundaryConfig.baseline(H)
        assert (config.cluster_n, config.threads) == (base.cluster_n, base.threads)  # the reduction order
        assert config.looping and config.prefetch == 1 and config.scale_pad == "early"
        assert config.min_ctas_per_sm * config.threads * bk.REGISTER_BUDGET <= 65536
        # Every cluster fits at once on an H100/H200 at the launch bounds.
        assert config.max_clusters * config.cluster_n <= bk.SMS * config.min_ctas_per_sm
        assert base == bk.BoundaryConfig(base.cluster_n, base.threads)
    config = bk.default_config(7168)
    cap = config.max_clusters
    assert cap == 84  # 90 % of the 7-CTA clusters that fit at 5 CTAs per SM on 132 SMs
    assert [config.clusters(t) for t in (0, 1, 16, cap, cap + 1, 512)] == [0, 1, 16, cap, 43, 74]
    for rows in range(1, 1200):  # balanced: every cluster takes ceil(rows / clusters) rows or one fewer
        n = config.clusters(rows)
        assert n <= config.max_clusters and -(-rows // n) == -(-rows // config.max_clusters)


def test_kernel_rejects_bad_flags() -> None:
    with pytest.raises(ValueError, match="y_source"):
        bk.FusedBoundaryKernel(5120, y_source="peers")
    with pytest.raises(ValueError, match="MXFP8"):
        bk.FusedBoundaryKernel(5120, pre=False, mxfp8=True)


def test_engine_variants_and_warmup_keys() -> None:
    assert len(set(bk.ENGINE_VARIANTS)) == len(bk.ENGINE_VARIANTS) == 24
    assert all(v.pre or not v.mxfp8 for v in bk.ENGINE_VARIANTS)
    jobs = bk.warmup_keys(5120, arch="sm_90a")
    assert len(jobs) == 24 and len({j.name for j in jobs}) == 24
    assert jobs[0].compile_fn is bk.compile_fused_boundary
    config = bk.default_config(5120)
    assert (config.cluster_n, config.threads) == (5, 128)
    assert all(j.args[0] == 5120 and j.args[-1] == config and dict(j.kwargs) == {"arch": "sm_90a"} for j in jobs)
    with pytest.raises(ValueError, match="arch"):
        bk.warmup_keys(5120, arch="sm_80")


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("index", range(len(bk.ENGINE_VARIANTS)))
def test_every_variant_compiles(index: int, arch: str) -> None:
    _compile(VARIANT_H[index % len(VARIANT_H)], bk.ENGINE_VARIANTS[index], arch)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("H", MAIN_H)
def test_main_variant_compiles_at_every_h(H: int, arch: str) -> None:
    if H in VARIANT_H and bk.ENGINE_VARIANTS.index(MAIN) % len(VARIANT_H) == VARIANT_H.index(H):
        pytest.skip("compiled by test_every_variant_compiles")
    _compile(H, MAIN, arch)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize(
    ("H", "config"),
    [(7168, bk.BoundaryConfig(1, 448)), (5120, bk.BoundaryConfig(5, 96)), (7168, bk.BoundaryConfig(7, 128)),
     (7168, bk.BoundaryConfig(1, 448, max_clusters=9, prefetch=2, scale_pad="early")),
     (2560, bk.BoundaryConfig(5, 64, cache_hints="all", scale_pad="early")),
     (4096, bk.BoundaryConfig(8, 64, max_clusters=3, scale_pad="early", min_ctas_per_sm=16))],
)  # fmt: skip
def test_other_configs_compile(H: int, config: bk.BoundaryConfig, arch: str) -> None:
    _compile(H, bk.BoundaryVariant("moe", True, True, True, True), arch, config)
    if config.looping:
        _compile(H, bk.BoundaryVariant("x", False, False, False, False), arch, config)  # residual-only


# ---------------------------------------------------------------------------------------------
# The call convention, end to end on a GPU-less box: the exported object is loaded and called with
# the very argument tuple fused_boundary builds, on fake CUDA tensors (DLPack descriptors with a
# CUDA device and a bogus address). TVM-FFI checks every argument (None-ness, dtype, shape, the
# shared row count) before it launches, so reaching the CUDA runtime error proves the call is right.


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _DLManagedTensor(ctypes.Structure):
    pass


_DELETER = ctypes.CFUNCTYPE(None, ctypes.POINTER(_DLManagedTensor))
_DLManagedTensor._fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _DELETER)]
_NO_DELETE = _DELETER(lambda _: None)
# DLPack type codes: kDLInt 0, kDLUInt 1, kDLFloat 2, kDLBfloat 4, kDLFloat8_e4m3fn 10.
_DL_DTYPES = {
    torch.bfloat16: (4, 16),
    torch.float32: (2, 32),
    torch.int32: (0, 32),
    torch.uint8: (1, 8),
    torch.float8_e4m3fn: (10, 8),
}
_KEEP_ALIVE: list = []


def _fake_cuda(shape: tuple[int, ...], dtype: torch.dtype):
    """A TVM-FFI tensor that claims to live on cuda:0 at an address nothing ever reads."""
    import tvm_ffi

    n = len(shape)
    strides = [1] * n
    for i in range(n - 2, -1, -1):
        strides[i] = strides[i + 1] * shape[i + 1]
    c_shape, c_strides = (ctypes.c_int64 * n)(*shape), (ctypes.c_int64 * n)(*strides)
    managed = _DLManagedTensor()
    code, bits = _DL_DTYPES[dtype]
    managed.dl_tensor = _DLTensor(0x7F0000000000, _DLDevice(2, 0), n, _DLDataType(code, bits, 1), c_shape, c_strides, 0)
    managed.deleter = _NO_DELETE
    _KEEP_ALIVE.extend([c_shape, c_strides, managed])
    new_capsule = ctypes.pythonapi.PyCapsule_New
    new_capsule.restype, new_capsule.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    capsule = new_capsule(ctypes.addressof(managed), b"dltensor", None)

    class _Holder:
        def __dlpack__(self, **_: object):
            return capsule

        def __dlpack_device__(self):
            return (2, 0)

    return tvm_ffi.from_dlpack(_Holder())


def _fake_args(variant: bk.BoundaryVariant, T: int, H: int, top_k: int = 6, P: int = 11) -> tuple:
    bf16, f32 = torch.bfloat16, torch.float32
    moe = None
    if variant.y_source == "moe":
        moe = (_fake_cuda((P, H), bf16), _fake_cuda((T, top_k), f32), _fake_cuda((T, top_k), torch.int32))
    return bk.kernel_args(
        residual=_fake_cuda((T, 4, H), bf16),
        post=_fake_cuda((T, 4), f32),
        comb=_fake_cuda((T, 4, 4), f32),
        pre=_fake_cuda((T, 4), f32) if variant.pre else None,
        norm_weight=_fake_cuda((H,), bf16) if variant.pre else None,
        norm_eps=1e-6,
        x=_fake_cuda((T, H), bf16) if moe is None else None,
        shared=_fake_cuda((T, H), bf16) if variant.shared else None,
        moe=moe,
        new_residual=_fake_cuda((T, 4, H), bf16),
        out=_fake_cuda((T, H), bf16) if variant.pre else None,
        mxfp8_data=_fake_cuda((T, H), torch.float8_e4m3fn) if variant.mxfp8 else None,
        mxfp8_scale=_fake_cuda((bk.mxfp8_scale_bytes(T, H),), torch.uint8) if variant.mxfp8 else None,
        aux=_fake_cuda((T, H), bf16) if variant.aux else None,
    )


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="fake CUDA tensors must never reach a real GPU")
@pytest.mark.parametrize(
    "variant",
    [MAIN, bk.BoundaryVariant("moe", True, True, True, True), bk.BoundaryVariant("x", True, False, False, True)],
    ids=bk.variant_name,
)
def test_exported_kernel_accepts_the_call_tuple(variant: bk.BoundaryVariant, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("MHC_BOUNDARY_DISK_CACHE", "1")
    monkeypatch.setenv("MHC_BOUNDARY_CACHE_DIR", str(tmp_path))
    bk.compile_fused_boundary.cache_clear()
    H, T = 256, 3
    fn = bk.compiled_boundary(H, variant, arch="sm_90a")  # exported, then loaded back (positional only)
    assert list(tmp_path.rglob("*.o"))
    with pytest.raises(RuntimeError, match="(?i)cuda"):
        fn(*_fake_args(variant, T, H))
    # A wrong argument stops in TVM-FFI's checks instead, before any launch.
    args = list(_fake_args(variant, T, H))
    args[1] = _fake_cuda((T + 1, 4), torch.float32)  # post with another row count
    with pytest.raises(ValueError, match=r"Mismatched mPost\.shape\[0\] on argument #1"):
        fn(*args)
    args = list(_fake_args(variant, T, H))
    args[6] = None if variant.shared else _fake_cuda((T, H), torch.bfloat16)
    with pytest.raises(TypeError, match="Mismatched type on argument #6"):
        fn(*args)
    bk.compile_fused_boundary.cache_clear()


# ---------------------------------------------------------------------------------------------
# Host checks: every one raises before anything compiles or launches (CPU tensors suffice).


def _inputs(T: int = 3, H: int = 256, **overrides: object) -> dict:
    bf16 = torch.bfloat16
    kwargs = dict(
        residual=torch.zeros(T, 4, H, dtype=bf16),
        post=torch.zeros(T, 4),
        comb=torch.zeros(T, 4, 4),
        pre=torch.zeros(T, 4),
        norm_weight=torch.zeros(H, dtype=bf16),
        norm_eps=1e-6,
        x=torch.zeros(T, H, dtype=bf16),
        new_residual=torch.zeros(T, 4, H, dtype=bf16),
        out=torch.zeros(T, H, dtype=bf16),
        mxfp8_data=torch.zeros(T, H, dtype=torch.float8_e4m3fn),
        mxfp8_scale=torch.zeros(bk.mxfp8_scale_bytes(T, H), dtype=torch.uint8),
        aux=torch.zeros(T, H, dtype=bf16),
        arch="sm_90a",
    )
    kwargs.update(overrides)
    return kwargs


def _raises(exc: type[Exception], match: str, **overrides: object) -> None:
    with pytest.raises(exc, match=match):
        bk.fused_boundary(**_inputs(**overrides))


def test_valid_cpu_inputs_stop_at_the_device_check() -> None:
    _raises(ValueError, "CUDA tensors")
    _raises(ValueError, "CUDA tensors", post=torch.zeros(3, 4, 1))  # a trailing 1 is accepted
    moe = (torch.zeros(7, 256, dtype=torch.bfloat16), torch.zeros(3, 6), torch.zeros(3, 6, dtype=torch.int32))
    _raises(ValueError, "CUDA tensors", x=None, moe=moe, shared=torch.zeros(3, 256, dtype=torch.bfloat16))
    _raises(ValueError, "CUDA tensors", pre=None, norm_weight=None, out=None, mxfp8_data=None, mxfp8_scale=None)


def test_host_checks_name_the_argument() -> None:
    bf16 = torch.bfloat16
    _raises(TypeError, "residual must have dtype torch.bfloat16", residual=torch.zeros(3, 4, 256))
    _raises(ValueError, r"residual must have shape \[T, 4, H\]", residual=torch.zeros(3, 2, 256, dtype=bf16))
    _raises(ValueError, "multiple of 256", residual=torch.zeros(3, 4, 320, dtype=bf16))
    _raises(ValueError, r"post must have shape \[3, 4\]", post=torch.zeros(3, 5))
    _raises(ValueError, r"post must have shape \[3, 4, 1\]", post=torch.zeros(3, 4, 2))
    _raises(TypeError, "comb must have dtype torch.float32", comb=torch.zeros(3, 4, 4, dtype=torch.float64))
    _raises(ValueError, "exactly one input", x=None)
    moe = (torch.zeros(7, 256, dtype=bf16), torch.zeros(3, 6), torch.zeros(3, 6, dtype=torch.int32))
    _raises(ValueError, "exactly one input", moe=moe)
    _raises(TypeError, "moe must be a tuple", x=None, moe=moe[:2])
    _raises(
        ValueError, r"moe idx must have shape \[3, 6\]", x=None, moe=(*moe[:2], torch.zeros(3, 5, dtype=torch.int32))
    )
    _raises(
        TypeError, "moe idx must have dtype torch.int32", x=None, moe=(*moe[:2], torch.zeros(3, 6, dtype=torch.int64))
    )
    _raises(ValueError, "x must be contiguous", x=torch.zeros(256, 3, dtype=bf16).t())
    _raises(ValueError, "x must start on a 16-byte boundary", x=torch.zeros(3 * 256 + 1, dtype=bf16)[1:].view(3, 256))
    _raises(ValueError, "shared must have shape", shared=torch.zeros(2, 256, dtype=bf16))
    _raises(ValueError, "new_residual must have shape", new_residual=torch.zeros(3, 4, 512, dtype=bf16))
    _raises(TypeError, "norm_eps must be a float", norm_eps="1e-6")
    _raises(ValueError, "norm_weight must have shape", norm_weight=torch.zeros(128, dtype=bf16))
    _raises(ValueError, "out .* is required", out=None)
    _raises(ValueError, "both mxfp8_data and mxfp8_scale", mxfp8_scale=None)
    _raises(ValueError, r"mxfp8_scale must have shape \[1024\]", mxfp8_scale=torch.zeros(3 * 8, dtype=torch.uint8))
    _raises(TypeError, "mxfp8_data must have dtype", mxfp8_data=torch.zeros(3, 256, dtype=torch.uint8))
    _raises(ValueError, "residual-only", pre=None)
    _raises(ValueError, "aux must have shape", aux=torch.zeros(3, 255, dtype=bf16))
    _raises(ValueError, "arch must be one of", arch="sm_80")
    _raises(ValueError, "cluster_n", config=bk.BoundaryConfig(3, 32))
    _raises(TypeError, "config must be a BoundaryConfig", config=(1, 32))
