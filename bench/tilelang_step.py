"""DeepSeek's TileLang mHC kernels (tile-kernels: the path vLLM runs on SM90) as the decode-step baseline (#30), in a
process of their own (their tvm-ffi differs from CuTe DSL's): per boundary `mhc_post_fwd`, the projection as a torch
TF32 matmul with the rows' sums of squares (vLLM runs DeepGEMM there), `mhc_pre_big_fuse_fwd` (post, comb and the
collapse with the row's own pre), and torch's RMSNorm of the layer input (the model's attention / FFN norm, which the
fused boundary includes). A step is as many boundaries as the toy step's boundaries-only model has (bench.step), on
fixed inputs, in one CUDA graph per row count, timed as bench's GraphTimer times ours. At TP > 1, SIMULATED ranks:
each rank's step on its own stream of the one GPU, every boundary after the rank's exchange (the rank-order sum of
its partial and the others', as the eager baseline's; bench.step).

Every second boundary follows the MoE sublayer, as in the toy step: there the partial is first finalized as an
unfused engine does it, vLLM's `moe_sum` over the top-k expert rows (the routing weights applied in GEMM2, rows in
token order) plus the shared expert's output, two torch kernels; the fused boundary reads the same expert rows itself.
The step also runs the toy step's model code that is no boundary, the same torch ops on the same shapes: the embedding
broadcast to the HC streams and one Engram injection (a gated table row added to every stream).

    PYTHONPATH=/tmp/tl:. python3 -m bench.tilelang_step --out tilelang.json
    python -m bench --parts step --tilelang-json tilelang.json      (in the CuTe DSL process: the step table's column)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import torch

from bench.timing import GraphTimer, on_streams

HC = 4
TOP_K = 4  # experts per token of the toy step (boundary.toy.ToyConfig.top_k)
VOCAB = 512  # rows of the toy's embedding and Engram tables (boundary.toy.ToyConfig.vocab)
EPS = dict(rms_eps=1e-20, mhc_pre_eps=1e-6, mhc_sinkhorn_eps=1e-6, mhc_post_mult_value=2.0, sinkhorn_repeat=20)


def boundary_inputs(rows: int, hidden: int, device: torch.device, seed: int, top_k: int = 0) -> dict[str, torch.Tensor]:
    """One boundary's inputs (the partial, or with `top_k` the MoE's weighted expert rows and shared output; the
    streams, the carried mixes, the projection's weights) and outputs."""
    g = torch.Generator(device=device).manual_seed(seed)
    moe = {}
    if top_k:
        moe["routed"] = (torch.randn(rows, top_k, hidden, generator=g, device=device) * 0.25).to(torch.bfloat16)
        moe["shared"] = torch.randn(rows, hidden, generator=g, device=device).to(torch.bfloat16)
    return moe | dict(
        x=torch.randn(1, rows, hidden, generator=g, device=device).to(torch.bfloat16),
        residual=torch.randn(1, rows, HC, hidden, generator=g, device=device).to(torch.bfloat16),
        post=torch.rand(1, rows, HC, 1, generator=g, device=device) * 2,
        comb=torch.softmax(torch.randn(1, rows, HC, HC, generator=g, device=device), -1),
        fn=torch.randn(HC * (2 + HC), HC * hidden, generator=g, device=device) * 1e-2,
        scale=torch.full((3,), 0.5, device=device),
        base=torch.randn(HC * (2 + HC), generator=g, device=device) * 0.5,
        norm_weight=(1 + 0.1 * torch.randn(hidden, generator=g, device=device)).to(torch.bfloat16),
        new_residual=torch.empty(1, rows, HC, hidden, dtype=torch.bfloat16, device=device),
        post_out=torch.empty(rows, HC, device=device),
        comb_out=torch.empty(rows, HC * HC, device=device),
        layer_input=torch.empty(rows, hidden, dtype=torch.bfloat16, device=device),
    )


def finalize(inp: dict[str, torch.Tensor]) -> torch.Tensor:
    """An MoE boundary's partial as an unfused engine finalizes it: vLLM's moe_sum over the expert rows, plus the
    shared expert's output (two torch kernels), into the boundary's x."""
    return torch.add(inp["routed"].sum(1), inp["shared"], out=inp["x"][0])


