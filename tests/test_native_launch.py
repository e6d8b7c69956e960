"""The C launch entry (cute_kernels.native): a kept launch that allocates its outputs like its inputs and calls the
kernel's TVM-FFI entry once, with the very tuple the Python launch passes; refusals raise and launch nothing; a build
that cannot run says so and leaves the Python launch. (On the CPU: a TVM-FFI function that records what it gets
stands in for the compiled kernel.)"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import tvm_ffi

from cute_kernels import native
from cute_kernels.boundary import api
from tests.inputs import boundary_inputs

H, ROWS = 256, 3


def recorder(seen: list, refuse: list | None = None) -> tvm_ffi.Function:
    """A TVM-FFI function that records each argument (a tensor as its data pointer, shape and dtype, read during the
    call: the tensors it gets are views that end with it)."""

    def kernel(*args: object) -> None:
        seen.append(
            [(a.data_ptr(), tuple(a.shape), str(a.dtype)) if isinstance(a, tvm_ffi.Tensor) else a for a in args]
        )
        if refuse:
            raise RuntimeError(refuse.pop())

    return tvm_ffi.convert(kernel)


def described(t: torch.Tensor | None) -> object:
    return None if t is None else (t.data_ptr(), tuple(t.shape), str(t.dtype).removeprefix("torch."))


@pytest.fixture(autouse=True)
def fresh_build(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test builds into its own cache folder."""
    monkeypatch.setenv("MHC_BOUNDARY_CACHE_DIR", str(tmp_path / "cache"))
    native.module.cache_clear()
    native.available.cache_clear()
    yield
    native.module.cache_clear()
    native.available.cache_clear()


@pytest.mark.parametrize("layer_input", [True, False])
@pytest.mark.parametrize("mxfp8", [False, True])
@pytest.mark.parametrize("peers", [False, True])
def test_the_c_launch_passes_the_kernel_the_python_launchs_tuple(layer_input: bool, mxfp8: bool, peers: bool) -> None:
    inp = boundary_inputs(ROWS, H)
    pre, w = (inp["pre"], inp["norm_weight"]) if layer_input else (None, None)
    mx = (torch.empty(ROWS, H, dtype=torch.float8_e4m3fn), torch.empty(64, dtype=torch.uint8)) if mxfp8 else (None,) * 2
    held = tuple(torch.zeros(n, dtype=torch.int32) for n in (5, 6, 7, 8)) if peers else (None,) * 4
    args = (inp["residual"], inp["post"], inp["comb"], pre, w, inp["x"], *mx, 1e-5)

    seen_c: list = []
    c_launch = api.ready_launch(recorder(seen_c), *held, layer_input=layer_input)
    assert type(c_launch).__name__ == "Launch"
    new_residual, out = c_launch(*args)
    seen_py: list = []
    py_fn = recorder(seen_py)
    py_launch = api.ready_launch(lambda *a: py_fn(*a), *held, layer_input=layer_input)  # not TVM-FFI: Python's
    assert type(py_launch).__name__ == "function"
    py_new, py_out = py_launch(*args)

    assert new_residual.shape == inp["residual"].shape and new_residual.dtype == torch.bfloat16
    assert new_residual.is_contiguous() and new_residual.device == inp["residual"].device
    assert (out is None) == (not layer_input)
    if layer_input:
        assert out.shape == inp["x"].shape and out.dtype == torch.bfloat16 and out.is_contiguous()
    (c_args,), (py_args,) = seen_c, seen_py
    assert len(c_args) == len(py_args) == len(api.BoundaryArgs._fields)
    want = api.BoundaryArgs(
        residual=described(inp["residual"]),
        post=described(inp["post"]),
        comb=described(inp["comb"]),
        pre=described(pre),
        norm_weight=described(w),
        x=described(inp["x"]),
        new_residual=described(new_residual),
        out=described(out),
        mxfp8_data=described(mx[0]),
        mxfp8_scale=described(mx[1]),
        slots=described(held[0]),
        peers=described(held[1]),
        state=described(held[2]),
        error=described(held[3]),
        eps=1e-5,
    )
    assert api.BoundaryArgs(*c_args) == want
    py_want = want._replace(new_residual=described(py_new), out=described(py_out))
    assert api.BoundaryArgs(*py_args) == py_want


