"""A toy DeepSeek-V4.1-like decode model (random weights, real shapes) and two ways to run a step.

`decode_step` drives the boundaries through `Boundaries`; `decode_step_plain` writes the same
step out from the contract formulas with no scheduler, no fused boundary and no side streams. On
the reference path the two agree bit for bit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from boundary import reference
from boundary.scheduler import Boundaries, DecodeStep
from boundary.types import MoEOutput, QuantizedActivation, UnfinalizedMoEOutput
from boundary.v4 import V4Boundaries

BF16 = torch.bfloat16
F32 = torch.float32


@dataclass(frozen=True)
class ToyConfig:
    """The toy model's sizes; the defaults are DeepSeek-V4.1-Flash's boundary shapes."""

    hidden_size: int = 5120
    num_layers: int = 4
    hc: int = 4
    attn_width: int = 512
    num_experts: int = 8
    top_k: int = 4
    expert_width: int = 128
    shared_width: int = 128
    engram_layers: tuple[int, ...] = (1,)
    capacity_factor: float = 0.75
    vocab: int = 512
    rms_norm_eps: float = 1e-20
    hc_eps: float = 1e-6
    hc_post_alpha: float = 2.0
    hc_sinkhorn_iters: int = 20
    seed: int = 0


@dataclass
class ToyNorm:
    """An RMSNorm's weight and epsilon."""

    weight: Tensor
    variance_epsilon: float


@dataclass
class ToyLayer:
    """One decoder layer: the mHC parameters of CONTRACT §5 and this rank's shards of the sublayers."""

    index: int
    hc_mult: int
    hc_attn_fn: Tensor
    hc_attn_fn_broadcast: Tensor | None
    hc_attn_scale: Tensor
    hc_attn_base: Tensor
    hc_ffn_fn: Tensor
    hc_ffn_scale: Tensor
    hc_ffn_base: Tensor
    attn_norm: ToyNorm
    ffn_norm: ToyNorm
    rms_norm_eps: float
    hc_eps: float
    hc_post_alpha: float
    hc_sinkhorn_iters: int
    wq: Tensor
    wo_b: Tensor
    router: Tensor
    w_up: Tensor
    w_down: Tensor
    ws_up: Tensor
    ws_down: Tensor
    engram: bool
    engram_table: Tensor | None
    engram_gate: Tensor | None
    mhc_stream: Any = field(default=None, repr=False)


class StepOutput(NamedTuple):
    """What a decode step yields: the final hidden state and the last layer's MoE-input extras (the V4 step has no
    aux)."""

    hidden: Tensor
    moe_input_mxfp8: QuantizedActivation
    aux: Tensor | None


def sharded_widths(config: ToyConfig) -> dict[str, int]:
    """The widths that the toy splits over the TP ranks: each must divide by the world size."""
    return {"attn_width": config.attn_width, "expert_width": config.expert_width, "shared_width": config.shared_width}


def world_sizes(config: ToyConfig, limit: int) -> list[int]:
    """The TP world sizes up to `limit` that every sharded width divides by."""
    return [w for w in range(1, limit + 1) if all(width % w == 0 for width in sharded_widths(config).values())]


def _shard(full: Tensor, dim: int, rank: int, world: int) -> Tensor:
    size = full.shape[dim] // world
    return full.narrow(dim, rank * size, size).contiguous()


