"""Host side of the coefficients kernels: compiles and their cache keys, warmup jobs, the workspace and the
calls. The callers check the arguments (boundary/mhc.py does, once); nothing here checks them again."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import cutlass.cute as cute
import torch
from cutlass import BFloat16, Float8E4M3FN, Float32, Int32, Uint8

from cute_kernels import FP8_GROUP
from cute_kernels.coefficients.config import CLUSTER, HC, MIX, NV, CoefficientsConfig, projection_split
from cute_kernels.coefficients.kernel import CoefficientsKernel
from cute_kernels.coefficients.layer_input import LayerInputKernel
from cute_kernels.coefficients.projection import SENTINEL
from cute_kernels.coefficients.tuning import coefficients_config, default_row_classes
from cute_kernels.coefficients.variant import VARIANTS, CoefficientsVariant
from cute_kernels.compile import WarmupJob, compile_kernel, fake_stream, fake_tensor, jit_cache

MAX_ROWS = 16384  # rows of the largest workspace (and so of a call)


@jit_cache
def compile_coefficients(
    H: int, variant: CoefficientsVariant, sinkhorn_repeat: int, config: CoefficientsConfig, *, arch: str
) -> Callable[..., Any]:
    """Compile one coefficients variant for `arch`; the row count and the workspace sizes stay dynamic."""
    kernel = CoefficientsKernel(
        H,
        variant=variant.projection,
        layer_input=variant.layer_input,
        sinkhorn_repeat=sinkhorn_repeat,
        config=config,
        quant=variant.quant,
    )
    T = cute.sym_int()
    x = fake_tensor(BFloat16, (T, H) if variant.broadcast else (T, HC, H), divisibility=8)
    f32 = lambda shape: fake_tensor(Float32, shape, divisibility=4)  # noqa: E731
    inline = variant.inline
    q, q_scale = _fake_quantized(H, variant.quant, T)
    args = (
        x,
        f32((MIX, kernel.projection.K)),
        fake_tensor(Float32, (3,), divisibility=1),
        fake_tensor(Float32, (MIX,), divisibility=1),
        fake_tensor(Float32, (T, HC), divisibility=1),
        fake_tensor(Float32, (T, HC, HC), divisibility=1),
        fake_tensor(Float32, (T, HC), divisibility=1),
        fake_tensor(Float32, (cute.sym_int(), cute.sym_int(), NV), divisibility=1),
        fake_tensor(Int32, (cute.sym_int(),), divisibility=1),
        f32((T, HC)) if variant.collapse == "carried" else None,
        fake_tensor(BFloat16, (H,), divisibility=8) if inline and variant.normed else None,
        fake_tensor(BFloat16, (T, H), divisibility=8) if inline else None,
        q,
        q_scale,
        Float32(0.0),
        Float32(0.0),
        Float32(0.0),
        Float32(0.0),
        Float32(0.0),
    )
    return compile_kernel(kernel, *args, fake_stream(), arch=arch)


def _fake_quantized(H: int, quant: str | None, T: Any) -> tuple[Any, Any]:
    """The fake (data, scale) of a T-row layer input's quantized form `quant` (None: none)."""
    if quant is None:
        return None, None
    data = fake_tensor(Float8E4M3FN, (T, H), divisibility=16)
    if quant == "mxfp8":
        return data, fake_tensor(Uint8, (cute.sym_int(),), divisibility=4)
    return data, fake_tensor(Float32, (H // FP8_GROUP, cute.sym_int()), divisibility=4)


@jit_cache
def compile_layer_input(
    H: int, variant: CoefficientsVariant, quant: str | None = None, *, arch: str
) -> Callable[..., Any]:
    """Compile the layer-input-only kernel of an inline variant for `arch`, with the quantized form `quant` (None, or
    one of QUANT_FORMS) beside bf16; the row count stays dynamic."""
    kernel = LayerInputKernel(H, variant=variant.projection, layer_input=variant.layer_input, quant=quant)
    T = cute.sym_int()
    q, scale = _fake_quantized(H, quant, T)
    args = (
        fake_tensor(BFloat16, (T, H) if kernel.broadcast else (T, HC, H), divisibility=8),
        fake_tensor(Float32, (T, HC), divisibility=4) if variant.collapse == "carried" else None,
        fake_tensor(BFloat16, (H,), divisibility=8) if variant.normed else None,
        fake_tensor(BFloat16, (T, H), divisibility=8),
        q,
        scale,
        Float32(0.0),
    )
    return compile_kernel(kernel, *args, fake_stream(), arch=arch)


@functools.cache
def _kernel(H: int, variant: CoefficientsVariant, config: CoefficientsConfig) -> CoefficientsKernel:
    return CoefficientsKernel(H, variant=variant.projection, layer_input=variant.layer_input, config=config)


def grid_clusters(H: int, variant: CoefficientsVariant, rows: int, *, arch: str) -> int:
    """The first launch's grid y extent of a call of `rows` rows with the shipped config (at most 65535)."""
    return _kernel(H, variant, coefficients_config(H, variant, rows, arch=arch)).grid_clusters(rows)


def warmup_jobs(
    H: int,
    *,
    arch: str,
    max_rows: int,
    sinkhorn_repeat: int = 20,
    unnormed: bool = False,
    quantized: tuple[str, ...] = (),
    head_repeat: int | None = None,
) -> list[WarmupJob]:
    """WarmupJobs compiling every coefficients variant that a call of up to `max_rows` rows can need, and
    the layer-input-only kernels, of hidden size H for `arch`; each loads its kernel with one scratch launch.
    `unnormed`: the layer input without a norm weight too (the scheduler always passes one). `head_repeat` (DeepSeek-V4's
    kernels, V4Boundaries): the own-pre variant, with these `quantized` QUANT_FORMS beside bf16 too, and hc_head's
    variants with that many Sinkhorn repeats (its comb nobody reads): the standard one (head_mix's weights) and the
    own-pre one (the final boundary); `quantized` also the carried collapse's layer-input kernel in those forms."""
    variants = [v for v in VARIANTS if unnormed or v.normed]
    jobs = [job for variant in variants for job in _coefficients_jobs(H, variant, sinkhorn_repeat, max_rows, arch)]
    if head_repeat is not None:
        for quant in (None, *quantized):
            jobs += _coefficients_jobs(H, CoefficientsVariant.own(quant), sinkhorn_repeat, max_rows, arch)
        jobs += _coefficients_jobs(H, CoefficientsVariant(), head_repeat, max_rows, arch)
        jobs += _coefficients_jobs(H, CoefficientsVariant.own(), head_repeat, max_rows, arch)
    for variant in (v for v in variants if v.inline):
        load = functools.partial(load_layer_input, H=H, variant=variant)
        name = f"layer input H={H} {variant.projection} {variant.layer_input}"
        jobs.append(WarmupJob(name, compile_layer_input, (H, variant), (("arch", arch),), load))
    carried = CoefficientsVariant.of(False, True, carried=True)
    for quant in quantized:
        load = functools.partial(load_layer_input, H=H, variant=carried, quant=quant)
        name = f"layer input H={H} {carried.projection} {carried.layer_input} {quant}"
        jobs.append(WarmupJob(name, compile_layer_input, (H, carried, quant), (("arch", arch),), load))
    return jobs


def _coefficients_jobs(
    H: int, variant: CoefficientsVariant, sinkhorn_repeat: int, max_rows: int, arch: str
) -> list[WarmupJob]:
    """One coefficients variant's WarmupJobs: a compile per shipped config of the row classes up to `max_rows`."""
    jobs = []
    for rows in default_row_classes(H, variant, max_rows, arch=arch):
        config = coefficients_config(H, variant, rows, arch=arch)
        name = f"coefficients H={H} {variant.name} tile={config.rows_per_tile}"
        name += " split" if config.row_split > 1 else ""
        name += f" repeat={sinkhorn_repeat}" if sinkhorn_repeat != 20 else ""
        load = functools.partial(load_coefficients, H=H, variant=variant, rows=rows, config=config)
        key = (H, variant, sinkhorn_repeat, config)
        jobs.append(WarmupJob(name, compile_coefficients, key, (("arch", arch),), load))
    return jobs


def load_coefficients(
    compiled: Callable[..., Any],
    device: Any,
    *,
    H: int,
    variant: CoefficientsVariant,
    rows: int,
    config: CoefficientsConfig,
) -> None:
    """Launch a compiled coefficients kernel once on `rows` rows of scratch inputs and a workspace of its own, so
    that CUDA loads its module now."""
    f32 = lambda *shape: torch.zeros(*shape, dtype=torch.float32, device=device)  # noqa: E731
    workspace = CoefficientsWorkspace(H, rows, device)
    x = torch.zeros((rows, H) if variant.broadcast else (rows, HC, H), dtype=torch.bfloat16, device=device)
    inline = variant.inline
    q, q_scale = _scratch_quantized(rows, H, variant.quant, device)
    compiled(
        x,
        f32(MIX, H if variant.broadcast else HC * H),
        f32(3),
        f32(MIX),
        f32(rows, HC),
        f32(rows, HC, HC),
        f32(rows, HC),
        workspace.rank_partials if config.schedule == "partials" else workspace.partials,
        workspace.counters,
        f32(rows, HC) if variant.collapse == "carried" else None,
        torch.ones(H, dtype=torch.bfloat16, device=device) if inline and variant.normed else None,
        torch.empty(rows, H, dtype=torch.bfloat16, device=device) if inline else None,
        q,
        q_scale,
        1e-6,
        1e-6,
        1e-6,
        2.0,
        1e-6,
    )


def _scratch_quantized(rows: int, H: int, quant: str | None, device: Any) -> tuple[Any, Any]:
    """Empty (data, scale) of a `rows`-row layer input's quantized form `quant` (None: none)."""
    if quant is None:
        return None, None
    data = torch.empty(rows, H, dtype=torch.float8_e4m3fn, device=device)
    if quant == "mxfp8":
        return data, torch.empty(-(-rows // 128) * 128 * H // 32, dtype=torch.uint8, device=device)
    return data, torch.empty(H // FP8_GROUP, -(-rows // 4) * 4, dtype=torch.float32, device=device)


def load_layer_input(
    compiled: Callable[..., Any], device: Any, *, H: int, variant: CoefficientsVariant, quant: str | None = None
) -> None:
    """Launch a compiled layer-input kernel once on one row of scratch inputs, so that CUDA loads its module now."""
    x = torch.zeros((1, H) if variant.broadcast else (1, HC, H), dtype=torch.bfloat16, device=device)
    pre_mix = torch.zeros(1, HC, dtype=torch.float32, device=device) if variant.collapse == "carried" else None
    weight = torch.ones(H, dtype=torch.bfloat16, device=device) if variant.normed else None
    q, scale = _scratch_quantized(1, H, quant, device)
    compiled(x, pre_mix, weight, torch.empty(1, H, dtype=torch.bfloat16, device=device), q, scale, 1e-6)


class CoefficientsWorkspace:
    """Partials [groups, max_rows, 25] fp32, per-(tile, CTA) ticket counters (int32, zero between calls)
    and the partials schedule's per-CTA sums [groups * 8, max_rows, 25] fp32.

    One workspace serves every variant of hidden size H on one device, but one launch at a time: two
    calls that may run concurrently (e.g. the main stream and an mHC side stream) need two workspaces.
    Counters are zeroed and partial slots set to the sentinel here, and every completed launch leaves
    them so.
    """

    def __init__(self, H: int, max_rows: int, device: Any) -> None:
        self.H = H
        self.max_rows = max_rows
        self.groups = max(projection_split(H, False)[1], projection_split(H, True)[1])
        # Every slot holds the sentinel between calls (the ticket handoff polls for it to change).
        self.partials = torch.full((self.groups, max_rows, NV), SENTINEL, dtype=torch.int32, device=device).view(
            torch.float32
        )
        # Sized for the smallest tile (16 rows), so any rows_per_tile fits.
        self.counters = torch.zeros((-(-max_rows // 16) * CLUSTER,), dtype=torch.int32, device=device)
        # The partials schedule's per-CTA sums [G * 8, max_rows, 25] (6.5 MB at H 7168 x 512 rows):
        # written by its first launch and read by its second within one call.
        self.rank_partials = torch.empty((self.groups * CLUSTER, max_rows, NV), dtype=torch.float32, device=device)
        self.device = self.partials.device

    def reset(self) -> None:
        """Zero the ticket counters and clear the partials (only needed after a launch was aborted)."""
        self.counters.zero_()
        self.partials.view(torch.int32).fill_(SENTINEL)


def mhc_coefficients(
    x: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    *,
    rms_eps: float,
    pre_eps: float,
    sinkhorn_eps: float,
    post_mult: float,
    sinkhorn_repeat: int,
    broadcast: bool,
    workspace: CoefficientsWorkspace,
    post_out: torch.Tensor,
    comb_out: torch.Tensor,
    pre_out: torch.Tensor,
    pre_mix: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    norm_eps: float | None = None,
    layer_input_out: torch.Tensor | None = None,
    own_pre: bool = False,
    quant: str | None = None,
    quant_data: torch.Tensor | None = None,
    quant_scale: torch.Tensor | None = None,
    arch: str,
    config: CoefficientsConfig | None = None,
    stream: torch.cuda.Stream | None = None,
) -> None:
    """Write post [T,4], comb [T,4,4] and next pre [T,4] of CONTRACT §3, and with `layer_input_out` the layer input.

    `x` is the streams [T, 4, H] bf16 with `fn` [24, 4H], or with `broadcast` the first layer's embedding
    [T, H] with `fn_broadcast` [24, H]. With `layer_input_out` [T, H] bf16 (inline form) the kernel also
    writes RMSNorm_w(c), or c itself when `norm_weight` is None: c = bf16(sum_j pre_mix[t, j] * R[t, j]), or
    R[t, 0] exactly when `pre_mix` is None (the embedding row itself with `broadcast`). With `own_pre` (DeepSeek-V4,
    the streams, a norm weight) c = bf16(sum_j pre[t, j] * R[t, j]) with the pre this launch writes, normed, and with
    `quant` (one of QUANT_FORMS) also its quantized form into `quant_data` [T, H] e4m3 and `quant_scale` (CONTRACT §4 /
    §4b layouts). `config` None is the shipped config for the row
    count. One launch (two with schedule "partials") on the current torch stream, or on `stream` when
    given (the caller orders `stream` after the producer of `x` and joins it before reading the
    outputs). Outputs may not alias inputs; `post_out` may also be [T, 4, 1].
    """
    rows = x.shape[0]
    if rows == 0:
        return
    H = x.shape[-1]
    if own_pre:
        variant = CoefficientsVariant.own(quant)
    else:
        variant = CoefficientsVariant.of(
            broadcast, layer_input_out is not None, pre_mix is not None, norm_weight is not None
        )
    if config is None:
        config = coefficients_config(H, variant, rows, arch=arch)
    compiled = compile_coefficients(H, variant, sinkhorn_repeat, config, arch=arch)
    if post_out.dim() == 3:
        post_out = post_out.view(rows, HC)
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        compiled(
            x,
            fn,
            scale,
            base,
            post_out,
            comb_out,
            pre_out,
            workspace.rank_partials if config.schedule == "partials" else workspace.partials,
            workspace.counters,
            pre_mix if variant.collapse == "carried" else None,
            norm_weight if variant.inline else None,
            layer_input_out,
            quant_data if variant.quant is not None else None,
            quant_scale if variant.quant is not None else None,
            float(rms_eps),
            float(pre_eps),
            float(sinkhorn_eps),
            float(post_mult),
            float(norm_eps) if norm_eps is not None else 0.0,
        )


def mhc_layer_input(
    x: torch.Tensor,
    pre_mix: torch.Tensor | None,
    norm_weight: torch.Tensor | None,
    norm_eps: float,
    out: torch.Tensor,
    *,
    arch: str,
    broadcast: bool = False,
    stream: torch.cuda.Stream | None = None,
    quant: str | None = None,
    quant_data: torch.Tensor | None = None,
    quant_scale: torch.Tensor | None = None,
) -> None:
    """Write the layer input alone: out = RMSNorm_w(c), or c itself when `norm_weight` is None;
    c = bf16(sum_j pre_mix[t, j] * R[t, j]), or R[t, 0] exactly when `pre_mix` is None (the embedding row
    itself with `broadcast`, x then [T, H]). With `quant` (one of QUANT_FORMS; a normed carried collapse) also its
    quantized form into `quant_data` [T, H] e4m3 and `quant_scale` (CONTRACT §4 / §4b layouts).

    The same bits as the inline form of `mhc_coefficients`, without the projection and without a
    workspace: the scheduler runs it on the main stream while the projection runs on a side stream
    (first layer, Engram seams). One launch on the current torch stream, or on `stream`.
    """
    if x.shape[0] == 0:
        return
    variant = CoefficientsVariant.of(broadcast, True, pre_mix is not None, norm_weight is not None)
    compiled = compile_layer_input(x.shape[-1], variant, quant, arch=arch)
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        compiled(
            x,
            pre_mix if variant.collapse == "carried" else None,
            norm_weight,
            out,
            quant_data,
            quant_scale,
            float(norm_eps),
        )
