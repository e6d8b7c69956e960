"""The decode step (#30): the toy V4.1 step at real hidden sizes in one CUDA graph per row count, our boundaries
against the reference chain in eager and under torch.compile (static shapes), at TP 1 and on simulated TP 2 / 4 / 8
ranks (W ranks' steps on one GPU, each on its own stream: SIMULATED, never NVLink numbers).

Two models per hidden size. "boundaries only": every sublayer returns an output computed once beforehand (a copy-free
stand-in of zero cost), so the step is the boundaries alone: 2 per layer plus the Engram seam and the final one, each
with its coefficients, collapse and norm. "toy sublayers": the toy's own attention and MoE stand-ins (small GEMMs,
far cheaper than a real V4 layer's), which gives an upper bound on the boundaries' share of a step. At H 7168 a third,
"V3 weight reads": each sublayer first reads the weight bytes a DeepSeek-V3 layer activates for the rows
(bench.weight_reads), the boundaries' share of a step of real layers' cost.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from tqdm import tqdm

from bench import critical_path, tilelang_step, weight_reads
from bench.timing import GraphTimer, on_streams
from boundary import Boundaries, BoundaryAllReduce, DecodeStep, V4Boundaries, reference
from boundary.toy import ToyConfig, ToyModel, decode_step, random_tokens

ROOT = Path(__file__).resolve().parents[1]
GLUE_CALLS = 8  # the model code's calls in the graph that times it


def boundaries_only(model: ToyModel, rows: int) -> ToyModel:
    """A copy of `model` whose attention and MoE return their outputs on fixed inputs, computed once: a step of it
    launches the boundaries and the model's Engram code only."""
    gen = torch.Generator(device=model.device).manual_seed(rows)
    fixed: dict[tuple[str, int], Any] = {}
    for layer in model.layers:
        x = torch.randn(rows, model.config.hidden_size, generator=gen, device=model.device).to(torch.bfloat16)
        fixed["attention", layer.index] = model.attention(layer, x)
        fixed["moe", layer.index] = model.moe(layer, x)
    free = copy.copy(model)
    free.attention = lambda layer, x: fixed["attention", layer.index]  # type: ignore[method-assign]
    free.moe = lambda layer, x: fixed["moe", layer.index]  # type: ignore[method-assign]
    return free


def _finalized(
    model: ToyModel, layer: Any, x: Tensor, finalize: Callable[..., Tensor] = reference.moe_finalize
) -> Tensor:
    """A rank's MoE partial (its sublayer's output, finalized by `finalize`)."""
    out = model.moe(model.layers[layer.index], x)
    routed = out.routed
    return finalize(
        routed.gemm2_permuted, routed.expert_weights, routed.expanded_idx_to_permuted_idx, out.shared_output
    )


def received_partials(models: list[ToyModel], rank: int) -> dict[tuple[int, int], Tensor]:
    """What `rank` receives of boundaries-only models (whose partials do not depend on x): every other rank's MoE
    partial per layer, finalized once, keyed (rank, layer index)."""
    x = torch.zeros(1, device=models[0].device)  # unread: a boundaries-only model returns fixed outputs
    return {
        (r, layer.index): _finalized(m, layer, x)
        for layer in models[0].layers
        for r, m in enumerate(models)
        if r != rank
    }


def summed_sublayers(
    models: list[ToyModel], rank: int | None = None, finalize: Callable[..., Tensor] = reference.moe_finalize
) -> ToyModel:
    """A copy of rank 0's model whose sublayers return every rank's partial summed in rank order (the MoE partials
    finalized first, by `finalize`): the exchange, after which the reference chain runs at W = 1. With `rank`
    (boundaries-only models) only that rank's MoE partial is finalized per call, as a real rank does; the others'
    stand for what it receives (received_partials)."""
    received = {} if rank is None else received_partials(models, rank)

    def attention(layer: Any, x: Tensor) -> Tensor:
        return reference.rank_sum([m.attention(m.layers[layer.index], x) for m in models])

    def moe(layer: Any, x: Tensor) -> Tensor:
        parts = [received.get((r, layer.index)) for r in range(len(models))]
        return reference.rank_sum(
            [p if p is not None else _finalized(models[r], layer, x, finalize) for r, p in enumerate(parts)]
        )

    summed = copy.copy(models[0])
    summed.attention = attention  # type: ignore[method-assign]
    summed.moe = moe  # type: ignore[method-assign]
    return summed