class ToyModel:
    """The toy decoder of one TP rank: embedding, layers and the final norm, all seeded."""

    def __init__(self, config: ToyConfig, *, rank: int = 0, world_size: int = 1, device: Any = "cpu") -> None:
        c = config
        for name, width in sharded_widths(c).items():
            if width % world_size:
                raise ValueError(f"{name}={width} must divide by the TP world size {world_size}")
        self.config, self.rank, self.world_size = c, rank, world_size
        self.device = torch.device(device)
        gen = torch.Generator().manual_seed(c.seed)
        hidden, hc = c.hidden_size, c.hc

        def randn(*shape: int, std: float, dtype: torch.dtype = BF16) -> Tensor:
            return (torch.randn(*shape, generator=gen) * std).to(dtype)

        self.embed = randn(c.vocab, hidden, std=1.0).to(self.device)
        self.final_norm = ToyNorm((1 + randn(hidden, std=0.1, dtype=F32)).to(BF16).to(self.device), c.rms_norm_eps)
        self.layers: list[ToyLayer] = []
        # One side stream for every layer's coefficients: they run one after another anyway, and W simulated ranks
        # then need 2 W streams, within the hardware queues (CONTRACT §7).
        side = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        for index in range(c.num_layers):
            attn_fn = randn(24, hc * hidden, std=0.01, dtype=F32)
            weights = dict(
                hc_attn_fn=attn_fn,
                hc_attn_fn_broadcast=attn_fn.view(24, hc, hidden).sum(1) if index == 0 else None,
                hc_attn_scale=torch.tensor([0.5, 0.5, 0.5]) + randn(3, std=0.05, dtype=F32),
                hc_attn_base=randn(24, std=0.5, dtype=F32),
                hc_ffn_fn=randn(24, hc * hidden, std=0.01, dtype=F32),
                hc_ffn_scale=torch.tensor([0.5, 0.5, 0.5]) + randn(3, std=0.05, dtype=F32),
                hc_ffn_base=randn(24, std=0.5, dtype=F32),
                wq=_shard(randn(hidden, c.attn_width, std=hidden**-0.5), 1, rank, world_size),
                wo_b=_shard(randn(c.attn_width, hidden, std=0.5 * c.attn_width**-0.5), 0, rank, world_size),
                router=randn(hidden, c.num_experts, std=hidden**-0.5, dtype=F32),
                w_up=_shard(randn(c.num_experts, hidden, c.expert_width, std=hidden**-0.5), 2, rank, world_size),
                w_down=_shard(
                    randn(c.num_experts, c.expert_width, hidden, std=0.5 * c.expert_width**-0.5), 1, rank, world_size
                ),
                ws_up=_shard(randn(hidden, c.shared_width, std=hidden**-0.5), 1, rank, world_size),
                ws_down=_shard(randn(c.shared_width, hidden, std=0.5 * c.shared_width**-0.5), 0, rank, world_size),
            )
            engram = index in c.engram_layers and index > 0
            norms = [ToyNorm((1 + randn(hidden, std=0.1, dtype=F32)).to(BF16), c.rms_norm_eps) for _ in range(2)]
            table = randn(c.vocab, hidden, std=0.5) if engram else None
            gate = torch.rand(hc, generator=gen) if engram else None
            moved = {k: (v.to(self.device) if isinstance(v, Tensor) else v) for k, v in weights.items()}
            for norm in norms:
                norm.weight = norm.weight.to(self.device)
            self.layers.append(
                ToyLayer(
                    index=index,
                    hc_mult=hc,
                    attn_norm=norms[0],
                    ffn_norm=norms[1],
                    rms_norm_eps=c.rms_norm_eps,
                    hc_eps=c.hc_eps,
                    hc_post_alpha=c.hc_post_alpha,
                    hc_sinkhorn_iters=c.hc_sinkhorn_iters,
                    engram=engram,
                    engram_table=None if table is None else table.to(self.device),
                    engram_gate=None if gate is None else gate.to(self.device),
                    mhc_stream=side,
                    **moved,
                )
            )
        # DeepSeek-V4's hc_head (V4Head): drawn last, so the layers' weights are those of a model without it.
        self.hc_head_fn = randn(hc, hc * hidden, std=0.01, dtype=F32).to(self.device)
        self.hc_head_scale = (torch.tensor([0.5]) + randn(1, std=0.05, dtype=F32)).to(self.device)
        self.hc_head_base = randn(hc, std=0.5, dtype=F32).to(self.device)
        self.rms_norm_eps, self.hc_eps = c.rms_norm_eps, c.hc_eps

    def attention(self, layer: ToyLayer, x: Tensor) -> Tensor:
        """The attention stand-in: a column-parallel projection, then the row-parallel wo_b (a TP partial)."""
        return F.silu(x @ layer.wq) @ layer.wo_b

    def moe(self, layer: ToyLayer, x: Tensor) -> MoEOutput:
        """The MoE stand-in: top-k routing, experts over permuted rows, unfinalized (TP partials).

        Every shape is fixed by the row count (no host synchronisation), so a decode step can be
        captured in a CUDA graph.
        """
        c = self.config
        rows, pairs = x.shape[0], x.shape[0] * c.top_k
        logits = x.to(F32) @ layer.router
        top_logits, top_experts = logits.topk(c.top_k, dim=-1)
        weights = torch.softmax(top_logits, dim=-1) * 1.5
        capacity = max(1, math.ceil(pairs / c.num_experts * c.capacity_factor))
        flat_experts = top_experts.reshape(-1)
        # Pairs sorted by expert (stable in pair order): the permuted row of a pair is its sorted position.
        order = torch.argsort(flat_experts * pairs + torch.arange(pairs, device=x.device))
        sorted_experts = flat_experts[order]
        rank_in_expert = torch.arange(pairs, device=x.device) - torch.searchsorted(sorted_experts, sorted_experts)
        position = torch.empty(pairs, dtype=torch.int64, device=x.device)
        position[order] = torch.arange(pairs, device=x.device)
        kept = torch.empty(pairs, dtype=torch.bool, device=x.device)
        kept[order] = rank_in_expert < capacity  # over an expert's capacity a pair is dropped: index -1
        permuted_idx = torch.where(kept, position, -1).to(torch.int32).view(rows, c.top_k)
        # Every expert on every row (tiny experts), then each pair's row gathered into its slot.
        up = F.silu(torch.einsum("th,ehi->eti", x, layer.w_up))
        dense = torch.einsum("eti,eih->eth", up, layer.w_down)
        token_of_sorted = order // c.top_k
        hidden = torch.full((pairs + 2, c.hidden_size), 7.0, dtype=BF16, device=x.device)  # +2 unread padding rows
        hidden[:pairs] = dense[sorted_experts, token_of_sorted]
        shared = F.silu(x @ layer.ws_up) @ layer.ws_down
        routed = UnfinalizedMoEOutput(hidden, weights.contiguous(), permuted_idx)
        return MoEOutput(routed=routed, shared_output=shared)

    def engram_inject(self, layer: ToyLayer, streams: Tensor, tokens: Tensor) -> Tensor:
        """The Engram stand-in (model code): each stream gets a gated table row added."""
        value = layer.engram_table[tokens].to(F32)
        out = streams.to(F32) + layer.engram_gate.view(1, -1, 1) * value.unsqueeze(1)
        return out.to(BF16)


