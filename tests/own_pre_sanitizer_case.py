"""A small case of DeepSeek-V4's own-pre entry for compute-sanitizer (memcheck, racecheck, synccheck, initcheck): the
coefficients kernel's own-pre variant at 1 row (one launch: a tile's finishing CTA, its worker warps on a named barrier
beside the Sinkhorn warp) and at 5 rows (the partials schedule's finish kernel), bf16 and with each quantized form.

Also the fused boundary that computes its own pre (`BoundaryAllReduce(..., mix=)`: its second cluster exchange) at 1
and 5 rows, and on 2 simulated ranks (`--one-rank` leaves them out: initcheck runs one kernel at a time, and a
simulated rank's boundary waits for its peer's, which then never starts). Run as `compute-sanitizer --tool racecheck
python -m tests.own_pre_sanitizer_case`; exits non-zero on a result that is not the two-launch form's bits
(`mhc.mixes`, then `mhc.collapse_norm`), or for the boundary off the reference. The test runs it once unsanitized
first, so that every kernel it launches is in the disk cache and no compile runs under the tool (a compile's CuTe DSL
device probe puts API errors in memcheck's count).
"""

from __future__ import annotations

import sys

import torch

from boundary import mhc
from boundary.params import MHCParams
from boundary.types import empty_layer_input_form
from cute_kernels.compile import arch_for_device, warmup

HIDDENS = (2048, 1024)  # multiples of 1024 (every quantized form); at 1024 a pass holds two rows
FORMS = (None, "mxfp8", "fp8_1x128")


def warm(hidden: int, dev: torch.device) -> None:
    """Every kernel of the case at one H compiled (or loaded from the disk cache)."""
    warmup(
        mhc.warmup_jobs(hidden, arch_for_device(dev), 8, own_pre=True, quantized=FORMS[1:]), progress=False, device=dev
    )


def check(hidden: int, dev: torch.device) -> int:
    """The own-pre case at one H: how many (rows, form) differ from the two-launch bits."""
    warm(hidden, dev)
    g = torch.Generator(device="cuda").manual_seed(hidden)
    fn = torch.randn(24, 4 * hidden, generator=g, device="cuda") * 1e-2
    params = MHCParams(
        fn, torch.full((3,), 0.5, device="cuda"), torch.randn(24, generator=g, device="cuda"), 1e-6, 1e-6, 1e-6, 2.0, 20
    )
    weight = (1 + 0.1 * torch.randn(hidden, generator=g, device="cuda")).to(torch.bfloat16)
    bad = 0
    for rows in (1, 5):
        residual = torch.randn(rows, 4, hidden, generator=g, device="cuda").to(torch.bfloat16)
        for form in FORMS:
            outs = []
            for one_launch in (True, False):
                q = empty_layer_input_form(form, rows, hidden, dev)
                if one_launch:
                    got = mhc.own_pre(residual, params, weight, 1e-6, quantized_out=q)
                else:
                    post, comb, pre = mhc.mixes(residual, params)
                    got = (post, comb, pre, mhc.collapse_norm(residual, pre, weight, 1e-6, quantized_out=q))
                outs.append([*got, *(() if q is None else (q.data, q.scale))])
            same = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(*outs))
            print(f"own-pre H={hidden} rows={rows} form={form}: {'ok' if same else 'DIFFERS'}", flush=True)
            bad += not same
    return bad