def add_tilelang(rows: list[dict], tilelang: list[dict]) -> None:
    """The TileLang step's µs (bench.tilelang_step, same GPU, its own process) beside the rows it matches."""
    by_shape = {(t["H"], t.get("tp", 1), t["rows"]): t for t in tilelang if "tilelang_step_us" in t}  # not failed
    for row in rows:
        match = by_shape.get((row["H"], row["tp"], row["rows"]))
        if match is not None and "ours_us" in row:
            row["tilelang_us"] = match["tilelang_step_us"]
            row["x_tilelang"] = match["tilelang_step_us"] / row["ours_us"]


def boundaries_per_step(config: ToyConfig) -> int:
    """Boundaries (the reduction and post of a sublayer's output, the next coefficients, collapse and norm) in a step:
    two per layer (an Engram seam splits one into post_only + pre; the last is the final boundary)."""
    return 2 * config.num_layers


def _step_call(model: ToyModel, b: Boundaries, rows: int, side: bool) -> Callable[[], object]:
    tokens = random_tokens(model, rows, 0)
    step = DecodeStep(rows=rows, side_stream=side)
    return lambda: decode_step(model, b, tokens, step)


def _compiled_call(model: ToyModel, b: Boundaries, rows: int) -> Callable[[], object]:
    """The reference chain's step under torch.compile with this row count's shapes fixed (dynamic=False)."""
    torch._dynamo.reset()
    tokens = random_tokens(model, rows, 0)
    step = DecodeStep(rows=rows, side_stream=False)
    fn = torch.compile(lambda t: decode_step(model, b, t, step), dynamic=False)
    return lambda: fn(tokens)


def tilelang_command(args: argparse.Namespace, out: Path) -> list[str]:
    """bench.tilelang_step's command line for the step part's shapes."""
    return [
        sys.executable,
        "-m",
        "bench.tilelang_step",
        *("--step-hidden", *map(str, args.step_hidden)),
        *("--step-rows", *map(str, args.step_rows)),
        *("--step-tp", *map(str, args.step_tp)),
        *("--step-layers", str(args.step_layers), "--top-k", str(ToyConfig().top_k)),
        *("--replays", str(args.replays), "--out", str(out)),
    ]