def decode_step(
    model: ToyModel, boundaries: Boundaries, tokens: Tensor, step: DecodeStep, *, capture_mxfp8: bool = True
) -> StepOutput:
    """One decode step driven by the boundary scheduler (the CONTRACT §3 layer loop)."""
    layers = model.layers
    state, x = boundaries.first(layers[0], model.embed[tokens], step)
    quantized = aux = None
    last = len(layers) - 1
    for index, layer in enumerate(layers):
        if index > 0 and layer.engram:
            streams = boundaries.post_only(state)
            streams = model.engram_inject(layer, streams, tokens)
            state, x = boundaries.pre(layer, streams, state, step)
        elif index > 0:
            state, x, _, _ = boundaries.sublayer(layer, False, state, step)
        state.pending = model.attention(layer, x)
        boundaries.join(layer, step)
        state, x, q, a = boundaries.sublayer(
            layer,
            True,
            state,
            step,
            quantize="mxfp8" if capture_mxfp8 and index == last else None,
            capture_aux=index == last,
        )
        if index == last:
            quantized, aux = q, a
        state.pending = model.moe(layer, x)
        boundaries.join(layer, step)
    hidden = boundaries.final(state, model.final_norm.weight, model.final_norm.variance_epsilon)
    return StepOutput(hidden, quantized, aux)