def exchange(inp: dict[str, torch.Tensor], received: list[torch.Tensor], rank: int) -> None:
    """A simulated rank's all-reduce before its boundary: its own partial (finalized first after the MoE) and what
    it receives from the other ranks (finalized by them), summed in fp32 in rank order and rounded once into x. A
    rank's own partial, after an attention sublayer, is inp["own"] (x is overwritten by the sum)."""
    own = finalize(inp) if "routed" in inp else inp["own"]
    parts = [*received[:rank], own, *received[rank:]]
    acc = parts[0].to(torch.float32)  # boundary.reference.rank_sum's arithmetic (not imported: it needs CuTe DSL)
    for part in parts[1:]:
        acc = acc + part.to(torch.float32)
    inp["x"][0].copy_(acc)


def tilelang_boundary(inp: dict[str, torch.Tensor], ready: bool = False) -> torch.Tensor:
    """One boundary on TileLang's kernels: post (after the MoE's finalize, where it follows one, unless the partial
    is `ready`), projection, pre (mixes and collapse), then the RMSNorm."""
    from tile_kernels.mhc import mhc_post_fwd, mhc_pre_big_fuse_fwd

    x = inp["x"]
    if "routed" in inp and not ready:
        finalize(inp)
    new = mhc_post_fwd(x, inp["residual"], inp["post"], inp["comb"], out=inp["new_residual"])
    flat = new.view(-1, HC * new.shape[-1])
    mul = (flat.float() @ inp["fn"].t()).unsqueeze(0)  # TF32 when allowed (main sets it)
    sqrsum = flat.float().square().sum(-1).unsqueeze(0)
    mhc_pre_big_fuse_fwd(
        mul,
        sqrsum,
        inp["scale"],
        inp["base"],
        new.view(-1, HC, new.shape[-1]),
        inp["post_out"],
        inp["comb_out"],
        inp["layer_input"],
        n_splits=1,
        **EPS,
    )
    return torch.nn.functional.rms_norm(inp["layer_input"], (new.shape[-1],), inp["norm_weight"], 1e-20)


def after_moe(index: int) -> bool:
    """Whether a step's boundary `index` follows the MoE sublayer (the toy's layers: attention, then MoE)."""
    return index % 2 == 1