def run_tilelang(args: argparse.Namespace) -> list[dict]:
    """The TileLang step's rows, measured now by bench.tilelang_step in a process of its own (its tvm-ffi differs from
    CuTe DSL's) with `args.tilelang_path` first on its path; raises with its output if it fails."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(args.tilelang_path), str(ROOT)]))
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "tilelang.json"
        print(f"TileLang step baseline: its own process, tile_kernels from {args.tilelang_path}", flush=True)
        done = subprocess.run(tilelang_command(args, out), env=env, cwd=ROOT, stdout=subprocess.PIPE, text=True)
        if done.returncode != 0 or not out.exists():
            raise RuntimeError(f"bench.tilelang_step failed (exit {done.returncode}):\n{done.stdout[-3000:]}")
        print(done.stdout, end="", flush=True)
        return json.loads(out.read_text())["rows"]


def step_compiles(args: argparse.Namespace, tp: int, rows: int) -> bool:
    """Whether the step part measures the static torch.compile baseline at this TP size and row count."""
    return not args.no_compile and tp in args.step_compile_tp and rows in args.step_compile_rows


def bench_step(
    args: argparse.Namespace,
    timer: GraphTimer,
    out: list[dict] | None = None,
    lap: Callable[[str], None] | None = None,
) -> list[dict]:
    """µs per step at TP 1, then on simulated TP ranks, for every hidden size and row count of the step part; each row
    is appended to `out` as it is measured (an interrupted run keeps what it has, with its TileLang column). `lap`
    (make bench's clock) is told each stage as it ends: the compile-ahead, TP 1, each simulated (H, W)."""
    lap = lap or (lambda stage: None)
    out = [] if out is None else out
    # First, alone on the GPU: its process must be gone before ours allocate their graphs.
    tilelang = run_tilelang(args) if args.tilelang_path is not None else None
    from bench import precompile

    precompile.precompile(args, timer.device)  # the compile baselines' cold compiles, side by side
    lap("compile-ahead")
    try:
        bench_step_tp1(args, timer, out)
        lap("TP 1")
        bench_step_tp(args, timer, out, lap)
    finally:
        if args.tilelang_json is not None:
            tilelang = json.loads(args.tilelang_json.read_text())["rows"]
        if tilelang is not None:
            add_tilelang(out, tilelang)
    return out


def bench_step_tp1(args: argparse.Namespace, timer: GraphTimer, out: list[dict]) -> None:
    """The TP 1 rows: ours (side streams, inline), eager, compile, the glue, the toy and V3 steps, appended to `out`."""
    device = timer.device
    plan = [(hidden, rows) for hidden in args.step_hidden for rows in sorted(args.step_rows) if 1 in args.step_tp]
    models: dict[int, tuple[ToyModel, Boundaries, Boundaries, V4Boundaries]] = {}
    reads = None
    for hidden, rows in tqdm(plan, desc="decode step (TP 1)", unit="shape"):
        if hidden not in models:
            config = ToyConfig(hidden_size=hidden, num_layers=args.step_layers)
            model = ToyModel(config, device=device)
            ours = BoundaryAllReduce(hidden, max_rows=max(args.step_rows), device=device)
            ours.warmup(progress=False, quantize=("mxfp8",), own_pre=weight_reads.read_scale(hidden) is not None)
            ref = BoundaryAllReduce(hidden, max_rows=max(args.step_rows), device=device, backend="reference")
            models[hidden] = (model, Boundaries(ours), Boundaries(ref), V4Boundaries(ours))  # the toy step: MXFP8 only
        model, ours_b, ref_b, v4_b = models[hidden]
        free = boundaries_only(model, rows)
        n = boundaries_per_step(model.config)
        row: dict[str, Any] = {"H": hidden, "tp": 1, "layers": model.config.num_layers, "boundaries": n, "rows": rows}
        row["overlap_us"] = timer.per_call_us([_step_call(free, ours_b, rows, True)])
        row["inline_us"] = timer.per_call_us([_step_call(free, ours_b, rows, False)])
        row["ours_us"] = min(row["overlap_us"], row["inline_us"])
        row["eager_us"] = timer.per_call_us([_step_call(free, ref_b, rows, False)])
        if step_compiles(args, 1, rows):
            row["compile_us"] = timer.per_call_us([_compiled_call(free, ref_b, rows)])
        # The step's model code that is no boundary (embedding broadcast, Engram injection), timed alone (its graph's
        # launch spread over GLUE_CALLS calls: the step's own launch stays with the boundaries): the shares count the
        # boundaries only.
        row["glue_us"] = timer.per_call_us([tilelang_step.model_code(rows, hidden, device)] * GLUE_CALLS)
        boundaries_us = row["ours_us"] - row["glue_us"]
        side = DecodeStep.for_rows(rows).side_stream  # the engine's default step
        row["toy_step_us"] = timer.per_call_us([_step_call(model, ours_b, rows, side)])
        row["boundary_share"] = boundaries_us / row["toy_step_us"]
        scale = weight_reads.read_scale(hidden)
        if scale is not None:
            reads = reads or weight_reads.WeightReads(device, max(args.step_rows))
            row["v3_scale"] = scale
            v3 = reads.model(free, rows, scale=scale)
            row["v3_side_us"] = timer.per_call_us([_step_call(v3, ours_b, rows, True)])
            early = critical_path.EarlyJoin(ours_b, DecodeStep(rows=rows, side_stream=True))
            v3_early = reads.model(free, rows, before_last=early.before_last, scale=scale)
            row["v3_early_us"] = timer.per_call_us([_step_call(v3_early, early, rows, True)])  # type: ignore[arg-type]
            row["v3_inline_us"] = timer.per_call_us([_step_call(v3, ours_b, rows, False)])
            copies = critical_path.OutputCopies(rows, hidden, device)
            row["v3_copies_us"] = timer.per_call_us([_step_call(v3, copies, rows, False)])  # type: ignore[arg-type]
            # DeepSeek-V4's scheme on the same sublayers: every boundary's coefficients on the critical path.
            row["v3_v4_us"] = timer.per_call_us([critical_path.v4_step_call(v3, v4_b, rows)])
            copies_v4 = critical_path.OutputCopiesV4(rows, hidden, device)
            row["v3_v4_copies_us"] = timer.per_call_us([critical_path.v4_step_call(v3, copies_v4, rows)])
            critical_path.add_critical_path(row, n)
            row["v3_step_us"] = row["v3_side_us"] if side else row["v3_inline_us"]
            row["v3_share"] = boundaries_us / row["v3_step_us"]
        for key in ("eager", "compile"):
            if f"{key}_us" in row:
                row[f"x_{key}"] = row[f"{key}_us"] / row["ours_us"]
        row["per_boundary_us"] = row["ours_us"] / n
        out.append(row)


def bench_step_tp(
    args: argparse.Namespace, timer: GraphTimer, out: list[dict], lap: Callable[[str], None] = lambda stage: None
) -> None:
    """The simulated TP > 1 rows, appended to `out`; the compile baseline's chains shared by every W of a size."""
    device = timer.device
    simulated = [(hidden, world) for hidden in args.step_hidden for world in args.step_tp if world > 1]
    compiled: CompiledChains | None = None
    for hidden, world in tqdm(simulated, desc="decode step (simulated TP)", unit="W", disable=not simulated):
        wanted = any(step_compiles(args, world, rows) for rows in args.step_rows)
        if wanted and (compiled is None or compiled.ref.all_reduce.hidden_size != hidden):
            ref = BoundaryAllReduce(hidden, max_rows=max(args.step_rows), device=device, backend="reference")
            compiled = CompiledChains(Boundaries(ref))
        bench_step_simulated(args, timer, hidden, world, out, compiled if wanted else None)
        lap(f"simulated H={hidden} W={world}")


class SimulatedStep:
    """W simulated ranks of the toy step at one hidden size: ours on the peer path, and the baseline's W reference
    chains, each after the rank-order sum of every rank's partials (on W streams, one GPU)."""

    def __init__(self, args: argparse.Namespace, device: torch.device, hidden: int, world: int) -> None:
        self.config = ToyConfig(hidden_size=hidden, num_layers=args.step_layers)
        max_rows = max(args.step_rows)
        self.ranks = BoundaryAllReduce.simulated(hidden, world, max_rows=max_rows, device=device)
        self.ranks[0].warmup(progress=False, quantize=("mxfp8",))  # one context: what rank 0 loads, every rank has
        self.ours = [Boundaries(ar) for ar in self.ranks]
        self.ref = Boundaries(BoundaryAllReduce(hidden, max_rows=max_rows, device=device, backend="reference"))
        self.full = [ToyModel(self.config, rank=r, world_size=world, device=device) for r in range(world)]
        self.streams = [torch.cuda.Stream(device) for _ in range(world)]

    def ours_step(self, models: list[ToyModel], rows: int, side: bool) -> Callable[[], object]:
        """Every rank's step on its own stream (run_simulated), all issued before any is waited for."""
        tokens = random_tokens(self.full[0], rows, 0)
        step = DecodeStep(rows=rows, side_stream=side)
        calls = [lambda ar: decode_step(models[ar.rank], self.ours[ar.rank], tokens, step)] * len(self.ranks)
        return lambda: BoundaryAllReduce.run_simulated(self.ranks, calls)

    def baseline_step(self, free: list[ToyModel], rows: int) -> Callable[[], object]:
        """Every rank's reference chain on its own stream, each after the rank-order sum of the partials (finalizing
        its own MoE partial only)."""
        tokens = random_tokens(self.full[0], rows, 0)
        step = DecodeStep(rows=rows, side_stream=False)
        summed = [summed_sublayers(free, r) for r in range(len(self.ranks))]
        chains = [lambda m=m: decode_step(m, self.ref, tokens, step) for m in summed]
        return lambda: on_streams(self.streams, chains)

    def copies_step(self, free: list[ToyModel], rows: int) -> Callable[[], object]:
        """Every rank's step with boundaries that only write their outputs (critical_path.OutputCopies), each on its
        own stream: what the ranks' steps cost without our boundaries."""
        tokens = random_tokens(self.full[0], rows, 0)
        step = DecodeStep(rows=rows, side_stream=False)
        hidden, device = self.config.hidden_size, self.ranks[0].device
        copies = [critical_path.OutputCopies(rows, hidden, device) for _ in self.ranks]
        chains = [lambda m=m, c=c: decode_step(m, c, tokens, step) for m, c in zip(free, copies)]  # type: ignore[misc]
        return lambda: on_streams(self.streams, chains)

    def check(self) -> None:
        """Raise if a simulated rank's boundary gave up waiting (its timings would be meaningless)."""
        for ar in self.ranks:
            ar.check()

    def reset(self) -> None:
        """Re-arm every rank after a wait gave up."""
        for ar in self.ranks:
            ar.reset()

    def compiled_step(self, free: list[ToyModel], rows: int, compiled: CompiledChains) -> Callable[[], object]:
        """Every rank's exchange and compiled chain (CompiledChains) on its own stream."""
        calls = [compiled.rank_call(free, r, rows) for r in range(len(self.ranks))]
        return lambda: on_streams(self.streams, calls)

    def row(self, timer: GraphTimer, rows: int, compiled: CompiledChains | None = None) -> dict[str, Any]:
        """The step table's row at `rows` rows: the boundaries-only step (no toy sublayers: W ranks' GEMMs on one GPU
        would time the GPU's sharing, not a TP step's)."""
        free = [boundaries_only(m, rows) for m in self.full]
        n = boundaries_per_step(self.config)
        row: dict[str, Any] = {"H": self.config.hidden_size, "tp": len(self.ranks), "layers": self.config.num_layers}
        row |= {"boundaries": n, "rows": rows}
        row["overlap_us"] = timer.per_call_us([self.ours_step(free, rows, True)])
        self.check()
        row["inline_us"] = timer.per_call_us([self.ours_step(free, rows, False)])
        self.check()
        row["ours_us"] = min(row["overlap_us"], row["inline_us"])
        # The critical path per boundary, as bench.critical_path's: here over the boundaries-only step (SIMULATED).
        row["copies_us"] = timer.per_call_us([self.copies_step(free, rows)])
        row["critical_side_us"] = (row["overlap_us"] - row["copies_us"]) / n
        row["critical_inline_us"] = (row["inline_us"] - row["copies_us"]) / n
        row["eager_us"] = timer.per_call_us([self.baseline_step(free, rows)])
        row["x_eager"] = row["eager_us"] / row["ours_us"]
        if compiled is not None:
            row["compile_us"] = timer.per_call_us([self.compiled_step(free, rows, compiled)])
            row["x_compile"] = row["compile_us"] / row["ours_us"]
        row["per_boundary_us"] = row["ours_us"] / n
        return row


class CompiledChains:
    """The multi-rank compile baseline at one hidden size. Each rank's exchange runs in eager (its own MoE partial
    finalized, then every sublayer's rank-order sum), as an engine's collective sits outside its compiled graph; then
    the reference chain, compiled once per row count (static shapes) with the exchanged partials as its inputs, which
    every rank and every W share."""

    def __init__(self, ref: Boundaries) -> None:
        self.ref = ref
        self.chains: dict[int, Callable[..., object]] = {}
        # A rank's own MoE finalize compiled too (one graph per row count), as the TP 1 compile fuses it; the
        # collective (the rank-order sum) stays eager.
        self.finalize = torch.compile(reference.moe_finalize, dynamic=False)
        torch._dynamo.reset()

    def chain(self, template: ToyModel, rows: int) -> Callable[..., object]:
        """The compiled chain at `rows` rows: (tokens, attention partials, MoE partials per layer) -> step output."""
        if rows not in self.chains:
            received: dict[str, list[Tensor]] = {}
            model = copy.copy(template)
            model.attention = lambda layer, x: received["attention"][layer.index]  # type: ignore[method-assign]
            model.moe = lambda layer, x: received["moe"][layer.index]  # type: ignore[method-assign]
            step = DecodeStep(rows=rows, side_stream=False)

            def run(tokens: Tensor, attention: list[Tensor], moe: list[Tensor]) -> object:
                received["attention"], received["moe"] = attention, moe
                try:
                    return decode_step(model, self.ref, tokens, step)
                finally:
                    received.clear()  # empty at every entry: what the compiled graph's guards saw

            self.chains[rows] = torch.compile(run, dynamic=False)
        return self.chains[rows]

    def rank_call(self, models: list[ToyModel], rank: int, rows: int) -> Callable[[], object]:
        """Rank `rank`'s step of boundaries-only `models`: its exchange in eager, then the shared compiled chain."""
        chain = self.chain(models[0], rows)
        tokens = random_tokens(models[0], rows, 0)
        exchange = summed_sublayers(models, rank, self.finalize)  # the eager baseline's exchange, own MoE compiled
        x = torch.zeros(1, device=models[0].device)  # unread: a boundaries-only model returns fixed outputs
        layers = models[0].layers

        def call() -> object:
            # One code object serves every row count's chain (and moe_finalize's): past Dynamo's recompile limit the
            # rest would run in eager without a word, so that limit raises here.
            with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
                attention = [exchange.attention(layer, x) for layer in layers]
                moe = [exchange.moe(layer, x) for layer in layers]
                return chain(tokens, attention, moe)

        return call


def bench_step_simulated(
    args: argparse.Namespace,
    timer: GraphTimer,
    hidden: int,
    world: int,
    out: list[dict],
    compiled: CompiledChains | None = None,
) -> None:
    """µs per step of W simulated ranks at every row count of the step part, appended to `out` (with `compiled`, the
    compile baseline too). A step whose boundary gave up waiting ends this W's rows with a row that says so (its
    timings are meaningless)."""
    sim = SimulatedStep(args, timer.device, hidden, world)
    for rows in sorted(args.step_rows):
        try:
            out.append(sim.row(timer, rows, compiled if step_compiles(args, world, rows) else None))
        except RuntimeError as exc:
            if "gave up waiting" not in str(exc):
                raise
            out.append({"H": hidden, "tp": world, "rows": rows, "stalled": str(exc)})
            sim.reset()
            tqdm.write(f"SIMULATED TP {world}, H {hidden}, {rows} rows: a boundary gave up waiting; rows skipped")
            return


def print_step(rows: list[dict]) -> None:
    """The step table: ours (side streams on / off), the baselines, speedups and the boundaries' share."""
    print(
        "\ndecode step (one CUDA graph per step, L2 flushed), GPU us per step; boundaries-only model; TP > 1: "
        "SIMULATED ranks on one GPU"
    )
    head = (
        f"{'H':>5} {'TP':>2} {'L':>2} {'rows':>4} | {'side':>7} {'inline':>7} {'/bnd':>5} | {'eager':>8} "
        f"{'compile':>8} {'TileLang':>8} | {'x eager':>7} {'x comp':>6} {'x TL':>5} | {'glue':>5} | {'toy step':>8} "
        f"{'share':>5} | {'V3 step':>8} {'share':>5}"
    )
    print(head)
    print("-" * len(head))
    nan = float("nan")
    for r in rows:
        if "stalled" in r:
            print(f"{r['H']:>5} {r['tp']:>2}    {r['rows']:>4} | STALLED: {r['stalled'][:80]}")
            continue
        print(
            f"{r['H']:>5} {r['tp']:>2} {r['layers']:>2} {r['rows']:>4} | {r['overlap_us']:7.1f} {r['inline_us']:7.1f} "
            f"{r['per_boundary_us']:5.2f} | {r['eager_us']:8.1f} {r.get('compile_us', nan):8.1f} "
            f"{r.get('tilelang_us', nan):8.1f} | {r['x_eager']:7.1f} {r.get('x_compile', nan):6.1f} "
            f"{r.get('x_tilelang', nan):5.1f} | {r.get('glue_us', nan):5.1f} | {r.get('toy_step_us', nan):8.1f} "
            f"{100 * r.get('boundary_share', nan):4.0f}% | {r.get('v3_step_us', nan):8.1f} "
            f"{100 * r.get('v3_share', nan):4.0f}%"
        )
    print(
        "side / inline: the coefficients on side streams or inline; /bnd: ours per boundary (a sublayer output's "
        "reduction and post, the next coefficients, collapse, norm: 2 per layer, and the step's model code); glue: that model "
        "code (embedding broadcast, Engram injection) alone in its own graph; share: the boundaries-only step less the "
        "glue over the step with the toy's sublayers (cheap stand-ins, so an upper bound; TP 1 only); eager at TP > 1: every rank's chain after the rank-order sum of the partials, on W streams; compile at TP > 1: "
        "every rank's exchange in eager, then the chain compiled once per row count (CompiledChains); "
        "TileLang (bench.tilelang_step, its own process): post + TF32 projection + pre + RMSNorm per boundary, at TP > 1 "
        "after each rank's exchange as the eager baseline's; "
        "V3 step (H 7168, TP 1): each sublayer reads the weight bytes a DeepSeek-V3 layer activates for the rows at FP8 "
        "(bench.weight_reads; no KV cache; at H 5120 those bytes times 5120/7168, a stand-in of V3's shape), share: "
        "the boundaries-only step less the glue over it"
    )


def plot_step(rows: list[dict], path: Any) -> None:
    """µs per step against rows, one panel per H: ours and the baselines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hiddens = sorted({r["H"] for r in rows if r["tp"] == 1})
    if not hiddens:
        return
    fig, axes = plt.subplots(1, len(hiddens), figsize=(5 * len(hiddens), 4), squeeze=False)
    for ax, hidden in zip(axes[0], hiddens):
        sel = [r for r in rows if r["H"] == hidden and r["tp"] == 1]
        xs = [r["rows"] for r in sel]
        for key, label in (
            ("ours_us", "fused boundaries"),
            ("eager_us", "reference chain, eager"),
            ("compile_us", "reference chain, torch.compile"),
            ("tilelang_us", "TileLang mHC kernels"),
            ("toy_step_us", "fused, with the toy sublayers"),
            ("v3_step_us", "fused, with V3-sized weight reads"),
        ):
            if any(key in r for r in sel):
                ax.plot(xs, [r.get(key, float("nan")) for r in sel], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("rows")
        ax.set_ylabel("us per decode step (GPU time)")
        ax.set_title(f"H = {hidden}, {sel[0]['layers']} layers, TP 1")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