def test_a_refused_launch_raises_and_returns_nothing() -> None:
    inp = boundary_inputs(ROWS, H)
    seen: list = []
    launch = api.ready_launch(recorder(seen, refuse=["bad x"]), None, None, None, None, layer_input=True)
    args = [inp["residual"], inp["post"], inp["comb"], inp["pre"], inp["norm_weight"], inp["x"], None, None, 1e-6]
    with pytest.raises(RuntimeError, match="entry refused the call: RuntimeError: bad x"):
        launch(*args)
    assert len(seen) == 1
    for i, bad, kind in [(8, 1, TypeError), (1, "post", TypeError), (0, [inp["residual"]], TypeError)]:
        wrong = list(args)
        wrong[i] = bad
        with pytest.raises(kind, match="a kernel argument must be a tensor, None or a float"):
            launch(*wrong)
    with pytest.raises(TypeError, match="takes 9 arguments, got 8"):
        launch(*args[:8])
    with pytest.raises(TypeError, match="takes 9 arguments, got 10"):
        launch(*args, None)
    assert len(seen) == 1  # nothing launched after the refusal
    new_residual, out = launch(*args)  # and it still launches
    assert len(seen) == 2 and seen[1][10][0] == new_residual.data_ptr() and seen[1][11][0] == out.data_ptr()


def test_a_launch_is_made_whole_once() -> None:
    """What the entry refuses to be built from: a plan naming an argument past its 32, an integer past a C long, a
    TVM-FFI object that is not a function; and it is initialised once, and never called uninitialised."""
    Launch = native.module().Launch
    api_capsule, fn = torch.Tensor.__dlpack_c_exchange_api__, recorder([])
    with pytest.raises(ValueError, match="names call argument 32"):
        Launch(fn, (0, 32), api_capsule, torch.Tensor, 0)
    with pytest.raises(ValueError, match="names call argument 1099511627775"):
        Launch(fn, (-(2**40),), api_capsule, torch.Tensor, 1)
    with pytest.raises(OverflowError):
        Launch(fn, (2**70,), api_capsule, torch.Tensor, 0)
    with pytest.raises(ValueError, match="outputs"):
        Launch(fn, (-1, -2), api_capsule, torch.Tensor, 1)
    with pytest.raises(TypeError, match="fn must be a TVM-FFI function"):
        Launch(tvm_ffi.convert([1, 2]), (0,), api_capsule, torch.Tensor, 0)
    launch = Launch(fn, (0,), api_capsule, torch.Tensor, 0)
    with pytest.raises(RuntimeError, match="initialised once"):
        launch.__init__(fn, (0, 1), api_capsule, torch.Tensor, 0)
    assert launch(None) == ()
    with pytest.raises(RuntimeError, match="not initialised"):
        Launch.__new__(Launch)(None)


def test_a_parameter_passes_as_a_tensor() -> None:
    """An nn.Parameter (a norm weight) is a torch.Tensor subclass: the entry takes it as a tensor."""
    inp = boundary_inputs(ROWS, H)
    seen: list = []
    launch = api.ready_launch(recorder(seen), None, None, None, None, layer_input=True)
    weight = torch.nn.Parameter(inp["norm_weight"], requires_grad=False)
    launch(inp["residual"], inp["post"], inp["comb"], inp["pre"], weight, inp["x"], None, None, 1e-6)
    assert seen[0][4] == described(weight)


def test_the_entry_is_built_once_into_the_cache_folder(tmp_path: Path) -> None:
    assert native.available()
    path = native.library_path()
    assert path.is_relative_to(tmp_path / "cache") and path.exists()
    stamp = path.stat().st_mtime_ns
    native.module.cache_clear()
    native.module()
    assert path.stat().st_mtime_ns == stamp  # loaded, not rebuilt


