"""Cheap host-side input checks that raise a clear TypeError or ValueError before any work."""

from __future__ import annotations

import logging
import math
import numbers
import operator
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from boundary.params import MHCParams

Dim = int | None  # None: any size
log = logging.getLogger("boundary")
# A workspace from this size up is logged as a warning (a default logging set-up shows it): far more than a
# decode step needs (H 7168 at W 8 with the default max_rows=512 takes 0.13 GiB).
WORKSPACE_WARNING_BYTES = 512 * 2**20
_compiling = torch.compiler.is_compiling  # bound once: finite_float runs on every boundary call


def _error(kind: type[Exception], name: str, text: str, **details: object) -> Exception:
    """An error whose message starts with the argument's name; `argument` lets a caller rename it (`rename`)."""
    exc = kind(f"{name} {text}")
    # Dynamo cannot trace an attribute set on an exception: under torch.compile the error goes without them (it
    # reaches the caller as Dynamo's "Observed exception" quoting this message; nothing renames it there).
    if not _compiling():
        exc.argument = name  # type: ignore[attr-defined]
        for key, value in details.items():
            setattr(exc, key, value)
    return exc


def rename(exc: BaseException, names: Mapping[str, str], *, converted_at_load: bool = False) -> None:
    """Raise `exc` again under the caller's name for its argument (a layer attribute, a state field), if `names`
    has one; return otherwise. `converted_at_load`: a wrong dtype is to be fixed once, when the model loads."""
    arg = getattr(exc, "argument", None)
    new = names.get(arg) if arg is not None else None
    if new is None:
        return
    text = str(exc)[len(arg) + 1 :]
    dtype = getattr(exc, "dtype", None)
    if converted_at_load and dtype is not None:
        text += f": convert it to {dtype} once, when the model loads (the boundary casts nothing per call)"
    raise _error(type(exc), new, text, dtype=dtype) from None


def _shape_ok(actual: torch.Size, shape: Sequence[Dim]) -> bool:
    if len(actual) != len(shape):
        return False
    for want, got in zip(shape, actual):
        if want is not None and want != got:
            return False
    return True


def _on(value: Tensor, device: torch.device) -> bool:
    if device.type == "cuda":
        return value.get_device() == device.index  # -1 for a tensor on the CPU; a CUDA device here has its index
    return value.device == device


def tensor(
    name: str,
    value: object,
    *,
    dtype: torch.dtype | tuple[torch.dtype, ...] | None = None,
    shape: Sequence[Dim] | None = None,
    device: torch.device | None = None,
    contiguous: bool = True,
    align: int = 1,
) -> Tensor:
    """Check one tensor argument and return it; the message names the argument and the expectation. `align`: the
    byte boundary its data must start on (a kernel's vector accesses; the torch path takes any address)."""
    # The common case in one pass of cheap attribute reads: boundaries run ~100 times per step.
    if (
        isinstance(value, Tensor)
        and (dtype is None or value.dtype is dtype or (isinstance(dtype, tuple) and value.dtype in dtype))
        and (shape is None or value.shape == shape or _shape_ok(value.shape, shape))  # the first: one C compare
        and (device is None or _on(value, device))
        and (not contiguous or value.is_contiguous())
        and (align == 1 or value.data_ptr() % align == 0)
    ):
        return value
    if not isinstance(value, Tensor):
        raise _error(TypeError, name, f"must be a torch.Tensor, got {type(value).__name__}")
    if dtype is not None:
        allowed = dtype if isinstance(dtype, tuple) else (dtype,)
        if value.dtype not in allowed:
            want = " or ".join(str(d) for d in allowed)
            raise _error(TypeError, name, f"must have dtype {want}, got {value.dtype}", dtype=allowed[0])
    if shape is not None and not _shape_ok(value.shape, shape):
        want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise _error(ValueError, name, f"must have shape {want}, got {list(value.shape)}")
    if device is not None and not _on(value, device):
        raise _error(ValueError, name, f"must be on {device}, got {value.device}")
    if contiguous and not value.is_contiguous():
        raise _error(ValueError, name, "must be contiguous")
    if align > 1 and value.data_ptr() % align:
        raise _error(ValueError, name, f"must start on a {align}-byte boundary (got address {value.data_ptr():#x})")
    return value


def fits(value: object, dtype: torch.dtype, shape: tuple[int, ...], cuda_index: int | None, align: int) -> bool:
    """Whether `value` is a plain tensor of exactly this dtype and fully given shape, on the CUDA device `cuda_index`
    (None: on the CPU), contiguous and starting on an `align`-byte boundary: what `tensor` accepts, tested in one
    expression for the hot path (a False says nothing: `tensor` then finds and names what is wrong)."""
    return (
        type(value) is Tensor
        and value.dtype is dtype
        and value.shape == shape
        and (value.is_cpu if cuda_index is None else value.get_device() == cuda_index)
        and value.is_contiguous()
        and value.data_ptr() % align == 0
    )


