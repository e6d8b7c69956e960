"""The per-rank buffers a boundary owns: the mailbox a GEMM may write into and the device error word."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass
class Workspace:
    """A rank's communication buffers, sized once for `max_rows` rows of `hidden_size`."""

    hidden_size: int
    max_rows: int
    device: torch.device
    mailbox: Tensor = field(init=False)
    error: Tensor = field(init=False)

    def __post_init__(self) -> None:
        self.mailbox = torch.zeros(self.max_rows, self.hidden_size, dtype=torch.bfloat16, device=self.device)
        # Non-zero once a kernel gave up waiting for a peer: 1 + the missing rank.
        self.error = torch.zeros(1, dtype=torch.int32, device=self.device)
