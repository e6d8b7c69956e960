"""The fused boundary kernel on a GPU-less box: the shipped launch shapes, every variant compiles, the call path."""

from __future__ import annotations

import ast
import ctypes
import inspect

import pytest
import torch

from boundary import checks
from cute_kernels import hardware, mxfp8_scale_bytes
from cute_kernels.allreduce.protocol import GENERATIONS
from cute_kernels.boundary import api
from cute_kernels.boundary import kernel as kernel_module
from cute_kernels.boundary.args import concrete_dims
from cute_kernels.boundary.config import BoundaryConfig, default_config, row_split
from cute_kernels.boundary.kernel import FusedBoundaryKernel
from tests.bf16 import exported
from tests.compile_cover import covering

ARCHS = ("sm_90a", "sm_100a")
MAIN = api.BoundaryVariant("x", shared=False, pre=True, mxfp8=True, aux=False)
# Each variant compiles for sm_90a, the hidden sizes taking turns; for sm_100a the variants that together set every
# flag to each of its values (tests/compile_cover.py says why that covers it). The main variant at every H on both.
VARIANT_H = (5120, 4096, 256)
MAIN_H = (256, 2560, 4096, 5120, 7168)
SM100A_VARIANTS = covering(api.ENGINE_VARIANTS, lambda v: enumerate(v))
VARIANT_CASES = [(i, "sm_90a") for i in range(len(api.ENGINE_VARIANTS))]
VARIANT_CASES += [(api.ENGINE_VARIANTS.index(v), "sm_100a") for v in SM100A_VARIANTS]


@pytest.fixture(autouse=True)
def _shipped_sm_count(monkeypatch) -> None:
    monkeypatch.delenv(hardware.SM_COUNT_ENV, raising=False)


def _compile(H: int, variant: api.BoundaryVariant, arch: str):
    fn = api.compiled_boundary(H, variant, arch=arch)
    assert exported(fn), type(fn)
    return fn


@pytest.mark.parametrize(
    ("H", "expected"),
    [
        (256, (1, 32)),
        (1024, (2, 64)),
        (2560, (5, 64)),
        (4096, (4, 128)),
        (5120, (5, 128)),
        (6144, (6, 128)),
        (7168, (7, 128)),
        (8192, (8, 128)),
        (16384, (8, 256)),
    ],
)
def test_row_split_depends_on_h_only(H: int, expected: tuple[int, int]) -> None:
    assert row_split(H) == expected
    config = default_config(H, "sm_90a")
    assert (config.cluster_n, config.threads) == expected
    assert H // config.cluster_n % 128 == 0  # whole MXFP8 scale words per CTA
    assert config.vecs_per_thread(H) * config.threads * 8 >= H // config.cluster_n