def optional_tensor(name: str, value: object, **kwargs: object) -> Tensor | None:
    """Like `tensor`, for an argument that may be None."""
    return None if value is None else tensor(name, value, **kwargs)  # type: ignore[arg-type]


def coefficients(
    rows: int, hc: int, device: torch.device, post: object, comb: object, pre: object | None
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Check post [T, hc] (or [T, hc, 1]), comb [T, hc, hc] and pre [T, hc], all fp32."""
    if isinstance(post, Tensor) and post.dim() == 3:
        tensor("post", post, dtype=torch.float32, shape=(rows, hc, 1), device=device)
        post = post.reshape(rows, hc)
    post = tensor("post", post, dtype=torch.float32, shape=(rows, hc), device=device)
    comb = tensor("comb", comb, dtype=torch.float32, shape=(rows, hc, hc), device=device)
    pre = optional_tensor("pre", pre, dtype=torch.float32, shape=(rows, hc), device=device)
    return post, comb, pre


def integer(name: str, value: object) -> int:
    """An integral argument (an int, a numpy int, anything with __index__; not a bool) as an int."""
    if type(value) is int:
        return value  # type: ignore[return-value]
    if not isinstance(value, bool):
        try:
            return operator.index(value)  # type: ignore[arg-type]
        except TypeError:
            pass
    raise _error(TypeError, name, f"must be an int, got {type(value).__name__} {value!r}")


def positive_int(name: str, value: object) -> int:
    """A positive integral argument as an int."""
    number = integer(name, value)
    if number < 1:
        raise _error(ValueError, name, f"must be a positive int, got {value!r}")
    return number


def non_negative_int(name: str, value: object) -> int:
    """A non-negative integral argument as an int."""
    number = integer(name, value)
    if number < 0:
        raise _error(ValueError, name, f"must be a non-negative int, got {value!r}")
    return number


def finite_float(name: str, value: object, *, minimum: float | None = None) -> float:
    """A real-number argument (any real but a bool: int, float, numpy scalars) as a float, optionally bounded below."""
    if _compiling():  # traced (with dynamic shapes a float may be symbolic): the op checks it when it runs
        return value  # type: ignore[return-value]
    if type(value) is not float:
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise _error(TypeError, name, f"must be a real number, got {type(value).__name__} {value!r}")
        value = float(value)
    if not math.isfinite(value):
        raise _error(ValueError, name, f"must be finite, got {value}")
    if minimum is not None and value < minimum:
        raise _error(ValueError, name, f"must be >= {minimum}, got {value}")
    return value


def flag(name: str, value: object) -> bool:
    """A bool argument: a string or a number is refused (`"no"` is truthy)."""
    if type(value) is not bool:
        raise _error(TypeError, name, f"must be a bool (True or False), got {type(value).__name__} {value!r}")
    return value  # type: ignore[return-value]


def quantize_form(name: str, value: object, forms: tuple[str, ...]) -> str | None:
    """The layer-input form a `quantize=` argument names: the module's bool (True: MXFP8, False: none), None (none)
    or one of the named `forms`; any other value is refused."""
    if value is True:
        return "mxfp8"
    if value is False or value is None or (type(value) is str and value in forms):
        return value or None  # type: ignore[return-value]
    names = ", ".join(repr(a) for a in forms)
    what = f"must be True (MXFP8), False or None (bf16 only) or one of {names}, got"
    if not isinstance(value, str):
        raise _error(TypeError, name, f"{what} {type(value).__name__} {value!r}")
    raise _error(ValueError, name, f"{what} {value!r}")


def device(name: str, value: object) -> torch.device:
    """A CPU or CUDA device argument that exists on this machine, as a torch.device with the CUDA index filled in
    (None: the current GPU, else the CPU)."""
    if value is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if isinstance(value, bool) or not isinstance(value, (str, int, torch.device)):
        raise _error(TypeError, name, f"must be a torch.device, a str or an int, got {type(value).__name__}")
    try:
        dev = torch.device(value)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise _error(ValueError, name, f"{value!r} is not a device: {exc}") from None
    if dev.type == "cpu":
        return torch.device("cpu")
    if dev.type != "cuda":
        raise _error(ValueError, name, f"must be a CPU or CUDA device, got {dev}")
    if not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        raise _error(
            ValueError,
            name,
            f"is {dev}, but no CUDA GPU is available here (torch {torch.__version__}, {build}); pass device='cpu'",
        )
    index = torch.cuda.current_device() if dev.index is None else dev.index
    if index >= torch.cuda.device_count():
        raise _error(ValueError, name, f"is {dev}, but this machine has {torch.cuda.device_count()} CUDA GPU(s)")
    return torch.device("cuda", index)


def free_bytes(dev: torch.device) -> int | None:
    """The memory free for new allocations on `dev` (a GPU: the driver's free memory plus what torch's allocator
    holds unused; the CPU: MemAvailable from /proc/meminfo), or None where it cannot be read."""
    if dev.type == "cuda":
        free, _ = torch.cuda.mem_get_info(dev)
        return free + torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def workspace_capacity(
    hidden_size: int, max_rows: int, world_size: int, dev: torch.device, *, slots: bool, ranks: int
) -> None:
    """Refuse a BoundaryAllReduce workspace (`ranks` ranks' on `dev`, with the receive slots where `slots`) that the
    memory free on `dev` cannot hold, naming max_rows; log its size otherwise, as a warning from
    WORKSPACE_WARNING_BYTES up."""
    from boundary.workspace import workspace_bytes  # workspace imports torch.distributed: only where it is used

    nbytes = ranks * workspace_bytes(hidden_size, max_rows, world_size, slots=slots)
    free = free_bytes(dev)
    gib = f"{nbytes / 2**30:.2f} GiB"
    if free is not None and nbytes > free:
        raise _error(
            ValueError,
            "max_rows",
            f"is {max_rows}: its workspace needs {nbytes} bytes ({gib}) on {dev}, "
            f"but {dev} has {free} bytes ({free / 2**30:.2f} GiB) free: lower max_rows to the most rows "
            "one decode step takes",
        )
    level = logging.WARNING if nbytes >= WORKSPACE_WARNING_BYTES else logging.INFO
    known = "unknown" if free is None else f"{free / 2**30:.2f} GiB"
    log.log(
        level,
        "BoundaryAllReduce workspace: %d bytes (%s) on %s for max_rows=%d at H=%d (free: %s)",
        nbytes,
        gib,
        dev,
        max_rows,
        hidden_size,
        known,
    )


def mhc_params(params: MHCParams, hc: int, width: int, dev: torch.device) -> MHCParams:
    """Check the mHC parameters for streams of `hc` and a projection over `width` columns on `dev`; returns them with
    the scalars as Python numbers. Messages name the CONTRACT §5 arguments (fn, hc_scale, ...)."""
    fn, scale, base, rms_eps, pre_eps, sinkhorn_eps, post_mult, repeat = params
    tensor("fn", fn, dtype=torch.float32, shape=(hc * (hc + 2), width), device=dev)
    tensor("hc_scale", scale, dtype=torch.float32, shape=(3,), device=dev)
    tensor("hc_base", base, dtype=torch.float32, shape=(hc * (hc + 2),), device=dev)
    return MHCParams(
        fn,
        scale,
        base,
        finite_float("rms_eps", rms_eps, minimum=0.0),
        finite_float("hc_pre_eps", pre_eps, minimum=0.0),
        finite_float("hc_sinkhorn_eps", sinkhorn_eps, minimum=0.0),
        finite_float("hc_post_mult_value", post_mult),
        positive_int("sinkhorn_repeat", repeat),
    )


def pre_delayed(
    residual: object, params: MHCParams, pre_mix: object, x: object, norm_weight: object, norm_eps: object
) -> tuple[MHCParams, float]:
    """The arguments of mhc_pre_delayed and mhc_pre_delayed_overlap (CONTRACT §3): dtypes, shapes, devices, scalars;
    returns the parameters and norm_eps with the scalars as Python numbers."""
    residual = tensor("residual", residual, dtype=torch.bfloat16, shape=(None, None, None))
    rows, hc, hidden = residual.shape
    dev = residual.device
    x = optional_tensor("x", x, dtype=torch.bfloat16, shape=(rows, hidden), device=dev)
    params = mhc_params(params, hc, hidden if x is not None else hc * hidden, dev)
    optional_tensor("pre_mix", pre_mix, dtype=torch.float32, shape=(rows, hc), device=dev)
    if x is not None and pre_mix is not None:
        raise _error(
            ValueError,
            "pre_mix",
            "must be None with x (the first layer: its collapse is stream 0 exactly, CONTRACT §3)",
        )
    optional_tensor("norm_weight", norm_weight, dtype=torch.bfloat16, shape=(hidden,), device=dev)
    return params, finite_float("norm_eps", norm_eps, minimum=0.0)
