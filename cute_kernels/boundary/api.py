"""The fused boundary's call path: variants, compile (cached per key), warmup, and the thin launch.

The public entry points (boundary.BoundaryAllReduce, boundary.mhc_post) check every argument once;
nothing here checks again.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import cutlass.cute as cute
import torch
from cutlass import BFloat16, Float8E4M3FN, Float32, Int32, Int64, Uint8

from cute_kernels import HC, native
from cute_kernels.allreduce.protocol import PROTOCOLS, STATE_CALLS, STATE_RANK, STATE_TIMEOUT_US
from cute_kernels.allreduce.tuning import protocol_for, protocols_up_to
from cute_kernels.boundary.args import (  # noqa: F401 (the variant names are re-exported: callers reach them here)
    ENGINE_VARIANTS,
    FP8_FORMS,
    QUANTIZE_FORMS,
    Y_SOURCES,
    BoundaryArgs,
    BoundaryVariant,
    concrete_dims,
    divisibility,
    early,
    engine_variants,
    own_pre_variants,
    variant_name,
)
from cute_kernels.boundary.config import BoundaryConfig, default_config
from cute_kernels.boundary.kernel import FusedBoundaryKernel
from cute_kernels.compile import (
    WarmupJob,
    compile_kernel,
    fake_stream,
    fake_tensor,
    jit_cache,
    launched,
    mark_launched,
)

# The dtype names of BoundaryArgs.build, as the DSL's types and as torch's.
DSL_DTYPES = {"bf16": BFloat16, "f32": Float32, "i32": Int32, "i64": Int64, "u8": Uint8, "e4m3": Float8E4M3FN}
TORCH_DTYPES = {
    "bf16": torch.bfloat16,
    "f32": torch.float32,
    "i32": torch.int32,
    "i64": torch.int64,
    "u8": torch.uint8,
    "e4m3": torch.float8_e4m3fn,
}


def fake_args(H: int, variant: BoundaryVariant, world_size: int = 1) -> BoundaryArgs:
    """The tensor-free arguments a fused-boundary kernel compiles against; T (and P, top-k, the slot rows) stay
    dynamic."""
    T, top_k = cute.sym_int(), cute.sym_int()
    dims = {"T": T, "k": top_k}

    def fake(name: str, dtype: str, shape: tuple[Any, ...]) -> cute.Tensor:
        shape = tuple(dims[d] if d in dims else cute.sym_int() if isinstance(d, str) else d for d in shape)
        return fake_tensor(DSL_DTYPES[dtype], shape, divisibility=divisibility(name, dtype))

    return BoundaryArgs.build(H, variant, world_size, fake, Float32(0.0))


def compile_boundary_kernel(
    kernel: FusedBoundaryKernel, H: int, variant: BoundaryVariant, world_size: int, *, arch: str
) -> Callable[..., Any]:
    """Compile a fused-boundary kernel object (uncached; tests build modified ones) with the TVM-FFI call path."""
    return compile_kernel(kernel, *fake_args(H, variant, world_size), fake_stream(), arch=arch)


@jit_cache
def compile_fused_boundary(
    H: int,
    y_source: str,
    shared: bool,
    pre: bool,
    mxfp8: bool,
    aux: bool,
    fp8: str | None,
    own_pre: bool,
    early_loads: bool,
    config: BoundaryConfig,
    world_size: int,
    protocol: str,
    staged: bool = False,
    *,
    arch: str,
) -> Callable[..., Any]:
    """Compile one fused-boundary variant: the flags, the launch shape, the world size, the protocol and whether
    the exchange is staged."""
    variant = BoundaryVariant(y_source, shared, pre, mxfp8, aux, fp8, own_pre, early_loads)
    kernel = FusedBoundaryKernel(
        H,
        config,
        y_source=y_source,
        shared=shared,
        pre=pre,
        mxfp8=mxfp8,
        aux=aux,
        fp8=fp8,
        world_size=world_size,
        protocol=protocol,
        staged=staged,
        own_pre=own_pre,
        early_loads=early_loads,
    )
    return compile_boundary_kernel(kernel, H, variant, world_size, arch=arch)


def compiled_boundary(
    H: int,
    variant: BoundaryVariant,
    *,
    arch: str,
    world_size: int = 1,
    protocol: str = "oneshot",
    ranks_per_device: int = 1,
    rows: int = 1,
) -> Callable[..., Any]:
    """The compiled kernel of one variant at the shipped launch shape for a call of `rows` rows (compiled or loaded
    on first use): with peers, staged when the clusters take several rows each and the partial is a ready x."""
    config = default_config(H, arch, ranks_per_device, world_size, variant.own_pre)
    if world_size == 1:
        return compile_fused_boundary(H, *variant, config, 1, "oneshot", arch=arch)
    staged = staged_call(variant, config, rows)
    return compile_fused_boundary(H, *unstaged_only(variant, staged), config, world_size, protocol, staged, arch=arch)


def unstaged_only(variant: BoundaryVariant, staged: bool) -> BoundaryVariant:
    """The variant a call compiles: a staged kernel waits for its predecessor first either way, so its early_loads
    flag is dropped (one kernel, not two byte-identical ones)."""
    return variant._replace(early_loads=False) if staged and variant.early_loads else variant


def peer_launch_shape(H: int, arch: str, ranks_per_device: int, world_size: int) -> tuple[int, int, int]:
    """(CTAs per row, threads, cluster cap) of the peer kernels: what every rank of a group must share, since a call's
    cluster count decides the two-shot owners."""
    config = default_config(H, arch, ranks_per_device, world_size)
    return config.cluster_n, config.threads, config.max_clusters


def call_protocol(world_size: int, H: int, rows: int, forced: str | None) -> str:
    """The protocol a W > 1 call of `rows` rows takes: `forced` where the caller named one, else the switch's."""
    return forced or protocol_for(world_size, H, rows)


