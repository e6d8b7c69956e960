"""Every compile a model's calls ask for is one that warmup() lists, key for key: a kernel obtained at a call, after
warmup, loads its module at its first launch, which stalls ranks that share a context while a boundary spins (v37).

On the CPU the kernel path is stood in: the device's arch is named, and each compile function records the key of
what it is asked for (jit_cache's, the call bound to its signature) and returns a launch that does nothing. The
toy step then runs its calls as on the GPU; what it records must be among warmup's jobs."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from boundary import Boundaries, BoundaryAllReduce, DecodeStep, mhc
from boundary.all_reduce import BoundaryPath
from boundary.toy import ToyConfig, ToyModel, decode_step, decode_step_v4, random_tokens
from boundary.v4 import V4Boundaries
from cute_kernels import coefficients
from cute_kernels.boundary import api as boundary_api
from cute_kernels.coefficients import api as coefficients_api
from cute_kernels.coefficients.tuning import default_bands
from cute_kernels.coefficients.variant import OWN_VARIANTS, VARIANTS

ARCH = "sm_90a"


def row_counts(H: int, max_rows: int) -> list[int]:
    """1, max_rows, and the first row count of every coefficients band of every form at H and the one before it:
    a call of each default config the calls can meet."""
    forms = {v.form for v in (*VARIANTS, *OWN_VARIANTS)}
    firsts = {first for form in forms for first, _ in default_bands(H, form, arch=ARCH)}
    return sorted({r for f in firsts for r in (f - 1, f) if 1 <= r <= max_rows} | {1, max_rows})


COMPILES = (
    (boundary_api, "compile_fused_boundary"),
    (coefficients_api, "compile_coefficients"),
    (coefficients_api, "compile_layer_input"),
)


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, tuple]]:
    """The kernel path on the CPU: every compile recorded by its key, every launch a no-op."""
    calls: list[tuple[str, tuple]] = []
    for module, name in COMPILES:
        real = getattr(module, name)

        def record(*args: Any, real: Any = real, name: str = name, **kwargs: Any) -> Any:
            calls.append((name, real.key(*args, **kwargs)))
            return lambda *launch_args: None

        record.key, record.__name__ = real.key, name  # type: ignore[attr-defined]
        monkeypatch.setattr(module, name, record)
    monkeypatch.setattr("boundary.mhc.kernel_arch", lambda device, backend: ARCH)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)  # no CUDA build here
    return calls


def kernel_path(hidden: int, max_rows: int, monkeypatch: pytest.MonkeyPatch) -> BoundaryAllReduce:
    """A CPU BoundaryAllReduce that takes the kernel path."""
    ar = BoundaryAllReduce(hidden, max_rows=max_rows, device="cpu")
    monkeypatch.setattr(ar, "path", BoundaryPath.KERNEL)
    monkeypatch.setattr(ar, "arch", ARCH)
    return ar


def warmup_keys(owner: Any, monkeypatch: pytest.MonkeyPatch, **kwargs: Any) -> set[tuple[str, tuple]]:
    """The keys of the jobs `owner.warmup(**kwargs)` would compile (a BoundaryAllReduce or a V4Boundaries)."""
    jobs: list = []
    monkeypatch.setattr("boundary.all_reduce.warmup", lambda js, **kw: jobs.extend(js))
    owner.warmup(progress=False, **kwargs)
    return {(job.compile_fn.__name__, job.compile_fn.key(*job.args, **dict(job.kwargs))) for job in jobs}


def assert_covered(recorded: list[tuple[str, tuple]], warmed: set[tuple[str, tuple]]) -> None:
    """Every kind of compile was asked for, and every key asked for is warmup's."""
    asked = set(recorded)
    assert {name for name, _ in asked} == {name for _, name in COMPILES}, "the stand-in missed a kind of kernel"
    assert asked <= warmed, sorted(asked - warmed, key=str)[:3]


def overlap_kernels(*args: Any, **kwargs: Any) -> Any:
    """mhc.pre_delayed as the side-stream path computes it: the layer-input kernel, then the mixes alone (a side
    stream needs CUDA; which kernels run does not depend on it)."""
    return mhc.pre_delayed_overlap(*args, stream=None, **kwargs)


def test_every_compile_of_the_toy_step_is_a_warmup_job(
    recorded: list[tuple[str, tuple]], monkeypatch: pytest.MonkeyPatch
) -> None:
    hidden, max_rows = 1024, 512
    ar = kernel_path(hidden, max_rows, monkeypatch)
    warmed = warmup_keys(ar, monkeypatch, quantize=("mxfp8",))
    model = ToyModel(ToyConfig(hidden_size=hidden, num_layers=2), device="cpu")
    b = Boundaries(ar)
    for overlapped in (False, True):
        with monkeypatch.context() as m:
            if overlapped:  # the side-stream path's kernels (the layer input apart from the mixes), streams aside
                m.setattr(mhc, "pre_delayed", overlap_kernels)
            for rows in row_counts(hidden, max_rows):
                decode_step(model, b, random_tokens(model, rows, 0), DecodeStep(rows=rows, side_stream=False))
    assert_covered(recorded, warmed)


def test_every_compile_of_the_v4_toy_step_is_a_warmup_job(
    recorded: list[tuple[str, tuple]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same for DeepSeek-V4's step (V4Boundaries: own pre at every site, hc_head and the final norm) against
    V4Boundaries.warmup's jobs, with each quantized form the step may write (H 2048: the final in one launch up to
    256 rows, in two beyond)."""
    hidden, max_rows = 2048, 512
    b = V4Boundaries(kernel_path(hidden, max_rows, monkeypatch))
    warmed = warmup_keys(b, monkeypatch)
    model = ToyModel(ToyConfig(hidden_size=hidden, num_layers=2), device="cpu")
    for rows in row_counts(hidden, max_rows):
        decode_step_v4(model, b, random_tokens(model, rows, 0), DecodeStep(rows=rows, side_stream=False))
    assert_covered(recorded, warmed)


def test_the_check_fails_where_a_call_spells_a_key_warmup_does_not(
    recorded: list[tuple[str, tuple]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The negative control: a warmup whose layer-input jobs name another form than the calls' (as if one side
    gained an argument the other never passes) leaves the step's layer-input keys out of warmup's."""
    hidden = 1024
    ar = kernel_path(hidden, 16, monkeypatch)
    real_jobs = coefficients.warmup_jobs

    def skewed(*args: Any, **kwargs: Any) -> list:
        return [
            dataclasses.replace(job, args=(*job.args[:2], "fp8_1x128"))
            if job.compile_fn.__name__ == "compile_layer_input"
            else job
            for job in real_jobs(*args, **kwargs)
        ]

    monkeypatch.setattr(coefficients, "warmup_jobs", skewed)  # what mhc.warmup_jobs calls
    warmed = warmup_keys(ar, monkeypatch, quantize=("mxfp8",))
    model = ToyModel(ToyConfig(hidden_size=hidden, num_layers=2), device="cpu")
    monkeypatch.setattr(mhc, "pre_delayed", overlap_kernels)
    decode_step(model, Boundaries(ar), random_tokens(model, 4, 0), DecodeStep(rows=4, side_stream=False))
    missing = {name for name, key in set(recorded) - warmed}
    assert missing == {"compile_layer_input"}, missing