def check_boundary(hidden: int, dev: torch.device) -> int:
    """The fused boundary that computes its own pre (one more cluster exchange) at one H: how many row counts give
    a result off the reference (R' within 1 ulp; the layer input the reference's on the kernel's own R' and pre)."""
    from boundary import BoundaryAllReduce
    from boundary import reference as ref
    from tests.bf16 import max_ulp
    from tests.inputs import boundary_inputs
    from tests.test_boundary_own_pre import own_call

    ar = BoundaryAllReduce(hidden, max_rows=8, device=dev)
    g = torch.Generator(device="cuda").manual_seed(hidden + 1)
    fn = torch.randn(4, 4 * hidden, generator=g, device="cuda") * 1e-2
    mix = mhc.mix_weights(
        fn, torch.full((1,), 0.5, device="cuda"), torch.randn(4, generator=g, device="cuda"), 1e-6, 1e-6
    )
    bad = 0
    for rows in (1, 5):
        inp = boundary_inputs(rows, hidden, rows, "cuda")
        pre = torch.empty(rows, 4, device="cuda")
        new, out = own_call(ar, inp, mix, pre)
        want = ref.mhc_post(inp["x"], inp["residual"], inp["post"], inp["comb"])
        ok = max_ulp(new, want) <= 1
        ok = ok and max_ulp(out, ref.rms_norm(ref.collapse(new, pre), inp["norm_weight"], 1e-6)) <= 1
        print(f"own-pre boundary H={hidden} rows={rows}: {'ok' if ok else 'DIFFERS'}", flush=True)
        bad += not ok
    return bad


def check_peer_boundary(dev: torch.device) -> int:
    """The own-pre boundary on 2 simulated ranks (H 2048), each protocol inline (5 rows) and staged (40 rows): how many
    cases give ranks that differ or a layer input off the reference on the ranks' own R' and pre."""
    from boundary import BoundaryAllReduce
    from boundary import reference as ref
    from cute_kernels.boundary import api
    from tests.bf16 import max_ulp
    from tests.inputs import boundary_inputs

    hidden, world = 2048, 2
    ranks = BoundaryAllReduce.simulated(hidden, world, max_rows=64, device=dev, timeout_us=5_000_000)
    variant = api.BoundaryVariant(pre=True, own_pre=True)
    jobs = api.warmup_jobs(hidden, arch=ranks[0].arch, world_size=world, ranks_per_device=world, variants=[variant])
    warmup(jobs, progress=False, device=dev)
    g = torch.Generator(device="cuda").manual_seed(7)
    fn = torch.randn(4, 4 * hidden, generator=g, device="cuda") * 1e-2
    mix = mhc.mix_weights(
        fn, torch.full((1,), 0.5, device="cuda"), torch.randn(4, generator=g, device="cuda"), 1e-6, 1e-6
    )
    bad = 0
    for protocol, rows in (("oneshot", 5), ("twoshot", 5), ("oneshot", 40), ("twoshot", 40)):
        for ar in ranks:
            ar.protocol = protocol
        inp = boundary_inputs(rows, hidden, rows, "cuda")
        xs = [torch.randn(rows, hidden, generator=g, device="cuda").to(torch.bfloat16) for _ in ranks]
        pres = [torch.empty(rows, 4, device="cuda") for _ in ranks]
        streams = (inp["residual"], inp["post"], inp["comb"])

        def call(ar, xs=xs, pres=pres, streams=streams, weight=inp["norm_weight"]):
            return ar(xs[ar.rank], *streams, None, weight, 1e-6, None, mix=mix, pre_out=pres[ar.rank])

        outs = BoundaryAllReduce.run_simulated(ranks, [call] * world)
        torch.cuda.synchronize()
        for ar in ranks:
            ar.check()
        new, out = outs[0]
        same = all(torch.equal(o[0].view(torch.int16), new.view(torch.int16)) for o in outs)
        same = same and all(torch.equal(o[1].view(torch.int16), out.view(torch.int16)) for o in outs)
        ok = same and max_ulp(out, ref.rms_norm(ref.collapse(new, pres[0]), inp["norm_weight"], 1e-6)) <= 1
        print(f"own-pre boundary W={world} {protocol} rows={rows}: {'ok' if ok else 'DIFFERS'}", flush=True)
        bad += not ok
    return bad


def main(argv: list[str]) -> int:
    dev = torch.device("cuda")
    bad = sum(check(hidden, dev) + check_boundary(hidden, dev) for hidden in HIDDENS)
    if "--one-rank" not in argv:
        bad += check_peer_boundary(dev)
    torch.cuda.synchronize()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