def warmup_protocols(world_size: int, H: int, max_rows: int, forced: str | None) -> tuple[str, ...]:
    """The protocols calls of 1..max_rows rows take (what a warmup compiles and loads)."""
    return (forced,) if forced else protocols_up_to(world_size, H, max_rows)


def staged_call(variant: BoundaryVariant, config: BoundaryConfig, rows: int) -> bool:
    """Whether a W > 1 call of `rows` rows takes the staged kernel (allreduce.peer)."""
    return variant.y_source == "x" and config.clusters(rows) < rows


def warmup_jobs(
    H: int,
    *,
    arch: str,
    world_size: int = 1,
    ranks_per_device: int = 1,
    variants: Sequence[BoundaryVariant] = ENGINE_VARIANTS,
    protocols: Sequence[str] = PROTOCOLS,
) -> list[WarmupJob]:
    """One warmup job per variant (and, with W > 1, per protocol of `protocols`, inline and, for a ready partial,
    staged) an engine may launch at hidden size H; each loads its kernel with one scratch launch (`load_boundary`)."""
    if world_size == 1:
        return [
            WarmupJob(
                f"boundary H={H} {variant_name(v)}",
                compile_fused_boundary,
                (H, *v, default_config(H, arch, ranks_per_device, 1, v.own_pre), 1, "oneshot"),
                (("arch", arch),),
                functools.partial(load_boundary, H=H, variant=v, world_size=1),
            )
            for v in variants
        ]
    config = default_config(H, arch, ranks_per_device, world_size)
    compiled = dict.fromkeys(  # (variant compiled, protocol, staged), once each: a staged early form is the default
        (unstaged_only(v, staged), p, staged)
        for v in variants
        for p in protocols
        for staged in ((False, True) if v.y_source == "x" else (False,))
    )
    return [
        WarmupJob(
            name=f"boundary H={H} {variant_name(v)} W={world_size} {p}" + (" staged" if staged else ""),
            compile_fn=compile_fused_boundary,
            args=(H, *v, config, world_size, p, staged),
            kwargs=(("arch", arch),),
            load=functools.partial(load_boundary, H=H, variant=v, world_size=world_size),
        )
        for v, p, staged in compiled
    ]