def test_default_schedule_is_sized_from_the_sm_count(monkeypatch) -> None:
    for H in (256, 2560, 4096, 5120, 7168):
        config = default_config(H, "sm_90a")
        assert config.min_ctas_per_sm * config.threads * 96 <= hardware.REGISTERS_PER_SM
        # Every cluster fits at once on a 132-SM H100/H200 at the launch bounds.
        assert config.max_clusters * config.cluster_n <= 132 * config.min_ctas_per_sm
    config = default_config(7168, "sm_90a")
    cap = config.max_clusters
    assert cap == 84  # 90 % of the 7-CTA clusters that fit at 5 CTAs per SM on 132 SMs
    assert [config.clusters(t) for t in (0, 1, 16, cap, cap + 1, 512)] == [0, 1, 16, cap, 43, 74]
    for rows in range(1, 1200):  # balanced: every cluster takes ceil(rows / clusters) rows or one fewer
        n = config.clusters(rows)
        assert n <= config.max_clusters and -(-rows // n) == -(-rows // config.max_clusters)
    assert default_config(7168, "sm_100a").max_clusters == int(0.9 * (148 * 5 // 7))  # a B200's 148 SMs
    # Ranks sharing one GPU: one CTA per SM among them all (a late rank's own kernels need room beside the spinners).
    assert default_config(7168, "sm_90a", ranks_per_device=4).max_clusters == int(0.9 * (132 // 7)) // 4
    for H in (2560, 4096, 5120, 7168):
        for world in (2, 4, 8):
            shared = default_config(H, "sm_90a", ranks_per_device=world, world_size=world)
            assert world * shared.max_clusters * shared.cluster_n <= 132, (H, world)
    monkeypatch.setenv(hardware.SM_COUNT_ENV, "114")  # an H100 PCIe, compiled on a CPU box
    default_config.cache_clear()
    try:
        assert default_config(7168, "sm_90a").max_clusters == int(0.9 * (114 * 5 // 7))
        monkeypatch.setenv(hardware.SM_COUNT_ENV, "many")
        with pytest.raises(ValueError, match=hardware.SM_COUNT_ENV):
            hardware.for_arch("sm_90a")
    finally:
        default_config.cache_clear()


def test_the_one_rank_own_pre_boundary_holds_its_weights_in_registers() -> None:
    # One vector a thread: the own pre's 128 fn values a thread stay in registers, at 255 registers a thread.
    for H in (2560, 4096, 5120, 7168):
        config = default_config(H, "sm_90a", own_pre=True)
        assert config.fn_in_registers, H
        assert config.min_ctas_per_sm == hardware.REGISTERS_PER_SM // (255 * config.threads) >= 1, H
        plain = default_config(H, "sm_90a")
        assert (config.cluster_n, config.threads) == (plain.cluster_n, plain.threads)  # the same rows per CTA
        assert not plain.fn_in_registers
        # With peers the exchange's registers come first: fn from L2 (the peer kernels' one launch shape).
        assert default_config(H, "sm_90a", 2, 2, own_pre=True) == default_config(H, "sm_90a", 2, 2)
    assert default_config(7168, "sm_90a", own_pre=True).min_ctas_per_sm == 2  # 256 threads a CTA
    with pytest.raises(ValueError, match="needs own_pre=True"):
        FusedBoundaryKernel(4096, default_config(4096, "sm_90a", own_pre=True), world_size=1)
    own = api.BoundaryVariant("x", pre=True, own_pre=True)
    (job,) = api.warmup_jobs(4096, arch="sm_90a", variants=[own])
    assert [a for a in job.args if isinstance(a, BoundaryConfig)] == [default_config(4096, "sm_90a", own_pre=True)]


def test_engine_variants_and_warmup_jobs() -> None:
    # 2 y sources x shared x aux x {residual-only, pre with bf16 only, + MXFP8, + FP8 1x128, + FP8 1x128 UE8M0}.
    assert len(set(api.ENGINE_VARIANTS)) == len(api.ENGINE_VARIANTS) == 40
    assert all(v.pre or not (v.mxfp8 or v.fp8) for v in api.ENGINE_VARIANTS)
    assert {v.fp8 for v in api.ENGINE_VARIANTS} == {None, *api.FP8_FORMS}
    assert not any(v.mxfp8 and v.fp8 for v in api.ENGINE_VARIANTS), "one layer-input form per sublayer call"
    # An engine that writes one form (its warmup(quantize=...)) needs that form's variants and the bf16 ones only.
    fp8_only = api.engine_variants(("fp8_1x128",))
    assert len(fp8_only) == 24 and set(fp8_only) < set(api.ENGINE_VARIANTS)
    assert {(v.mxfp8, v.fp8) for v in fp8_only} == {(False, None), (False, "fp8_1x128")}
    assert api.engine_variants(tuple(api.QUANTIZE_FORMS)) == api.ENGINE_VARIANTS
    bf16_only = api.engine_variants(())  # warmup(quantize=None) or ()
    assert len(bf16_only) == 16 and not any(v.mxfp8 or v.fp8 for v in bf16_only)
    jobs = api.warmup_jobs(5120, arch="sm_90a")
    assert len(jobs) == 40 and len({j.name for j in jobs}) == 40
    assert jobs[0].compile_fn is api.compile_fused_boundary
    config = default_config(5120, "sm_90a")
    assert isinstance(config, BoundaryConfig) and (config.cluster_n, config.threads) == (5, 128)
    fixed = dict(H=5120, own_pre=False, early_loads=False, config=config, world_size=1, protocol="oneshot")
    assert all(job_args(j).items() >= fixed.items() and dict(j.kwargs) == {"arch": "sm_90a"} for j in jobs)
    assert [api.BoundaryVariant(*(job_args(j)[f] for f in api.BoundaryVariant._fields)) for j in jobs] == list(
        api.ENGINE_VARIANTS
    )
    peer = [job_args(j) for j in api.warmup_jobs(5120, arch="sm_90a", world_size=4, ranks_per_device=4)]
    # Both protocols of every variant, each inline, and staged too for the 20 variants with a ready partial x.
    assert len(peer) == 40 * 2 + 20 * 2 and {a["protocol"] for a in peer} == {"oneshot", "twoshot"}
    assert {(a["y_source"], a["staged"]) for a in peer} == {("x", False), ("x", True), ("moe", False)}
    assert all(a["world_size"] == 4 and a["config"] == default_config(5120, "sm_90a", 4, 4) for a in peer)
    # A BoundaryAllReduce(early_loads=True) warms up the same variants with the flag set, nothing else changed.
    early = api.warmup_jobs(5120, arch="sm_90a", variants=api.early(api.ENGINE_VARIANTS, True))
    assert [job_args(j) for j in early] == [job_args(j) | {"early_loads": True} for j in jobs]
    assert all(j.name.endswith(" early-loads") for j in early)
    # A staged kernel waits first either way: its early variant is the default one, compiled once.
    variants = api.early(api.ENGINE_VARIANTS, True)
    early_peer = [job_args(j) for j in api.warmup_jobs(5120, arch="sm_90a", world_size=4, variants=variants)]
    assert {(a["staged"], a["early_loads"]) for a in early_peer} == {(False, True), (True, False)}
    assert len(early_peer) == 40 * 2 + 20 * 2


def job_args(job: object) -> dict:
    """A warmup job's compile arguments by parameter name, defaults filled in."""
    bound = inspect.signature(job.compile_fn).bind(*job.args, **dict(job.kwargs))
    bound.apply_defaults()
    return dict(bound.arguments)


def test_the_sm100a_variants_set_every_flag_to_each_of_its_values() -> None:
    for field in range(len(api.BoundaryVariant._fields)):
        assert {v[field] for v in SM100A_VARIANTS} == {v[field] for v in api.ENGINE_VARIANTS}
    assert len(SM100A_VARIANTS) < len(api.ENGINE_VARIANTS) // 4


@pytest.mark.slow
@pytest.mark.parametrize(("index", "arch"), VARIANT_CASES)
def test_every_variant_compiles(index: int, arch: str) -> None:
    _compile(VARIANT_H[index % len(VARIANT_H)], api.ENGINE_VARIANTS[index], arch)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("H", MAIN_H)
def test_main_variant_compiles_at_every_h(H: int, arch: str) -> None:
    if (api.ENGINE_VARIANTS.index(MAIN), arch) in VARIANT_CASES and H == VARIANT_H[
        api.ENGINE_VARIANTS.index(MAIN) % len(VARIANT_H)
    ]:
        pytest.skip("compiled by test_every_variant_compiles")
    _compile(H, MAIN, arch)


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
    torch.int64: (0, 64),
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


def _fake_args(variant: api.BoundaryVariant, T: int, H: int, top_k: int = 6, P: int = 11) -> api.BoundaryArgs:
    """The kernel's arguments by its own shape rule (BoundaryArgs.build), as fake CUDA tensors of a T-row call."""
    dims = concrete_dims(T, H, permuted_rows=P, top_k=top_k)
    return api.BoundaryArgs.build(
        H,
        variant,
        1,
        lambda name, dtype, shape: _fake_cuda(tuple(dims.get(d, d) for d in shape), api.TORCH_DTYPES[dtype]),
        1e-6,
    )


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="fake CUDA tensors must never reach a real GPU")
@pytest.mark.parametrize(
    "variant",
    [
        MAIN,
        api.BoundaryVariant("moe", True, True, True, True),
        api.BoundaryVariant("x", True, False, False, True),
        api.BoundaryVariant("x", False, True, True, False, "fp8_1x128_ue8m0"),
    ],
    ids=api.variant_name,
)
def test_exported_kernel_accepts_the_call_tuple(variant: api.BoundaryVariant, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("MHC_BOUNDARY_DISK_CACHE", "1")
    monkeypatch.setenv("MHC_BOUNDARY_CACHE_DIR", str(tmp_path))
    api.compile_fused_boundary.cache_clear()
    H, T = 256, 3
    fn = api.compiled_boundary(H, variant, arch="sm_90a")  # exported, then loaded back (positional only)
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
    api.compile_fused_boundary.cache_clear()


# The kernel's parameter for each field of the record, in the kernel's order.
KERNEL_PARAMETERS = {
    "residual": "mR",
    "post": "mPost",
    "comb": "mComb",
    "pre": "mPre",
    "norm_weight": "mW",
    "x": "mX",
    "shared": "mShared",
    "gemm2_permuted": "mG",
    "expert_weights": "mEW",
    "idx": "mIdx",
    "new_residual": "mNewR",
    "out": "mOut",
    "mxfp8_data": "mQ",
    "mxfp8_scale": "mScale",
    "fp8_data": "mQ8",
    "fp8_scale": "mScale8",
    "aux": "mAux",
    "slots": "mSlots",
    "peers": "mPeers",
    "state": "mState",
    "error": "mError",
    "mix_fn": "mMixFn",
    "mix_params": "mMixParams",
    "eps": "eps",
}


def test_the_argument_record_is_the_kernels_parameter_list() -> None:
    """The record's order is the host function's, which hands its parameters on to the device kernel in that order."""
    params = list(inspect.signature(FusedBoundaryKernel.__call__).parameters)
    assert params == ["self", *(KERNEL_PARAMETERS[f] for f in api.BoundaryArgs._fields), "stream"]
    assert list(inspect.signature(FusedBoundaryKernel.kernel).parameters) == params[:-1]
    module = ast.parse(inspect.getsource(kernel_module))
    (host,) = [
        f
        for c in module.body
        if isinstance(c, ast.ClassDef) and c.name == "FusedBoundaryKernel"
        for f in c.body
        if isinstance(f, ast.FunctionDef) and f.name == "__call__"
    ]
    (launch,) = [
        n
        for n in ast.walk(host)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "kernel"
    ]
    assert [a.id for a in launch.args] == params[1:-1]


@pytest.mark.parametrize("variant", api.ENGINE_VARIANTS, ids=api.variant_name)
@pytest.mark.parametrize("world_size", (1, 4))
def test_the_records_shape_rule_gives_each_variant_its_tensors_and_tells_the_variant_back(
    variant: api.BoundaryVariant, world_size: int
) -> None:
    T, H, P, k = 5, 512, 9, 3
    dims = concrete_dims(T, H, permuted_rows=P, top_k=k, slot_rows=16)
    made = api.BoundaryArgs.build(
        H, variant, world_size, lambda name, dtype, shape: (name, dtype, tuple(dims.get(d, d) for d in shape)), 0.5
    )
    given = {f: v for f, v in zip(made._fields, made) if v is not None and f != "eps"}
    assert all(v[0] == f for f, v in given.items()) and made.eps == 0.5
    assert given["residual"][2] == given["new_residual"][2] == (T, 4, H)
    assert ("x" in given) == (variant.y_source == "x") and ("gemm2_permuted" in given) == (variant.y_source == "moe")
    if variant.y_source == "moe":
        assert given["gemm2_permuted"][2] == (P, H) and given["idx"][1:] == ("i32", (T, k))
    if variant.mxfp8:
        assert given["mxfp8_scale"][1:] == ("u8", (mxfp8_scale_bytes(T, H),))
    if variant.fp8:
        assert given["fp8_scale"][1:] == ("f32", (H // 128, 8))  # T padded to 4
    assert ("slots" in given) == ("peers" in given) == ("state" in given) == (world_size > 1)
    assert ("error" in given) == (world_size > 1 or variant.y_source == "moe")
    if world_size > 1:
        assert given["slots"][2] == (GENERATIONS, world_size + 1, 16, H) and given["peers"][2] == (world_size,)
    assert made.variant(variant.fp8) == variant
    with pytest.raises(ValueError, match="fp8_form"):
        made.variant(None if variant.fp8 else "fp8_1x128")


# ---------------------------------------------------------------------------------------------
# The kernels trust their callers: the public edge (boundary.checks, used by BoundaryAllReduce and
# the mHC ops) holds every host-side check; tests/test_scheduler.py drives it through the public API.


def test_the_public_edge_checks_the_16_byte_alignment_the_kernel_relies_on() -> None:
    x = torch.zeros(3 * 256 + 1, dtype=torch.bfloat16)[1:].view(3, 256)
    with pytest.raises(ValueError, match="x must start on a 16-byte boundary"):
        checks.tensor("x", x, dtype=torch.bfloat16, shape=(3, 256), align=16)
    assert checks.tensor("x", x, dtype=torch.bfloat16, shape=(3, 256)) is x  # the torch path takes any address


def test_fused_boundary_passes_the_compiled_kernel_what_the_record_names(monkeypatch: pytest.MonkeyPatch) -> None:
    """fused_boundary spells the kernel's positional tuple out (its hot path, where building the record would cost
    host time); BoundaryArgs names it for every other caller: both give the same tuple, so a new kernel argument
    cannot leave one of them stale."""
    got = []
    asked = []
    monkeypatch.setattr(api, "compiled_boundary", lambda H, v, **k: asked.append(v) or (lambda *args: got.append(args)))
    residual, post = torch.zeros(2, 4, 256, dtype=torch.bfloat16), torch.zeros(2, 4)
    named = {name: object() for name in ("comb", "pre", "norm_weight", "shared", "new_residual", "out", "aux")}
    named |= {name: object() for name in ("mxfp8_data", "mxfp8_scale", "fp8_data", "fp8_scale", "error")}
    moe = (object(), object(), object())
    variant = api.BoundaryVariant("moe", True, True, True, True, "fp8_1x128")
    api.fused_boundary(variant, residual=residual, post=post, norm_eps=1e-6, moe=moe, arch="sm_90a", **named)
    want = api.BoundaryArgs(
        residual=residual,
        post=post,
        eps=1e-6,
        gemm2_permuted=moe[0],
        expert_weights=moe[1],
        idx=moe[2],
        **named,
    )
    assert asked == [variant]  # the caller's variant, as given: nothing below derives it again
    ((args,),) = [got]
    assert len(args) == len(want) and all(a is b or (a == b and type(a) is float) for a, b in zip(args[2:], want[2:]))
    assert torch.equal(args[0], residual) and torch.equal(args[1], post.view(2, 4))


def test_the_budget_experiment_switches_the_shared_gpu_launch_shape_and_back() -> None:
    """bench/experiments/shared_budget_ab.py times v23's grids (4 CTAs per SM among ranks sharing a GPU) against the
    shipped ones in one process: its switch changes the cluster cap of shared-GPU launches only, and restores it."""
    from bench.experiments import shared_budget_ab as ab

    one_gpu_each = default_config(7168, "sm_90a", 1, 4).max_clusters
    try:
        ab.use_budget(4)
        assert default_config(7168, "sm_90a", 4, 4).max_clusters == int(0.9 * (132 * 4 // 7)) // 4
        assert default_config(7168, "sm_90a", 1, 4).max_clusters == one_gpu_each
    finally:
        ab.use_budget(ab.SHIPPED)
    assert default_config(7168, "sm_90a", 4, 4).max_clusters == int(0.9 * (132 // 7)) // 4