def test_a_build_that_fails_says_why_and_leaves_the_python_launch(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("CC", "no-such-compiler-mhc")
    with pytest.raises(native.NativeBuildError, match="cannot run the C compiler \\(no-such-compiler-mhc "):
        native.module()
    native.module.cache_clear()
    with caplog.at_level(logging.WARNING, logger="boundary"):
        assert not native.available()
    assert "the C launch entry is not available" in caplog.text and "no-such-compiler-mhc" in caplog.text
    launch = api.ready_launch(recorder([]), None, None, None, None, layer_input=False)
    assert type(launch).__name__ == "function"
    monkeypatch.setenv("CC", "false")
    native.module.cache_clear()
    with pytest.raises(native.NativeBuildError, match="^false .* failed \\(1\\)"):
        native.module()
    assert not native.library_path().exists()


def test_the_public_call_keeps_its_launch_in_the_c_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    """BoundaryAllReduce's second call of a plain form launches through the C entry, with the first call's tuple
    but for its new outputs; a kept launch the entry refuses still ends in the full checks' error."""
    from boundary import BoundaryAllReduce
    from boundary.all_reduce import BoundaryPath

    ar = BoundaryAllReduce(H, max_rows=4, device="cpu")
    monkeypatch.setattr(ar, "path", BoundaryPath.KERNEL)
    ar.arch = "sm_90a"
    seen: list = []
    refuse: list = []
    kernel = recorder(seen, refuse)
    monkeypatch.setattr(api, "compiled_boundary", lambda h, v, **k: kernel)
    inp = boundary_inputs(ROWS, H)
    args = [inp["x"], inp["residual"], inp["post"], inp["comb"], inp["pre"], inp["norm_weight"], 1e-6, None]
    first = ar(*args)
    assert type(ar._ready[(ROWS, False, True)]).__name__ == "Launch"
    second = ar(*args)
    one, two = seen
    outputs = {api.BoundaryArgs._fields.index(f) for f in ("new_residual", "out")}
    assert [a for i, a in enumerate(one) if i not in outputs] == [a for i, a in enumerate(two) if i not in outputs]
    assert [two[i][0] for i in sorted(outputs)] == [t.data_ptr() for t in second]
    assert [t.shape for t in first] == [t.shape for t in second]
    seen.clear()
    refuse.append("x")
    args[0] = inp["x"].float()
    with pytest.raises(TypeError, match="^x must have dtype torch.bfloat16"):
        ar(*args)
    assert len(seen) == 1  # the kept launch's refused call; the full checks launched nothing


def test_a_post_of_shape_t_hc_1_keeps_one_launch_and_pre_out_without_mix_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """post [T, hc, 1] (the module's form) goes to the kept launch as [T, hc]: before, the entry refused every later
    call, and each ran the full checks and kept a new launch. `pre_out` without `mix` skipped the fast path's gate
    and launched a plain boundary where the checked path refuses it."""
    from boundary import BoundaryAllReduce
    from boundary.all_reduce import BoundaryPath

    ar = BoundaryAllReduce(H, max_rows=4, device="cpu")
    monkeypatch.setattr(ar, "path", BoundaryPath.KERNEL)
    ar.arch = "sm_90a"
    seen: list = []

    post = api.BoundaryArgs._fields.index("post")

    def kernel(*args: object) -> None:  # refuses a 3-D post, as the compiled entry's ndim check does
        seen.append(len(args[post].shape))
        if len(args[post].shape) != 2:
            raise ValueError("Mismatched Tensor on argument #1, expected ndim=2")

    monkeypatch.setattr(api, "compiled_boundary", lambda h, v, **k: tvm_ffi.convert(kernel))
    inp = boundary_inputs(ROWS, H)
    args = [inp["x"], inp["residual"], inp["post"].unsqueeze(-1), inp["comb"], inp["pre"], inp["norm_weight"], 1e-6]
    for _ in range(5):
        ar(*args, None)
    kept = ar._ready[(ROWS, False, True)]
    ar(*args, None)
    assert seen == [2] * 6 and ar._ready[(ROWS, False, True)] is kept
    with pytest.raises(
        ValueError, match="pre_out takes the pre a boundary computes from its new streams: it needs mix"
    ):
        ar(*args, None, pre_out=torch.empty(ROWS, 4))
    assert len(seen) == 6
    args[2] = inp["post"].reshape(1, 4, ROWS)  # as many elements, another shape: refused, not viewed as [T, hc]
    with pytest.raises(ValueError, match=rf"^post must have shape \[{ROWS}, 4, 1\]"):
        ar(*args, None)
    assert seen[6:] == [3]  # the kept launch's entry refused it (3 dims); the checks launched nothing


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("hidden", [4096, 7168])
def test_on_the_gpu_the_c_launch_is_the_python_launch_in_a_graph_on_a_side_stream(hidden: int) -> None:
    """The kept C launch writes the bits the Python launch writes, eager and captured in a CUDA graph on a side
    stream (a launch off torch's current stream would break the capture), and its outputs are the graph's."""
    from boundary import BoundaryAllReduce

    device = torch.device("cuda", torch.cuda.current_device())
    ar = BoundaryAllReduce(hidden, max_rows=16, device=device)
    ar.warmup(progress=False, quantize=())
    assert native.available()
    fn = api.compiled_boundary(hidden, api.BoundaryVariant("x", False, True, False, False), arch=ar.arch)
    py_launch = api.ready_launch(lambda *a: fn(*a), None, None, None, None, layer_input=True)
    for rows in (1, 5, 16):
        inp = boundary_inputs(rows, hidden, seed=rows, device=device)
        args = (inp["x"], inp["residual"], inp["post"], inp["comb"], inp["pre"], inp["norm_weight"], 1e-6, None)
        first = ar(*args)  # _kernel: keeps the launch
        kept = ar._ready[(rows, False, True)]
        assert type(kept).__name__ == "Launch"
        launch_args = (*args[1:6], args[0], None, None, 1e-6)
        eager_c, eager_py = ar(*args), py_launch(*launch_args)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
            captured = ar(*args)
        again = {k: v.clone() for k, v in inp.items()}
        for fresh in (boundary_inputs(rows, hidden, seed=100 + rows, device=device), again):
            for name in ("x", "residual", "post", "comb", "pre"):
                inp[name].copy_(fresh[name])
            graph.replay()
            torch.cuda.synchronize()
            want = ar(*args)
            for got, ref in zip(captured, want):
                assert torch.equal(got.view(torch.int16), ref.view(torch.int16))
        torch.cuda.synchronize()
        for a, b, c in zip(first, eager_c, eager_py):
            assert torch.equal(a.view(torch.int16), b.view(torch.int16))
            assert torch.equal(a.view(torch.int16), c.view(torch.int16))
        del graph


@pytest.mark.slow
@pytest.mark.parametrize("locked", [True, False])
def test_processes_that_start_together_build_the_entry_once(tmp_path: Path, locked: bool) -> None:
    """Four processes asking for the entry at once on a cold cache (a TP group's warmups): each loads it, one builds.
    Each build is held a second longer, so that all four meet; the control without the file lock builds in several."""
    import os
    import subprocess
    import sys

    probe = (
        "import contextlib, logging, sys, time; logging.basicConfig(level=logging.INFO, stream=sys.stdout)\n"
        "from cute_kernels import native\n"
        "real = native.build\n"
        "native.build = lambda path: (time.sleep(1.0), real(path))\n"
        + ("" if locked else "native._FileLock = lambda path: contextlib.nullcontext()\n")
        + "print('available', native.available())\n"
    )
    env = {**os.environ, "MHC_BOUNDARY_CACHE_DIR": str(tmp_path / "group")}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", probe], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for _ in range(4)
    ]
    outs = [p.communicate(timeout=240)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert all("available True" in out for out in outs), outs
    builds = sum("building the C launch entry" in out for out in outs)
    assert builds == 1 if locked else builds > 1, outs
    assert len(list((tmp_path / "group" / "native").glob("*.so"))) == 1