def _all_reduce_in_rank_order(partial: Tensor, group: Any, world_size: int) -> Tensor:
    """y = bf16(sum of every rank's partial in fp32, in rank order 0..W-1)."""
    if world_size == 1:
        return partial
    parts = [
        torch.empty(partial.shape[0], partial.shape[1] // 2, dtype=torch.int32, device=partial.device)
        for _ in range(world_size)
    ]
    dist.all_gather(parts, reference.bf16_words(partial), group=group)
    acc = parts[0].view(BF16).to(F32)
    for p in parts[1:]:
        acc = acc + p.view(BF16).to(F32)
    return acc.to(BF16)


def _finalize_plain(out: MoEOutput) -> Tensor:
    """bf16(sum_i w[t,i] * rows[idx[t,i]] + shared[t]), skipping index -1, fp32 in slot order."""
    routed = out.routed
    rows, top_k = routed.expert_weights.shape
    acc = torch.zeros(rows, routed.gemm2_permuted.shape[1], dtype=F32, device=routed.gemm2_permuted.device)
    for t in range(rows):
        for i in range(top_k):
            p = int(routed.expanded_idx_to_permuted_idx[t, i])
            if p >= 0:
                acc[t] = acc[t] + routed.expert_weights[t, i] * routed.gemm2_permuted[p].to(F32)
    return (acc + out.shared_output.to(F32)).to(BF16)


def _post_plain(y: Tensor, streams: Tensor, post: Tensor, comb: Tensor) -> Tensor:
    """R'[j] = bf16(post[j]*y + sum_k comb[k, j]*R[k])."""
    new = torch.empty_like(streams)
    for j in range(streams.shape[1]):
        acc = post[:, j : j + 1] * y.to(F32)
        for k in range(streams.shape[1]):
            acc = acc + comb[:, k, j : j + 1] * streams[:, k].to(F32)
        new[:, j] = acc.to(BF16)
    return new


def _input_plain(streams: Tensor, pre: Tensor, weight: Tensor, eps: float) -> Tensor:
    """bf16(c * rsqrt(mean(c^2) + eps) * w) with c = bf16(sum_j pre[j]*R[j])."""
    acc = pre[:, 0:1] * streams[:, 0].to(F32)
    for j in range(1, streams.shape[1]):
        acc = acc + pre[:, j : j + 1] * streams[:, j].to(F32)
    c = acc.to(BF16).to(F32)
    inv = torch.rsqrt(reference.row_square_sums(c) / c.shape[-1] + eps)  # (its halves: one order at any batch)
    return (c * inv * weight.to(F32)).to(BF16)


def decode_step_plain(model: ToyModel, tokens: Tensor, *, group: Any = None) -> StepOutput:
    """The same decode step written out from the contract formulas, with no scheduler and no side streams."""
    world = dist.get_world_size(group) if group is not None else 1
    layers = model.layers

    def mixes(layer: ToyLayer, source: Tensor, fn: Tensor, scale: Tensor, base: Tensor) -> reference.Coefficients:
        return reference.mhc_coefficients(
            source,
            fn,
            scale,
            base,
            layer.rms_norm_eps,
            layer.hc_eps,
            layer.hc_eps,
            layer.hc_post_alpha,
            layer.hc_sinkhorn_iters,
        )

    embedding = model.embed[tokens]
    first = layers[0]
    streams = embedding.unsqueeze(1).expand(-1, first.hc_mult, -1).contiguous()
    post, comb, pre = mixes(first, embedding, first.hc_attn_fn_broadcast, first.hc_attn_scale, first.hc_attn_base)
    one_hot = torch.zeros_like(pre)
    one_hot[:, 0] = 1.0
    x = _input_plain(streams, one_hot, first.attn_norm.weight, first.attn_norm.variance_epsilon)
    moe_out: MoEOutput | None = None
    quantized = aux = None
    for index, layer in enumerate(layers):
        if index > 0:
            y = _all_reduce_in_rank_order(_finalize_plain(moe_out), group, world)
            streams = _post_plain(y, streams, post, comb)
            if layer.engram:
                streams = model.engram_inject(layer, streams, tokens)
            x = _input_plain(streams, pre, layer.attn_norm.weight, layer.attn_norm.variance_epsilon)
            post, comb, pre = mixes(
                layer, streams.flatten(1), layer.hc_attn_fn, layer.hc_attn_scale, layer.hc_attn_base
            )
        y = _all_reduce_in_rank_order(model.attention(layer, x), group, world)
        streams = _post_plain(y, streams, post, comb)
        x = _input_plain(streams, pre, layer.ffn_norm.weight, layer.ffn_norm.variance_epsilon)
        post, comb, pre = mixes(layer, streams.flatten(1), layer.hc_ffn_fn, layer.hc_ffn_scale, layer.hc_ffn_base)
        if index == len(layers) - 1:
            data, scale = reference.mxfp8_quantize(x)
            quantized = QuantizedActivation(data, scale, BF16, x.shape, "plain")
            total = streams[:, 0].to(F32)
            for j in range(1, streams.shape[1]):
                total = total + streams[:, j].to(F32)
            aux = (total / streams.shape[1]).to(BF16)
        moe_out = model.moe(layer, x)
    y = _all_reduce_in_rank_order(_finalize_plain(moe_out), group, world)
    streams = _post_plain(y, streams, post, comb)
    hidden = _input_plain(streams, pre, model.final_norm.weight, model.final_norm.variance_epsilon)
    return StepOutput(hidden, quantized, aux)


def decode_step_v4(
    model: ToyModel, boundaries: V4Boundaries, tokens: Tensor, step: DecodeStep, *, capture_mxfp8: bool = True
) -> StepOutput:
    """One DeepSeek-V4 decode step driven by V4Boundaries (own pre at every site, hc_head before the final norm)."""
    layers = model.layers
    state, x = boundaries.first(layers[0], model.embed[tokens], step)
    quantized = None
    last = len(layers) - 1
    for index, layer in enumerate(layers):
        if index > 0 and layer.engram:
            streams = model.engram_inject(layer, boundaries.post_only(state), tokens)
            state, x = boundaries.pre(layer, streams, state, step)
        elif index > 0:
            state, x, _ = boundaries.sublayer(layer, False, state, step)
        state.pending = model.attention(layer, x)
        form = "mxfp8" if capture_mxfp8 and index == last else False
        state, x, q = boundaries.sublayer(layer, True, state, step, quantize=form)
        if index == last:
            quantized = q
        state.pending = model.moe(layer, x)
    hidden = boundaries.final(state, model, model.final_norm)
    return StepOutput(hidden, quantized, None)  # type: ignore[arg-type]


def decode_step_v4_plain(model: ToyModel, tokens: Tensor, *, group: Any = None) -> StepOutput:
    """The same V4 step written out from the formulas (CONTRACT §4d), with no scheduler."""
    world = dist.get_world_size(group) if group is not None else 1
    layers = model.layers

    def enter(
        layer: ToyLayer, streams: Tensor, ffn: bool, embedding: Tensor | None = None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """(post, comb, layer input): the mixes of the streams (of the embedding with the broadcast fn), the streams
        collapsed with their own pre, the sublayer's norm."""
        kind = "ffn" if ffn else "attn"
        post, comb, pre = reference.mhc_coefficients(
            streams.flatten(1) if embedding is None else embedding,
            getattr(layer, f"hc_{kind}_fn") if embedding is None else layer.hc_attn_fn_broadcast,
            getattr(layer, f"hc_{kind}_scale"),
            getattr(layer, f"hc_{kind}_base"),
            layer.rms_norm_eps,
            layer.hc_eps,
            layer.hc_eps,
            layer.hc_post_alpha,
            layer.hc_sinkhorn_iters,
        )
        norm = layer.ffn_norm if ffn else layer.attn_norm
        return post, comb, _input_plain(streams, pre, norm.weight, norm.variance_epsilon)

    embedding = model.embed[tokens]
    streams = embedding.unsqueeze(1).expand(-1, layers[0].hc_mult, -1).contiguous()
    post, comb, x = enter(layers[0], streams, False, embedding)
    moe_out: MoEOutput | None = None
    quantized = None
    for index, layer in enumerate(layers):
        if index > 0:
            y = _all_reduce_in_rank_order(_finalize_plain(moe_out), group, world)
            streams = _post_plain(y, streams, post, comb)
            if layer.engram:
                streams = model.engram_inject(layer, streams, tokens)
            post, comb, x = enter(layer, streams, False)
        y = _all_reduce_in_rank_order(model.attention(layer, x), group, world)
        streams = _post_plain(y, streams, post, comb)
        post, comb, x = enter(layer, streams, True)
        if index == len(layers) - 1:
            data, scale = reference.mxfp8_quantize(x)
            quantized = QuantizedActivation(data, scale, BF16, x.shape, "plain")
        moe_out = model.moe(layer, x)
    y = _all_reduce_in_rank_order(_finalize_plain(moe_out), group, world)
    streams = _post_plain(y, streams, post, comb)

    # hc_head: p = sigmoid(scale * (fn . x) * rsqrt(mean(x^2) + eps) + base) + hc_eps over the flattened streams
    p = reference.hc_head_mix(  # (the reference's: its bits do not depend on the row count, CONTRACT §6)
        streams, model.hc_head_fn, model.hc_head_scale, model.hc_head_base, model.rms_norm_eps, model.hc_eps
    )
    hidden = _input_plain(streams, p, model.final_norm.weight, model.final_norm.variance_epsilon)
    return StepOutput(hidden, quantized, None)  # type: ignore[arg-type]


def compare(a: StepOutput, b: StepOutput) -> dict[str, float | bool]:
    """How two step outputs differ: bitwise equality of everything and the largest hidden difference."""
    if (a.aux is None) != (b.aux is None):
        raise ValueError("one step output has an aux and the other has none: steps of two schemes")
    same = (
        torch.equal(a.hidden.view(torch.int16), b.hidden.view(torch.int16))
        and (a.aux is None or torch.equal(a.aux.view(torch.int16), b.aux.view(torch.int16)))
        and torch.equal(a.moe_input_mxfp8.data.view(torch.uint8), b.moe_input_mxfp8.data.view(torch.uint8))
        and torch.equal(a.moe_input_mxfp8.scale, b.moe_input_mxfp8.scale)
    )
    diff = (a.hidden.to(F32) - b.hidden.to(F32)).abs()
    scale = b.hidden.to(F32).abs().max().clamp(min=1e-30)
    return {"bitwise": same, "max_abs": float(diff.max()), "max_rel": float(diff.max() / scale)}


def random_tokens(model: ToyModel, rows: int, step_index: int) -> Tensor:
    """The same token ids on every rank for a given step."""
    gen = torch.Generator().manual_seed(1000 + step_index)
    return torch.randint(0, model.config.vocab, (rows,), generator=gen).to(model.device)


__all__ = [
    "StepOutput",
    "ToyConfig",
    "ToyLayer",
    "ToyModel",
    "compare",
    "decode_step",
    "decode_step_plain",
    "decode_step_v4",
    "decode_step_v4_plain",
    "random_tokens",
    "sharded_widths",
    "world_sizes",
]