def load_boundary(fn: Callable[..., Any], device: Any, *, H: int, variant: BoundaryVariant, world_size: int) -> None:
    """Launch a compiled fused-boundary kernel once on one row of scratch buffers of its own, so that CUDA loads
    its module now. With peers, every peer address is this launch's own slots, which hold data (no sentinel)
    already: every wait of the exchange ends at once, and nothing outside the scratch is touched."""
    dims = concrete_dims(1, H)
    args = BoundaryArgs.build(
        H,
        variant,
        world_size,
        lambda name, dtype, shape: torch.zeros(
            [dims.get(d, d) for d in shape], dtype=TORCH_DTYPES[dtype], device=device
        ),
        1e-6,
    )
    if world_size > 1:
        args.state[STATE_CALLS], args.state[STATE_RANK], args.state[STATE_TIMEOUT_US] = 0, 0, 1000
        args.peers.fill_(args.slots.data_ptr())
    fn(*args)


class NotLoadedError(RuntimeError):
    """A peer kernel's first launch on a GPU whose other ranks may be spinning: BoundaryAllReduce.warmup() loads it."""


@dataclass(frozen=True)
class PeerArgs:
    """What a W > 1 launch takes besides the boundary's tensors: the rank's workspace and the protocol it forces
    (None: the switch's, per call)."""

    slots: torch.Tensor
    peers: torch.Tensor
    state: torch.Tensor
    world_size: int
    protocol: str | None
    ranks_per_device: int
    shared_context: bool  # the ranks share this process's CUDA context (simulated ranks)


def fused_boundary(
    variant: BoundaryVariant,
    *,
    residual: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    pre: torch.Tensor | None,
    norm_weight: torch.Tensor | None,
    norm_eps: float,
    x: torch.Tensor | None = None,
    shared: torch.Tensor | None = None,
    moe: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    new_residual: torch.Tensor,
    out: torch.Tensor | None = None,
    mxfp8_data: torch.Tensor | None = None,
    mxfp8_scale: torch.Tensor | None = None,
    fp8_data: torch.Tensor | None = None,
    fp8_scale: torch.Tensor | None = None,
    aux: torch.Tensor | None = None,
    error: torch.Tensor | None = None,
    mix_fn: torch.Tensor | None = None,
    mix_params: torch.Tensor | None = None,
    peer: PeerArgs | None = None,
    compiled: Callable[..., Any] | None = None,
    arch: str,
) -> Callable[..., Any] | None:
    """Run the fused boundary of one rank on checked arguments, writing new_residual (and out, MXFP8, FP8 1x128,
    aux), and return the compiled kernel it launched (None for no rows): the kernel of `variant`, which the caller
    decided where the call entered (its tensors must match it: the compiled kernel refuses a None where it takes a
    tensor, and the reverse).

    y is `x` (plus `shared`), or with `moe=(gemm2_permuted, expert_weights, idx)` the MoE top-k
    combine (plus `shared`, the shared-expert output); with `peer`, the rank-order sum of that partial
    over every rank. pre=None is the residual-only boundary. `post` may be [T, 4] or [T, 4, 1].
    `error` (int32 [4]) takes the device error word (needed with `moe` or `peer`). With `variant.own_pre`, `pre` is
    an output: the kernel computes it from the new streams with `mix_fn` and `mix_params` (CONTRACT §4d). `compiled`: the one-rank kernel of
    this variant, where the caller has it already (BoundaryAllReduce keeps one per variant it launched).
    """
    rows, _, H = residual.shape
    if rows == 0:
        return None
    g, ew, idx = moe if moe is not None else (None, None, None)
    if compiled is not None and peer is None:
        fn, slots, peers, state, first = compiled, None, None, None, False
    else:
        fn, slots, peers, state, first = _resolve(H, rows, variant, peer, arch)
    fn(
        residual,
        post if post.dim() == 2 else post.view(rows, HC),
        comb,
        pre,
        norm_weight if pre is not None else None,
        x,
        shared,
        g,
        ew,
        idx,
        new_residual,
        out,
        mxfp8_data,
        mxfp8_scale,
        fp8_data,
        fp8_scale,
        aux,
        slots,
        peers,
        state,
        error if moe is not None or peer else None,
        mix_fn,
        mix_params,
        float(norm_eps),
    )
    if first:
        mark_launched(fn, slots.device)  # a rank of its own GPU: this first launch loaded it, only delaying this rank
    return fn


