"""The tests' random inputs of one boundary, built in one place."""

from __future__ import annotations

import torch

BF16 = torch.bfloat16


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
