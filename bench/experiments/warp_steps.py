"""Per-warp step times from a `peer_trace --warp-stamps --dump` file (each warp's clock64, on its own SM):
`python -m bench.experiments.warp_steps DUMP` (the analysis of docs/perf-log.md v19)."""

from __future__ import annotations

import argparse

import torch

STALL_US = 0.6  # a step longer than this is a stall (the shuffles take 0.12-0.15 us at the median)


def ns_per_cycle(t: torch.Tensor, c: torch.Tensor, ok: torch.Tensor, first: int, last: int) -> float:
    """The run's own clock: globaltimer ns over clock64 cycles between two events of the warps in `ok`."""
    return float((t[..., last] - t[..., first])[ok].sum() / (c[..., last] - c[..., first])[ok].sum())


def steps(stamps: torch.Tensor, events: list[str]) -> dict[str, torch.Tensor]:
    """us of each step between successive events, per (rank, call, CTA, warp), for the warps that stamped all."""
    t, c = stamps[..., 0].double(), stamps[..., 1].double()
    ok = (c > 0).all(-1)
    ns = ns_per_cycle(t, c, ok, 0, len(events) - 1)
    return {
        f"{a}->{b}": ((c[..., i + 1] - c[..., i]) * ns / 1e3)[ok] for i, (a, b) in enumerate(zip(events, events[1:]))
    }


def stalled_warps(stamps: torch.Tensor, events: list[str]) -> dict[str, list[int]]:
    """For the warps whose streams -> shuffles step stalled: their order among their CTA's warps by streams stored,
    and how many of their CTA's warps had sent their sum (were in the cluster wait) by then; and the latter over
    every warp."""
    warps = int((stamps[..., 1] > 0).any(-1).flatten(0, 2).any(0).sum())  # the CTA's warps (cells past them: 0)
    c = stamps[..., :warps, :, 1].double()
    ok = (c > 0).all(-1).all(-1)  # CTAs whose warps all stamped every event
    computed, shuffled, sent = (events.index(e) for e in ("computed", "shuffled", "sent"))
    t = stamps[..., :warps, :, 0].double()
    ns = ns_per_cycle(t, c, ok.unsqueeze(-1).expand(c.shape[:-1]), 0, len(events) - 1)
    stall = (c[..., shuffled] - c[..., computed]) * ns / 1e3 > STALL_US
    order = c[..., computed].argsort(-1).argsort(-1)
    waiting = (c[..., sent].unsqueeze(-1) < c[..., computed].unsqueeze(-2)).sum(-2)
    every = ok.unsqueeze(-1).expand_as(waiting)
    m = stall & every
    return {
        "stalled": [int(m.sum())],
        "order": torch.bincount(order[m], minlength=warps).tolist(),
        "waiting": torch.bincount(waiting[m], minlength=warps).tolist(),
        "waiting, every warp": torch.bincount(waiting[every], minlength=warps).tolist(),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.experiments.warp_steps", description=__doc__.splitlines()[0])
    p.add_argument("dump")
    args = p.parse_args(argv)
    d = torch.load(args.dump)
    events = list(d["warp_events"])
    for key, stamps in d["warp_stamps"].items():
        world, hidden, rows, name = key
        print(f"== W={world} H={hidden} rows={rows} {name} (SIMULATED ranks on one GPU)")
        for step, us in steps(stamps, events).items():
            q = [float(us.quantile(x)) for x in (0.5, 0.9, 0.99)]
            print(
                f"  {step:>20}  med {q[0]:.3f}  p90 {q[1]:.3f}  p99 {q[2]:.3f}  max {float(us.max()):.3f}  "
                f">{STALL_US} us {float((us > STALL_US).double().mean()):.4f}"
            )
        who = stalled_warps(stamps, events)
        print(
            f"  stalled streams->shuffles: {who['stalled'][0]}; order in CTA by streams stored {who['order']}; "
            f"CTA warps already in the cluster wait {who['waiting']} (every warp: {who['waiting, every warp']})"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
