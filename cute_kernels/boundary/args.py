"""The fused boundary's variants and its arguments, each defined once.

`BoundaryVariant` is a kernel's compile-time flags. `BoundaryArgs` is its argument list in the kernel's positional
order (FusedBoundaryKernel.__call__ without the stream, which TVM-FFI takes from torch); its one shape rule
(`BoundaryArgs.build`) makes the fake arguments a compile takes, the scratch ones a warmup launch takes, or any other
kind a tool needs, so no caller spells the 22 arguments out again.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from cute_kernels import FP8_GROUP, HC, mxfp8_scale_bytes
from cute_kernels.allreduce.protocol import ERROR_WORDS, GENERATIONS, STATE_WORDS
from cute_kernels.boundary.own_pre import MIX_PARAMS

Y_SOURCES = ("x", "moe")
FP8_FORMS = ("fp8_1x128", "fp8_1x128_ue8m0")  # the FP8 1x128 layer input: fp32 scales, or powers of two (UE8M0)


class BoundaryVariant(NamedTuple):
    """The compile-time flags of one fused-boundary kernel."""

    y_source: str = "x"  # "x": a ready partial; "moe": the top-k combine of gemm2_permuted
    shared: bool = False  # an addend: bf16(x + shared), or the MoE shared_output
    pre: bool = True  # collapse + RMSNorm; False: residual-only
    mxfp8: bool = False
    aux: bool = False
    fp8: str | None = None  # the FP8 1x128 form (FP8_FORMS), beside or instead of MXFP8
    own_pre: bool = False  # DeepSeek-V4: the pre computed from the new streams (mix_fn, mix_params), written to `pre`
    early_loads: bool = False  # the first row's streams and coefficients loaded before the PDL wait (CONTRACT §7)


# The layer-input forms a boundary may write beside bf16, by the name the scheduler's `quantize=` takes: (MXFP8, FP8).
QUANTIZE_FORMS: dict[str, tuple[bool, str | None]] = {"mxfp8": (True, None)} | {
    form: (False, form) for form in FP8_FORMS
}


def engine_variants(quantize: Sequence[str] = tuple(QUANTIZE_FORMS)) -> tuple[BoundaryVariant, ...]:
    """Every variant an engine may launch when it writes the layer input in bf16 and the forms `quantize` names:
    each partial form, with and without an addend and aux, residual-only or with the layer input."""
    inputs = ((False, None),) + tuple(QUANTIZE_FORMS[q] for q in quantize)
    return tuple(
        BoundaryVariant(y_source, shared, pre, mxfp8, aux, fp8)
        for y_source in Y_SOURCES
        for shared in (False, True)
        for pre, mxfp8, fp8 in ((False, False, None),) + tuple((True, mx, f) for mx, f in inputs)
        for aux in (False, True)
    )


ENGINE_VARIANTS: tuple[BoundaryVariant, ...] = engine_variants()


def own_pre_variants(quantize: Sequence[str] = tuple(QUANTIZE_FORMS)) -> tuple[BoundaryVariant, ...]:
    """Every variant a DeepSeek-V4 engine may launch where the boundary computes its own pre: each partial form, with
    and without an addend, the layer input in bf16 and the forms `quantize` names."""
    inputs = ((False, None),) + tuple(QUANTIZE_FORMS[q] for q in quantize)
    return tuple(
        BoundaryVariant(y_source, shared, True, mxfp8, False, fp8, True)
        for y_source in Y_SOURCES
        for shared in (False, True)
        for mxfp8, fp8 in inputs
    )


def variant_name(v: BoundaryVariant) -> str:
    """A short readable name of a variant, e.g. "moe+shared pre mxfp8 aux"."""
    parts = [v.y_source + ("+shared" if v.shared else "")]
    parts.append("pre" if v.pre else "residual-only")
    parts += [flag for flag, on in (("mxfp8", v.mxfp8), (v.fp8, v.fp8 is not None), ("aux", v.aux)) if on]
    parts += ["own-pre"] if v.own_pre else []
    parts += ["early-loads"] if v.early_loads else []
    return " ".join(parts)


def early(variants: Sequence[BoundaryVariant], early_loads: bool) -> tuple[BoundaryVariant, ...]:
    """`variants` with their early_loads flag set to `early_loads` (a BoundaryAllReduce's, for all its launches)."""
    return tuple(v._replace(early_loads=early_loads) for v in variants)


# A tensor maker for BoundaryArgs.build: (argument name, dtype name, shape) -> the argument. The dtype names are
# "bf16", "f32", "i32", "i64", "u8" and "e4m3"; a shape entry is an int or one of the names of DIMS.
TensorMaker = Callable[[str, str, tuple[Any, ...]], Any]
DIMS = {
    "T": "rows of the call",
    "P": "rows of gemm2_permuted",
    "k": "experts per row (top-k)",
    "S": "bytes of the swizzled MXFP8 scales: mxfp8_scale_bytes(T, H)",
    "Tp": "rows of the FP8 1x128 scales' padded token axis: T rounded up to 4",
    "M": "rows of a receive slot (the workspace's max rows)",
}


class BoundaryArgs(NamedTuple):
    """A compiled fused boundary's positional arguments (FusedBoundaryKernel.__call__'s order, the stream left to
    TVM-FFI), None for every tensor the variant does not take."""

    residual: Any  # [T, 4, H] bf16 streams
    post: Any  # [T, 4] fp32
    comb: Any  # [T, 4, 4] fp32, [src, dst]
    pre: Any = None  # [T, 4] fp32
    norm_weight: Any = None  # [H] bf16
    x: Any = None  # [T, H] bf16 partial
    shared: Any = None  # [T, H] bf16 addend, or the MoE shared_output
    gemm2_permuted: Any = None  # [P, H] bf16
    expert_weights: Any = None  # [T, k] fp32
    idx: Any = None  # [T, k] int32 permuted row, -1 = none
    new_residual: Any = None  # [T, 4, H] bf16
    out: Any = None  # [T, H] bf16 layer input
    mxfp8_data: Any = None  # [T, H] e4m3
    mxfp8_scale: Any = None  # [S] uint8, swizzled 128x4
    fp8_data: Any = None  # [T, H] e4m3, FP8 1x128
    fp8_scale: Any = None  # [H/128, Tp] fp32, column-major per token
    aux: Any = None  # [T, H] bf16
    slots: Any = None  # W > 1: [generations, W + 1, M, H] bf16, this rank's receive slots
    peers: Any = None  # W > 1: [W] int64, every rank's receive-slot base address
    state: Any = None  # W > 1: [STATE_WORDS] int32 call state
    error: Any = None  # with peers or a MoE partial: [ERROR_WORDS] int32 error word
    mix_fn: Any = None  # own pre: [4, 4H] fp32, the pre mixes' rows of fn (or hc_head's fn)
    mix_params: Any = None  # own pre: [MIX_PARAMS] fp32: scale, base[4], rms_eps, eps
    eps: Any = 0.0  # the layer-input norm's epsilon (fp32)

    @classmethod
    def build(cls, H: int, variant: BoundaryVariant, world_size: int, tensor: TensorMaker, eps: Any) -> BoundaryArgs:
        """The arguments of `variant` at hidden size H and `world_size` ranks, each tensor made by `tensor` from its
        name, dtype and shape: the one shape rule of the kernel's arguments."""
        y_source, shared, pre, mxfp8, aux, fp8, own_pre, _ = variant  # early_loads changes no argument
        moe, peers = y_source == "moe", world_size > 1

        def t(name: str, dtype: str, *shape: Any, when: bool = True) -> Any:
            return tensor(name, dtype, shape) if when else None

        return cls(
            t("residual", "bf16", "T", HC, H),
            t("post", "f32", "T", HC),
            t("comb", "f32", "T", HC, HC),
            t("pre", "f32", "T", HC, when=pre),
            t("norm_weight", "bf16", H, when=pre),
            t("x", "bf16", "T", H, when=not moe),
            t("shared", "bf16", "T", H, when=shared),
            t("gemm2_permuted", "bf16", "P", H, when=moe),
            t("expert_weights", "f32", "T", "k", when=moe),
            t("idx", "i32", "T", "k", when=moe),
            t("new_residual", "bf16", "T", HC, H),
            t("out", "bf16", "T", H, when=pre),
            t("mxfp8_data", "e4m3", "T", H, when=mxfp8),
            t("mxfp8_scale", "u8", "S", when=mxfp8),
            t("fp8_data", "e4m3", "T", H, when=fp8 is not None),
            t("fp8_scale", "f32", H // FP8_GROUP, "Tp", when=fp8 is not None),
            t("aux", "bf16", "T", H, when=aux),
            t("slots", "bf16", GENERATIONS, world_size + 1, "M", H, when=peers),
            t("peers", "i64", world_size, when=peers),
            t("state", "i32", STATE_WORDS, when=peers),
            t("error", "i32", ERROR_WORDS, when=peers or moe),
            t("mix_fn", "f32", HC, HC * H, when=own_pre),
            t("mix_params", "f32", MIX_PARAMS, when=own_pre),
            eps,
        )

    def variant(self, fp8_form: str | None = None) -> BoundaryVariant:
        """The variant these arguments launch (`fp8_form`: the FP8 1x128 form, which the tensors cannot tell)."""
        if (self.fp8_data is None) != (fp8_form is None):
            raise ValueError(f"fp8_form {fp8_form!r} with fp8_data {'absent' if self.fp8_data is None else 'given'}")
        return BoundaryVariant(
            "moe" if self.gemm2_permuted is not None else "x",
            self.shared is not None,
            self.pre is not None,
            self.mxfp8_data is not None,
            self.aux is not None,
            fp8_form,
            self.mix_fn is not None,
        )


# The element divisibility each tensor's kernel code assumes (its fake tensors declare it): 16 bytes for what the
# kernel reads or writes 16 bytes at a time, else one element.
DIVISIBILITY = {"bf16": 8, "e4m3": 16, "u8": 4, "f32": 1, "i32": 1, "i64": 1}
DIVISIBILITY_OF = {"fp8_scale": 4}  # [H/128, Tp]: a token's last scale and its padding go as one 16-byte store


def divisibility(name: str, dtype: str) -> int:
    """The element divisibility the kernel assumes of argument `name` (of dtype `dtype`)."""
    return DIVISIBILITY_OF.get(name, DIVISIBILITY[dtype])


def concrete_dims(rows: int, H: int, *, permuted_rows: int = 1, top_k: int = 1, slot_rows: int = 1) -> dict[str, int]:
    """The values of DIMS for real tensors of a call of `rows` rows."""
    return {
        "T": rows,
        "P": permuted_rows,
        "k": top_k,
        "S": mxfp8_scale_bytes(rows, H),
        "Tp": -(-rows // 4) * 4,
        "M": slot_rows,
    }