def engram_streams(embed: torch.Tensor, table: torch.Tensor, gate: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The toy step's torch code around its boundaries, as boundary.toy runs it: the tokens' embedding rows broadcast to
    the HC streams (Boundaries.first), then one Engram injection, a gated table row added to each stream
    (ToyModel.engram_inject)."""
    streams = embed[tokens].unsqueeze(1).expand(-1, HC, -1).contiguous()
    value = table[tokens].to(torch.float32)
    return (streams.to(torch.float32) + gate.view(1, -1, 1) * value.unsqueeze(1)).to(torch.bfloat16)


def model_code(rows: int, hidden: int, device: torch.device) -> Any:
    """engram_streams on fixed random tables and tokens."""
    g = torch.Generator(device=device).manual_seed(rows)
    tokens = torch.randint(0, VOCAB, (rows,), generator=g, device=device)
    embed = torch.randn(VOCAB, hidden, generator=g, device=device).to(torch.bfloat16)
    table = torch.randn(VOCAB, hidden, generator=g, device=device).to(torch.bfloat16)
    gate = torch.rand(HC, generator=g, device=device)
    return lambda: engram_streams(embed, table, gate, tokens)


def step_call(hidden: int, rows: int, boundaries: int, device: torch.device, top_k: int = TOP_K) -> Any:
    """A step of `boundaries` TileLang boundaries, each on its own fixed inputs, and the step's model code."""
    sets = [boundary_inputs(rows, hidden, device, i, top_k if after_moe(i) else 0) for i in range(boundaries)]
    glue = model_code(rows, hidden, device)
    return lambda: (glue(), [tilelang_boundary(inp) for inp in sets])


def simulated_step_call(
    hidden: int, rows: int, boundaries: int, device: torch.device, world: int, top_k: int = TOP_K
) -> Any:
    """W SIMULATED ranks' steps, each on its own stream of one GPU: per boundary the rank's exchange (exchange: the
    rank-order sum of its own partial and the W - 1 received ones), then TileLang's boundary; and the model code."""

    def rank_step(rank: int) -> Any:
        seeds = [(i * world + rank) for i in range(boundaries)]
        sets = [boundary_inputs(rows, hidden, device, s, top_k if after_moe(i) else 0) for i, s in enumerate(seeds)]
        for inp in sets:
            if "routed" not in inp:
                inp["own"] = inp["x"][0].clone()
        g = torch.Generator(device=device).manual_seed(1000 + rank)
        received = [
            [torch.randn(rows, hidden, generator=g, device=device).to(torch.bfloat16) for _ in range(world - 1)]
            for _ in range(boundaries)
        ]
        glue = model_code(rows, hidden, device)

        def run() -> None:
            glue()
            for inp, got in zip(sets, received):
                exchange(inp, got, rank)
                tilelang_boundary(inp, ready=True)

        return run

    streams = [torch.cuda.Stream(device) for _ in range(world)]
    work = [rank_step(r) for r in range(world)]
    return lambda: on_streams(streams, work)


BOUNDARY_SETS = 20  # input sets per graph of the one-boundary timing (bench.kernels.CALLS_PER_GRAPH)


def boundary_rows(hidden: list[int], rows: list[int], timer: GraphTimer, device: torch.device) -> list[dict]:
    """One TileLang boundary on a ready partial (post, TF32 projection, pre with its own pre-mix, RMSNorm: the
    DeepSeek-V4 chain) per (H, rows), us per call over BOUNDARY_SETS rotating input sets, as bench.v4 times ours."""
    out = []
    for h in hidden:
        for r in sorted(rows):
            print(f"TileLang V4 boundary: H {h}, {r} rows", file=sys.stderr, flush=True)
            row: dict[str, Any] = {"H": h, "rows": r}
            try:
                sets = [boundary_inputs(r, h, device, seed) for seed in range(BOUNDARY_SETS)]
                row["tilelang_us"] = timer.per_call_us([lambda s=s: tilelang_boundary(s, ready=True) for s in sets])
            except Exception as exc:  # one shape's failure must not cost the others their numbers
                row["error"] = f"{type(exc).__name__}: {exc}"
                torch.cuda.synchronize(device)
            out.append(row)
    return out


PARITY_KEYS = ("x", "residual", "post", "comb", "fn", "scale", "base", "norm_weight")
PARITY_SEED = 12345


def digests(inputs: dict[str, torch.Tensor]) -> dict[str, str]:
    """A SHA-1 of each parity input's bytes: the proof that inputs drawn again in another process are the same."""
    return {
        k: hashlib.sha1(inputs[k].detach().cpu().contiguous().view(torch.uint8).numpy()).hexdigest()
        for k in PARITY_KEYS
    }


def parity_cases(hidden: list[int], rows: list[int], device: torch.device) -> list[dict[str, Any]]:
    """Per (H, rows), one boundary's inputs and TileLang's outputs (new streams, layer input, post, comb), on the CPU,
    for bench.v4 to run ours on the same inputs (EPS's constants; the norm's eps is rms_eps). The inputs go with
    their seed and digests, so that a case without them (`strip_inputs`: a few MB lighter) can draw them again."""
    cases = []
    for h in hidden:
        for r in sorted(rows):
            inp = boundary_inputs(r, h, device, seed=PARITY_SEED)
            layer_input = tilelang_boundary(inp, ready=True)
            torch.cuda.synchronize(device)
            outputs = dict(new_residual=inp["new_residual"], layer_input=layer_input, post=inp["post_out"])
            outputs["comb"] = inp["comb_out"]
            cases.append(
                {
                    "H": h,
                    "rows": r,
                    "inputs": {k: inp[k].cpu() for k in PARITY_KEYS},
                    "seed": PARITY_SEED,
                    "digests": digests(inp),
                    "outputs": {k: v.cpu() for k, v in outputs.items()},
                    "eps": dict(EPS),
                }
            )
    return cases


def strip_inputs(case: dict[str, Any]) -> dict[str, Any]:
    """A parity case without its inputs, with their seed and digests (from the inputs themselves where missing)."""
    out = {k: v for k, v in case.items() if k != "inputs"}
    out.setdefault("seed", PARITY_SEED)
    out.setdefault("digests", digests(case["inputs"]))
    return out


def parity_inputs(case: dict[str, Any], device: torch.device) -> dict[str, torch.Tensor]:
    """A parity case's inputs on `device`: its own, or drawn again from its seed on the same kind of GPU (the CUDA
    generator's stream is the GPU's); raises if they are not the bytes TileLang ran on."""
    if "inputs" in case:
        return {k: v.to(device) for k, v in case["inputs"].items()}
    inp = boundary_inputs(case["rows"], case["H"], device, seed=case["seed"])
    if digests(inp) != case["digests"]:
        raise RuntimeError(
            f"the parity inputs of H {case['H']} x {case['rows']} rows drawn again differ from TileLang's"
        )
    return {k: inp[k] for k in PARITY_KEYS}


def main(argv: list[str] | None = None) -> int:
    """Time the TileLang step at each hidden size and row count (or, with --boundary, one boundary); write the rows
    as JSON."""
    p = argparse.ArgumentParser(prog="python -m bench.tilelang_step", description=__doc__.splitlines()[0])
    p.add_argument("--step-hidden", type=int, nargs="+", default=[5120, 7168])
    p.add_argument("--step-rows", type=int, nargs="+", default=[1, 4, 16, 64, 128, 512])
    p.add_argument("--step-layers", type=int, default=4, help="the toy step's layers (Engram on layer 1)")
    p.add_argument("--top-k", type=int, default=TOP_K, help="experts per token of the MoE boundaries")
    p.add_argument(
        "--step-tp", type=int, nargs="+", default=[1], choices=[1, 2, 4, 8], help="TP sizes (> 1: SIMULATED ranks)"
    )
    p.add_argument("--replays", type=int, default=7)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument(
        "--parity",
        type=Path,
        help="with --boundary: save one boundary's inputs and outputs per shape here (torch.save)",
    )
    p.add_argument(
        "--boundary",
        action="store_true",
        help="time one boundary per (--step-hidden, --step-rows) instead of the step (bench's v4 part's column)",
    )
    args = p.parse_args(argv)
    try:
        import tile_kernels.mhc  # noqa: F401
    except ImportError as exc:
        print(f"bench.tilelang_step: tile-kernels is not importable here ({exc}); nothing was measured")
        return 1
    if not torch.cuda.is_available():
        print("bench.tilelang_step: no CUDA GPU; nothing was measured")
        return 1
    torch.backends.cuda.matmul.allow_tf32 = True
    device = torch.device("cuda", torch.cuda.current_device())
    timer = GraphTimer(device, replays=args.replays)
    if args.boundary:
        got = boundary_rows(args.step_hidden, args.step_rows, timer, device)
        args.out.write_text(json.dumps({"gpu": torch.cuda.get_device_name(device), "rows": got}, indent=1))
        if args.parity is not None:
            torch.save(parity_cases(args.step_hidden, args.step_rows, device), args.parity)
        for r in got:
            print(f"H {r['H']:>5} rows {r['rows']:>4}: " + (r.get("error") or f"{r['tilelang_us']:8.2f} us"))
        return 1 if all("error" in r for r in got) else 0
    boundaries = 2 * args.step_layers  # as bench.step.boundaries_per_step: two per layer
    rows_out = []
    plan = [(h, w, r) for h in args.step_hidden for w in args.step_tp for r in sorted(args.step_rows)]
    for k, (hidden, world, rows) in enumerate(plan):  # plain progress lines: the TileLang bundle may lack tqdm
        print(f"TileLang step {k + 1}/{len(plan)}: H {hidden}, TP {world}, {rows} rows", file=sys.stderr, flush=True)
        row: dict[str, Any] = {"H": hidden, "tp": world, "rows": rows, "boundaries": boundaries}
        try:
            if world == 1:
                call = step_call(hidden, rows, boundaries, device, args.top_k)
            else:
                call = simulated_step_call(hidden, rows, boundaries, device, world, args.top_k)
            row["tilelang_step_us"] = timer.per_call_us([call])
        except Exception as exc:  # one shape's failure must not cost the others (or bench's own rows) their numbers
            row["error"] = f"{type(exc).__name__}: {exc}"
            torch.cuda.synchronize(device)
        rows_out.append(row)
        args.out.write_text(json.dumps({"gpu": torch.cuda.get_device_name(device), "rows": rows_out}, indent=1))
    for r in rows_out:
        tp = f"TP {r['tp']}" + (" SIMULATED" if r["tp"] > 1 else "")
        got = "FAILED " + r["error"][:300] if "error" in r else f"{r['tilelang_step_us']:8.1f} us per step"
        print(f"H {r['H']:>5} {tp:<12} rows {r['rows']:>4}: {got}")
    failed = sum("error" in r for r in rows_out)
    print(
        f"{len(rows_out) - failed} of {len(rows_out)} shapes measured ({boundaries} boundaries a step); wrote {args.out}"
    )
    return 1 if failed == len(rows_out) else 0


if __name__ == "__main__":
    sys.exit(main())
