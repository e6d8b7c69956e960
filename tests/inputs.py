"""The tests' random inputs of one boundary, built in one place."""

from __future__ import annotations

import torch

from boundary.params import MHCParams

BF16 = torch.bfloat16


def attn_params(layer) -> MHCParams:
    """A toy layer's attention-site mHC parameters (hc_attn_*), as MHCParams."""
    return MHCParams(
        layer.hc_attn_fn,
        layer.hc_attn_scale,
        layer.hc_attn_base,
        layer.rms_norm_eps,
        layer.hc_eps,
        layer.hc_eps,
        layer.hc_post_alpha,
        layer.hc_sinkhorn_iters,
    )


def boundary_inputs(
    rows: int, hidden: int, seed: int = 0, device: str | torch.device = "cpu"
) -> dict[str, torch.Tensor]:
    """One rank's boundary inputs: the partial x, a shared addend, the streams, post / comb / pre and the norm weight
    (comb rows sum to 1, post in [0, 2), the weight near 1), drawn from one generator seeded with `seed`."""
    g = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device=device)

    return dict(
        x=randn(rows, hidden).to(BF16),
        residual=randn(rows, 4, hidden).to(BF16),
        post=torch.rand(rows, 4, generator=g, device=device) * 2,
        comb=torch.softmax(randn(rows, 4, 4), -1),
        pre=torch.rand(rows, 4, generator=g, device=device),
        norm_weight=(1 + 0.1 * randn(hidden)).to(BF16),
        shared=randn(rows, hidden).to(BF16),
    )