# A kept launch's own arguments, in the order it takes them; the outputs it makes (a field, the argument it is like).
READY_INPUTS = ("residual", "post", "comb", "pre", "norm_weight", "x", "mxfp8_data", "mxfp8_scale", "eps")
READY_OUTPUTS = (("new_residual", "residual"), ("out", "x"))


def ready_launch(
    fn: Callable[..., Any], slots: Any, peers: Any, state: Any, error: Any, *, layer_input: bool
) -> Callable[..., tuple]:
    """The launch through `fn` (a kernel fused_boundary has launched) of a call on a ready partial x with no shared
    addend, aux, FP8 1x128 or own pre, its peer tensors bound (None at W = 1): (residual, post, comb, pre,
    norm_weight, x, mxfp8_data, mxfp8_scale, eps) -> (new_residual, out), out None without `layer_input`, on
    arguments the caller has tested as fused_boundary's are. The outputs are allocated like residual and x.

    Through the C entry (cute_kernels.native) where it is built, which allocates and launches in one call; else
    in Python, the same tuple spelled out for host time (a test holds both to BoundaryArgs)."""
    makes = READY_OUTPUTS if layer_input else READY_OUTPUTS[:1]
    bound = BoundaryArgs(residual=None, post=None, comb=None, slots=slots, peers=peers, state=state, error=error)
    source = {name: i for i, name in enumerate(READY_INPUTS)}
    source.update({field: -1 - source[like] for field, like in makes})
    plan = tuple(source.get(field, getattr(bound, field)) for field in BoundaryArgs._fields)
    native_launch = native.launch(fn, plan, len(READY_OUTPUTS))
    if native_launch is not None:
        return native_launch

    def launch(
        residual: Any,
        post: Any,
        comb: Any,
        pre: Any,
        norm_weight: Any,
        x: Any,
        mxfp8_data: Any,
        mxfp8_scale: Any,
        eps: float,
    ) -> tuple:
        new_residual = torch.empty_like(residual)
        out = torch.empty_like(x) if layer_input else None
        fn(
            residual,
            post,
            comb,
            pre,
            norm_weight,
            x,
            None,
            None,
            None,
            None,
            new_residual,
            out,
            mxfp8_data,
            mxfp8_scale,
            None,
            None,
            None,
            slots,
            peers,
            state,
            error,
            None,
            None,
            eps,
        )
        return new_residual, out

    return launch


def _resolve(
    H: int, rows: int, variant: BoundaryVariant, peer: PeerArgs | None, arch: str
) -> tuple[Callable[..., Any], Any, Any, Any, bool]:
    """The compiled kernel of a fused_boundary call, its peer tensors (slots, peers, state; None at W = 1), and
    whether this is a peer kernel's first launch in the process (marked once it has launched)."""
    if peer is None:
        return compiled_boundary(H, variant, arch=arch), None, None, None, False
    protocol = call_protocol(peer.world_size, H, rows, peer.protocol)
    fn = compiled_boundary(
        H,
        variant,
        arch=arch,
        world_size=peer.world_size,
        protocol=protocol,
        ranks_per_device=peer.ranks_per_device,
        rows=rows,
    )
    slots, peers, state = peer.slots, peer.peers, peer.state
    first = not launched(fn, slots.device)
    if first:
        if peer.shared_context:
            # The ranks share this context: loading the module here could wait for a peer spinning on this
            # very launch, until its timeout.
            config = default_config(H, arch, peer.ranks_per_device, peer.world_size)
            staged = " staged" if staged_call(variant, config, rows) else ""
            raise NotLoadedError(
                f"the peer boundary kernel for H={H} {variant_name(variant)} W={peer.world_size} {protocol}{staged}"
                " was never loaded onto this GPU, whose ranks share one context: call warmup() on every rank "
                "(with the max_rows, protocol and quantize forms of these calls) before the first boundary"
            )
    return fn, slots, peers, state, first
