"""A small simulated-rank case of the peer all-reduce for compute-sanitizer (memcheck, racecheck, synccheck).

Run as `compute-sanitizer --tool memcheck python -m tests.peer_sanitizer_case`; exits non-zero on a wrong result.
The kernels are compiled (or loaded from the disk cache) before the sanitized launches.
"""

from __future__ import annotations

import sys

import torch

from boundary import BoundaryAllReduce
from boundary import reference as ref
from cute_kernels.boundary import api
from cute_kernels.compile import warmup


def main() -> int:
    hidden = 2560
    for world in (2, 4):
        ranks = BoundaryAllReduce.simulated(hidden, world, max_rows=256, device="cuda", timeout_us=5_000_000)
        jobs = api.warmup_jobs(
            hidden, arch=ranks[0].arch, world_size=world, ranks_per_device=world, variants=[api.BoundaryVariant()]
        )  # the one variant launched here, both protocols
        warmup(jobs, progress=False, device=ranks[0].device)
        # Each protocol inline (5 rows: one per cluster) and staged (250 rows: several per cluster).
        for protocol, protocol_rows in (("oneshot", 5), ("twoshot", 5), ("oneshot", 250), ("twoshot", 250)):
            for ar in ranks:
                ar.protocol = protocol
            g = torch.Generator(device="cuda").manual_seed(world)
            residual = torch.randn(protocol_rows, 4, hidden, generator=g, device="cuda").to(torch.bfloat16)
            post = torch.rand(protocol_rows, 4, generator=g, device="cuda")
            comb = torch.softmax(torch.randn(protocol_rows, 4, 4, generator=g, device="cuda"), -1)
            pre = torch.rand(protocol_rows, 4, generator=g, device="cuda")
            w = torch.ones(hidden, dtype=torch.bfloat16, device="cuda")
            xs = [torch.randn(protocol_rows, hidden, generator=g, device="cuda").to(torch.bfloat16) for _ in ranks]
            outs = BoundaryAllReduce.run_simulated(
                ranks,
                [lambda ar: ar(xs[ar.rank], residual, post, comb, pre, w, 1e-6, None)] * world,  # noqa: B023
            )
            torch.cuda.synchronize()
            want = ref.mhc_post(ref.rank_sum(xs), residual, post, comb)
            for new, _ in outs:
                if not torch.equal(new.view(torch.int16), outs[0][0].view(torch.int16)):
                    print(f"W={world} {protocol} {protocol_rows} rows: ranks differ")
                    return 1
                if (new.float() - want.float()).abs().max() > 0.05 * want.float().abs().max():
                    print(f"W={world} {protocol} {protocol_rows} rows: wrong result")
                    return 1
            for ar in ranks:
                ar.check()
        print(f"W={world}: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
