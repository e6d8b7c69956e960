"""Host cost of a boundary call (#29): median µs of host time per call, inputs already made, for the direct path
(BoundaryAllReduce), the custom op in eager (`boundary_ready`, what the scheduler's ops call for this form, and the
18-argument `boundary`, "op 18"), a decode loop of custom ops under torch.compile(fullgraph=True), and
torch's eager reference chain; then what two boundaries per layer cost a 61-layer decode step on the host. Beside
them the scheduler's whole boundary, as an engine calls it: `Boundaries.sublayer` (the kernel, then the next
coefficients inline) and DeepSeek-V4's `V4Boundaries.sublayer` (the residual-only kernel, then the own-pre
coefficients), each with its checks, state and launches."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch
from tqdm import tqdm

from bench.chains import boundary_chain
from bench.timing import host_us_interleaved
from boundary import Boundaries, BoundaryAllReduce, BoundaryState, DecodeStep, V4Boundaries
from boundary.toy import ToyConfig, ToyModel

OPS = torch.ops.mhc_boundary
LAYERS = 61  # DeepSeek V4's decoder layers: two boundaries each
LOOP = 16  # boundary ops per compiled loop call


def _op(ar: BoundaryAllReduce, inp: dict[str, torch.Tensor], residual: torch.Tensor) -> tuple:
    """The op `Boundaries(custom_ops=True)` calls for this form (a ready partial, nothing written in place)."""
    return OPS.boundary_ready(
        ar.handle, inp["x"], residual, inp["post"], inp["comb"], inp["pre"], inp["norm_weight"], 1e-6
    )


def _op_full(ar: BoundaryAllReduce, inp: dict[str, torch.Tensor], residual: torch.Tensor) -> tuple:
    """The same call through the 18-argument `boundary` op (every form's schema)."""
    return OPS.boundary(
        ar.handle,
        inp["x"],
        None,
        None,
        None,
        None,
        residual,
        inp["post"],
        inp["comb"],
        inp["pre"],
        inp["norm_weight"],
        1e-6,
        None,
        None,
        None,
        None,
        False,
        None,
    )


def compiled_loop(ar: BoundaryAllReduce, inp: dict[str, torch.Tensor]) -> Callable[[], object]:
    """LOOP boundary ops chained through the residual, compiled once with fullgraph=True (no graph break)."""

    def loop(residual: torch.Tensor) -> torch.Tensor:
        for _ in range(LOOP):
            residual, _out = _op(ar, inp, residual)
        return residual

    torch._dynamo.reset()
    fn = torch.compile(loop, fullgraph=True, dynamic=False)
    return lambda: fn(inp["residual"])


def scheduler_calls(ar: BoundaryAllReduce, inp: dict[str, torch.Tensor]) -> dict[str, Callable[[], object]]:
    """`Boundaries.sublayer` and `V4Boundaries.sublayer` on the inputs' ready partial (no side stream: the default
    step), a toy layer's weights, one state each whose pending partial every call sets again."""
    rows, hidden = inp["x"].shape
    layer = ToyModel(ToyConfig(hidden_size=hidden, num_layers=1, vocab=16), device=inp["x"].device).layers[0]
    step = DecodeStep(rows=rows, side_stream=False)
    v41, v4 = Boundaries(ar), V4Boundaries(ar)
    state = BoundaryState(inp["residual"], inp["post"], inp["comb"], inp["pre"])
    state_v4 = BoundaryState(inp["residual"], inp["post"], inp["comb"], None)

    def sublayer() -> object:
        state.pending = inp["x"]
        return v41.sublayer(layer, False, state, step)

    def sublayer_v4() -> object:
        state_v4.pending = inp["x"]
        return v4.sublayer(layer, False, state_v4, step)

    return {"sublayer": sublayer, "v4_sublayer": sublayer_v4}


def host_row(
    hidden: int,
    rows: int,
    inp: dict[str, torch.Tensor],
    timer: Callable[[dict[str, Callable[[], object]]], dict[str, float]],
) -> dict[str, Any]:
    """Host µs per boundary call of each calling form at one hidden size (`timer`: µs per call of each closure, timed
    in interleaved rounds), and per 61-layer step in ms."""
    ar = BoundaryAllReduce(hidden, max_rows=rows, device=inp["x"].device)
    ar.warmup(progress=False, quantize=(), own_pre=True)
    epilogue = (inp["residual"], inp["post"], inp["comb"], inp["pre"], inp["norm_weight"], 1e-6)
    # The machine's own host speed, as a yardstick: one torch op on the same tensors (about 2-5 µs on a fast host).
    scratch = torch.empty_like(inp["x"])
    times = timer(
        {
            "torch_add": lambda: torch.add(inp["x"], inp["x"], out=scratch),
            "direct": lambda: ar(inp["x"], *epilogue, None),
            "op_eager": lambda: _op(ar, inp, inp["residual"]),
            "op_full_eager": lambda: _op_full(ar, inp, inp["residual"]),
            "op_compiled_loop": compiled_loop(ar, inp),
            "torch_eager_chain": lambda: boundary_chain(inp["x"], *epilogue),
            **scheduler_calls(ar, inp),
        }
    )
    row: dict[str, Any] = {"H": hidden, "rows": rows, **{f"{name}_us": us for name, us in times.items()}}
    row["op_compiled_loop_us"] /= LOOP
    for key in ("direct", "op_compiled_loop", "torch_eager_chain", "sublayer", "v4_sublayer"):
        row[f"{key}_step_ms"] = row[f"{key}_us"] * 2 * LAYERS / 1000
    # Through the ops, a MoE layer's two boundaries are one plain (boundary_ready) and one MoE form (boundary).
    row["op_eager_step_ms"] = (row["op_eager_us"] + row["op_full_eager_us"]) * LAYERS / 1000
    return row


def bench_host(args: argparse.Namespace, inputs: Callable[[int, int], dict[str, torch.Tensor]]) -> list[dict]:
    """Host µs per boundary call at each hidden size of the boundary part, at the smallest row count (the host cost
    does not depend on rows; the GPU work is far shorter than the host's, so the queue never fills)."""
    rows = min(args.rows)
    hiddens = tqdm(args.hidden, desc="host cost", unit="H")
    return [host_row(hidden, rows, inputs(rows, hidden), host_us_interleaved) for hidden in hiddens]


def print_host(rows: list[dict]) -> None:
    """The host-cost table."""
    print(
        f"\nhost cost of one boundary call (median us, inputs made; per step: 2 boundaries x {LAYERS} layers, ms); "
        "torch.add: one torch op's host cost on this machine, the yardstick; op: boundary_ready (what Boundaries' "
        "ops call for a plain boundary), op 18: the same call through the 18-argument boundary op; per step, op: one "
        "of each a layer (the MoE output's boundary takes the 18-argument op); compiled: a loop of boundary_ready ops; "
        "sublayer / V4 sublayer: the scheduler's whole boundary as an engine calls it (Boundaries.sublayer: the kernel "
        "and the next coefficients inline; V4Boundaries.sublayer: the residual-only kernel and the own-pre "
        "coefficients), checks, state and launches"
    )
    nan = float("nan")
    head = (
        f"{'H':>5} | {'direct':>7} {'op':>7} {'op 18':>7} {'compiled':>8} {'torch chain':>11} {'torch.add':>9} | "
        f"{'sublayer':>8} {'V4 sub':>7} | per step ms: direct / op / compiled / sublayer / V4 sublayer"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r['H']:>5} | {r['direct_us']:7.1f} {r['op_eager_us']:7.1f} {r['op_full_eager_us']:7.1f} "
            f"{r['op_compiled_loop_us']:8.1f} {r['torch_eager_chain_us']:11.1f} {r['torch_add_us']:9.1f} | "
            f"{r.get('sublayer_us', nan):8.1f} {r.get('v4_sublayer_us', nan):7.1f} | {r['direct_step_ms']:.2f} / "
            f"{r['op_eager_step_ms']:.2f} / {r['op_compiled_loop_step_ms']:.2f} / {r.get('sublayer_step_ms', nan):.2f} / "
            f"{r.get('v4_sublayer_step_ms', nan):.2f} (torch chain {r['torch_eager_chain_step_ms']:.2f})"
        )
