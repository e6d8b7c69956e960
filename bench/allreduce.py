"""The multi-rank boundary benchmark (`python -m bench --parts allreduce`).

On one GPU the ranks are simulated: W BoundaryAllReduce ranks in this process, each running its
sequence of calls back to back on its own stream inside the CUDA graph (forked once, joined once:
only the exchange couples the ranks, as on W GPUs), the W kernels sharing the GPU's SMs and HBM.
Those numbers are labelled "simulated" and are never NVLink numbers; what they measure is the
protocol's own cost against, in the same run: the one-rank kernel launched the same way (its calls
back to back on a forked stream inside the graph), W of them on the W rank streams, the bytes every
simulated rank moves together over the copy bandwidth, and the gather path
of the previous version (each rank sums all partials in torch, then runs the one-rank kernel; its
all-gather itself is not simulated). With several GPUs, `run_multi_gpu` runs one process per GPU
(the NVLink benchmark of the multi-GPU issue).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from tqdm import tqdm

from bench.timing import GraphTimer, event_us, marginal_us, on_streams
from boundary import BoundaryAllReduce
from boundary import reference as ref
from boundary.demo import file_rendezvous
from cute_kernels.allreduce.protocol import PROTOCOLS
from cute_kernels.allreduce.tuning import protocol_for

# Calls per rank in the short graph and in the long one; the headline per-call time is the marginal between them
# (a decode graph holds two boundaries per layer, 100 or more), the short graph's per-call time is kept beside it.
CALLS_PER_GRAPH = 10
CALLS_PER_LONG_GRAPH = 40


def boundary_bytes(rows: int, hidden: int) -> int:
    """The fewest bytes one rank's epilogue moves: partial, streams in and out, layer input (bf16)."""
    return 20 * rows * hidden


def exchange_bytes(world: int, rows: int, hidden: int, protocol: str) -> int:
    """Bytes the exchange itself moves through memory, all ranks together: pushes, polled reads, re-arms.

    One-shot: every rank's partial to every other rank (W (W-1) S), read and re-armed there (x3).
    Two-shot: W - 1 partials per segment to its owner and W - 1 copies of y back, each read and re-armed.
    """
    s = 2 * rows * hidden
    if protocol == "oneshot":
        return 3 * world * (world - 1) * s
    return 6 * (world - 1) * s


@contextlib.contextmanager
def forced_protocol(ranks: Sequence[BoundaryAllReduce], protocol: str | None) -> Iterator[None]:
    """Make every call of `ranks` in the block take `protocol` (a measurement of both sides of the switch; None:
    the shipped choice), through the public `BoundaryAllReduce.protocol`."""
    saved = [ar.protocol for ar in ranks]
    for ar in ranks:
        ar.protocol = protocol
    try:
        yield
    finally:
        for ar, before in zip(ranks, saved):
            ar.protocol = before


def warmup_every_protocol(ar: BoundaryAllReduce, variants: Sequence[Any] | None = None) -> None:
    """`ar.warmup()` for each protocol forced in turn (a measurement forces each, whatever the switch picks); with
    `variants` (BoundaryVariants) only their peer kernels, compiled and loaded onto the GPU (what a test that calls
    nothing else needs: ranks sharing a context need each kernel loaded once)."""
    if variants is not None:
        from cute_kernels.boundary import api
        from cute_kernels.compile import warmup

        jobs = api.warmup_jobs(
            ar.hidden_size,
            arch=ar.arch,
            world_size=ar.world_size,
            ranks_per_device=ar.workspace.ranks_per_device,
            variants=variants,
            protocols=PROTOCOLS,
        )
        warmup(jobs, progress=False, device=ar.device)
        return
    with forced_protocol([ar], None):
        for protocol in PROTOCOLS:
            ar.protocol = protocol
            ar.warmup(progress=False)


def rank_sets(world: int, rows: int, hidden: int, count: int, device: torch.device) -> list[list[dict[str, Any]]]:
    """`count` input sets, each with one partial per rank and the shared streams and mixes."""
    sets = []
    for seed in range(count):
        g = torch.Generator(device=device).manual_seed(seed)
        shared = dict(
            residual=torch.randn(rows, 4, hidden, generator=g, device=device).to(torch.bfloat16),
            post=torch.rand(rows, 4, generator=g, device=device) * 2,
            comb=torch.softmax(torch.randn(rows, 4, 4, generator=g, device=device), -1),
            pre=torch.rand(rows, 4, generator=g, device=device),
            w=(1 + 0.1 * torch.randn(hidden, generator=g, device=device)).to(torch.bfloat16),
        )
        sets.append(
            [
                dict(shared, x=torch.randn(rows, hidden, generator=g, device=device).to(torch.bfloat16))
                for _ in range(world)
            ]
        )
    return sets


def boundary_call(ar: BoundaryAllReduce, s: dict[str, Any]) -> Any:
    """One public boundary call (bf16 out)."""
    return ar(s["x"], s["residual"], s["post"], s["comb"], s["pre"], s["w"], 1e-20, None)


def simulated_sequence(ranks: list[BoundaryAllReduce], sets: list[list[dict[str, Any]]]):
    """A closure: every simulated rank runs its boundaries of all `sets` back to back on its own stream, as W GPUs
    would (no join between calls: only the exchange couples the ranks)."""

    def rank(ar: BoundaryAllReduce) -> list[Any]:
        return [boundary_call(ar, s[ar.rank]) for s in sets]

    return lambda: BoundaryAllReduce.run_simulated(ranks, [rank] * len(ranks))


def one_rank_sequence(
    streams: Sequence[torch.cuda.Stream], one_rank: BoundaryAllReduce, sets: list[list[dict[str, Any]]]
):
    """A closure launching one-rank boundaries (no exchange) the way the simulated ranks launch theirs: stream i runs
    rank i's inputs of all `sets` back to back. One stream: the one-rank kernel; W streams: what W ranks cost on
    this GPU before any byte is exchanged."""
    work = [lambda i=i: [boundary_call(one_rank, s[i]) for s in sets] for i in range(len(streams))]
    return lambda: on_streams(streams, work)


def gather_sequence(ranks: list[BoundaryAllReduce], one_rank: BoundaryAllReduce, sets: list[list[dict[str, Any]]]):
    """A closure of the previous version's W > 1 path without its all-gather, launched like the ranks: every rank sums
    all partials in rank order in torch, then runs the one-rank kernel on the sum, each on its own stream."""

    def rank(i: int) -> None:
        for inputs in sets:
            s = inputs[i]
            y = ref.rank_sum([p["x"] for p in inputs])
            one_rank(y, s["residual"], s["post"], s["comb"], s["pre"], s["w"], 1e-20, None)

    return lambda: on_streams([ar.stream for ar in ranks], [lambda i=i: rank(i) for i in range(len(ranks))])


def bench_allreduce(args: argparse.Namespace, arch: str, timer: GraphTimer, copy_bw: float) -> list[dict]:
    """Simulated W-rank boundaries (both protocols) against the one-rank kernel launched the same way,
    the bytes over copy bandwidth and the gather path, per (W, H, rows)."""
    from cute_kernels.boundary import api
    from cute_kernels.compile import warmup

    device = timer.device
    out: list[dict] = []
    points = [(w, h, r) for w in args.world for h in args.hidden for r in sorted(args.rows)]
    side = torch.cuda.Stream(device)
    # The one variant timed here (bf16 partial in, bf16 out), every world size and protocol, compiled in parallel.
    variant = [api.BoundaryVariant("x", False, True, False, False)]
    jobs = [job for h in args.hidden for job in api.warmup_jobs(h, arch=arch, variants=variant)]
    for world in args.world:
        for h in args.hidden:
            jobs += api.warmup_jobs(h, arch=arch, world_size=world, ranks_per_device=world, variants=variant)
    warmup(jobs, desc="allreduce bench kernels", device=device)
    singles = {h: BoundaryAllReduce(h, max_rows=max(args.rows), device=device) for h in args.hidden}
    for world, hidden, rows in tqdm(points, desc="allreduce (simulated ranks)", unit="shape"):
        out.append(bench_point(world, hidden, rows, max(args.rows), singles[hidden], side, timer, copy_bw))
        torch.cuda.empty_cache()
    return out


def bench_point(
    world: int,
    hidden: int,
    rows: int,
    max_rows: int,
    single: BoundaryAllReduce,
    side: torch.cuda.Stream,
    timer: GraphTimer,
    copy_bw: float,
) -> dict[str, Any]:
    """One (W, H, rows) point of bench_allreduce: every time steady (long graph) and short (CALLS_PER_GRAPH)."""
    ranks = BoundaryAllReduce.simulated(hidden, world, max_rows=max_rows, device=timer.device)
    sets = rank_sets(world, rows, hidden, CALLS_PER_LONG_GRAPH, timer.device)
    row: dict[str, Any] = {"W": world, "H": hidden, "rows": rows, "simulated": True}
    row["shipped_protocol"] = protocol_for(world, hidden, rows)
    streams = [ar.stream for ar in ranks]

    def timed(key: str, sequence: Callable[[list], Callable[[], Any]]) -> None:
        steady, short = timer.steady_per_call_us(lambda n: [sequence(sets[:n])], CALLS_PER_GRAPH, CALLS_PER_LONG_GRAPH)
        row[f"{key}_us"], row[f"{key}_short_us"] = steady, short

    for protocol in ("oneshot", "twoshot"):
        with forced_protocol(ranks, protocol):
            timed(protocol, lambda ss: simulated_sequence(ranks, ss))
        row[f"{protocol}_bytes"] = world * boundary_bytes(rows, hidden) + exchange_bytes(world, rows, hidden, protocol)
    row["fused_us"] = row[f"{row['shipped_protocol']}_us"]
    timed("one_rank_forked", lambda ss: one_rank_sequence([side], single, ss))
    timed("w_one_rank_forked", lambda ss: one_rank_sequence(streams, single, ss))
    timed("gather", lambda ss: gather_sequence(ranks, single, ss))
    for protocol in ("oneshot", "twoshot"):
        extra = (row[f"{protocol}_bytes"] - boundary_bytes(rows, hidden)) / copy_bw * 1e6
        row[f"{protocol}_budget_us"] = row["one_rank_forked_us"] + extra
        row[f"{protocol}_over_budget_us"] = row[f"{protocol}_us"] - row[f"{protocol}_budget_us"]
        row[f"{protocol}_x_bytes"] = row[f"{protocol}_us"] / (row[f"{protocol}_bytes"] / copy_bw * 1e6)
        row[f"{protocol}_over_w_one_rank_us"] = row[f"{protocol}_us"] - row["w_one_rank_forked_us"]
    row["best"] = min(("oneshot", "twoshot"), key=lambda p: row[f"{p}_us"])
    return row


def print_allreduce(rows: list[dict], copy_bw: float) -> None:
    """The simulated multi-rank table and the one-shot / two-shot switch it suggests per (W, H)."""
    print(
        f"\nmulti-rank boundary, SIMULATED ranks (W kernels on one GPU, not NVLink), GPU us per call in a long graph "
        f"(marginal, {CALLS_PER_GRAPH} -> {CALLS_PER_LONG_GRAPH} calls per rank); copy {copy_bw / 1e12:.2f} TB/s"
    )
    head = (
        f"{'W':>2} {'H':>5} {'rows':>4} | {'1-shot':>7} {'2-shot':>7} {'ships':>7} | {'1 rank':>7} {'W x 1':>7} "
        f"{'gather':>7} | {'1s-bud':>7} {'2s-bud':>7} | {'1s-Wx1':>7} {'2s-Wx1':>7} | {'1s xB':>6} {'2s xB':>6}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r['W']:>2} {r['H']:>5} {r['rows']:>4} | {r['oneshot_us']:7.2f} {r['twoshot_us']:7.2f} "
            f"{r['shipped_protocol']:>7} | {r['one_rank_forked_us']:7.2f} {r['w_one_rank_forked_us']:7.2f} "
            f"{r['gather_us']:7.2f} | {r['oneshot_over_budget_us']:+7.2f} {r['twoshot_over_budget_us']:+7.2f} | "
            f"{r['oneshot_over_w_one_rank_us']:+7.2f} {r['twoshot_over_w_one_rank_us']:+7.2f} | "
            f"{r['oneshot_x_bytes']:6.2f} {r['twoshot_x_bytes']:6.2f}"
        )
    print(
        "(1 rank: the one-rank boundary on one forked stream; W x 1: W of them, one per rank stream, no exchange; "
        "1s-bud / 2s-bud: us above the one-rank kernel + the extra bytes over copy bandwidth; 1s-Wx1 / 2s-Wx1: us "
        "above W x 1; xB: time over all ranks' bytes at copy bandwidth)"
    )
    print(f"\nthe same, us per call of a {CALLS_PER_GRAPH}-call graph (its launch, fork and first call included)")
    print_us_table(
        rows,
        [("1-shot", "oneshot_short_us"), ("2-shot", "twoshot_short_us")],
        [
            ("1 rank", "one_rank_forked_short_us"),
            ("W x 1", "w_one_rank_forked_short_us"),
            ("gather", "gather_short_us"),
        ],
    )
    for key in sorted({(r["W"], r["H"]) for r in rows}):
        sel = sorted((r for r in rows if (r["W"], r["H"]) == key), key=lambda r: r["rows"])
        oneshot = [r["rows"] for r in sel if r["oneshot_us"] <= r["twoshot_us"]]
        print(f"  W={key[0]} H={key[1]}: one-shot at least as fast at rows {oneshot}")


def print_multi_gpu(rows: list[dict]) -> None:
    """The NVLink table: the fused boundary (both protocols) against NCCL / symmetric-memory all-reduce + the
    one-rank kernel, the median over samples of the slowest rank."""
    print(
        "\nmulti-rank boundary, one process per GPU (NVLink, multicast off), GPU us per call in a long graph "
        f"(marginal, {CALLS_PER_GRAPH} -> {CALLS_PER_LONG_GRAPH} calls), slowest rank"
    )
    columns = [(header, key) for key, header, _ in MULTI_GPU_SERIES]
    print_us_table(rows, columns[:2], columns[2:])


def print_us_table(rows: list[dict], fused: list[tuple[str, str]], baselines: list[tuple[str, str]]) -> None:
    """A table of (W, H, rows) | the fused columns | the baseline columns, each (header, row key), in us."""
    head = (
        f"{'W':>2} {'H':>5} {'rows':>4} | "
        + " ".join(f"{label:>7}" for label, _ in fused)
        + " | "
        + " ".join(f"{label:>7}" for label, _ in baselines)
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r['W']:>2} {r['H']:>5} {r['rows']:>4} | "
            + " ".join(f"{r[key]:7.2f}" for _, key in fused)
            + " | "
            + " ".join(f"{r[key]:7.2f}" for _, key in baselines)
        )


SIMULATED_SERIES = (
    ("oneshot_us", "one-shot"),
    ("twoshot_us", "two-shot"),
    ("one_rank_forked_us", "one rank"),
    ("w_one_rank_forked_us", "W one-rank kernels, no exchange"),
    ("gather_us", "gather path (no all-gather)"),
)
# The NVLink columns: (row key, table header, plot label); the fused protocols first, then the baselines.
MULTI_GPU_SERIES = (
    ("oneshot_us", "1-shot", "fused one-shot"),
    ("twoshot_us", "2-shot", "fused two-shot"),
    ("nccl_kernel_us", "NCCL+k", "NCCL all-reduce + one-rank kernel"),
    ("symm_oneshot_kernel_us", "symm1+k", "symm-mem one-shot + one-rank kernel"),
    ("symm_twoshot_kernel_us", "symm2+k", "symm-mem two-shot + one-rank kernel"),
)


def plot_allreduce(rows: list[dict], path: Any, *, simulated: bool = True) -> None:
    """Multi-rank us against rows, one panel per (W, H): simulated ranks, or one process per GPU."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted({(r["W"], r["H"]) for r in rows})
    worlds = sorted({k[0] for k in keys})
    hiddens = sorted({k[1] for k in keys})
    fig, axes = plt.subplots(len(worlds), len(hiddens), figsize=(4.5 * len(hiddens), 3.5 * len(worlds)), squeeze=False)
    for (world, hidden), ax in ((k, axes[worlds.index(k[0])][hiddens.index(k[1])]) for k in keys):
        sel = sorted((r for r in rows if (r["W"], r["H"]) == (world, hidden)), key=lambda r: r["rows"])
        xs = [r["rows"] for r in sel]
        series = SIMULATED_SERIES if simulated else [(key, label) for key, _, label in MULTI_GPU_SERIES]
        for key, label in series:
            ax.plot(xs, [r[key] for r in sel], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{'simulated' if simulated else 'NVLink'} W={world}, H={hidden}")
        ax.set_xlabel("rows")
        ax.set_ylabel("us per call")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ---------------------------------------------------------------------------------------------
# Several GPUs: one process per GPU, NVLink (the multi-GPU issue). Not run on one GPU.


def run_multi_gpu(args: argparse.Namespace) -> list[dict]:
    """One process per GPU: the fused boundary (both protocols) against NCCL all-reduce + the one-rank kernel,
    CUDA graphs, the median over samples of the maximum over ranks."""
    import os

    import torch.multiprocessing as mp

    for var in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
        os.environ[var] = "0" if var == "NCCL_NVLS_ENABLE" else "1"  # NVLink multicast stays off
    manager = mp.get_context("spawn").Manager()
    results = manager.list()
    for world in sorted(w for w in args.world if 2 <= w <= torch.cuda.device_count()):
        with file_rendezvous() as rendezvous:
            mp.spawn(_multi_gpu_worker, args=(world, rendezvous, args, results), nprocs=world, join=True)
    return list(results)


def _multi_gpu_worker(rank: int, world: int, rendezvous: str, args: argparse.Namespace, results: Any) -> None:
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=rendezvous, rank=rank, world_size=world)
    for hidden in args.hidden:
        _multi_gpu_hidden(rank, world, hidden, args, device, results)
        torch.cuda.empty_cache()
    dist.destroy_process_group()


def _multi_gpu_hidden(
    rank: int, world: int, hidden: int, args: argparse.Namespace, device: torch.device, results: Any
) -> None:
    """Every row count of one H on this rank's GPU; rank 0 records the rows."""
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    group = dist.group.WORLD
    ar = BoundaryAllReduce(hidden, group=group, max_rows=max(args.rows), device=device)
    one = BoundaryAllReduce(hidden, max_rows=max(args.rows), device=device)
    warmup_every_protocol(ar)
    one.warmup(progress=False)
    buf = symm_mem.empty(max(args.rows) * hidden, dtype=torch.bfloat16, device=device)
    symm_mem.rendezvous(buf, group)
    for rows in sorted(args.rows):
        s = rank_sets(1, rows, hidden, 1, device)[0][0]
        row: dict[str, Any] = {"W": world, "H": hidden, "rows": rows, "simulated": False, "path": ar.path}
        flat = buf[: rows * hidden]

        def nccl_then_kernel(s: dict = s) -> None:
            y = s["x"].float()
            dist.all_reduce(y, group=group)
            boundary_call(one, dict(s, x=y.to(torch.bfloat16)))

        def symm_oneshot_then_kernel(s: dict = s, flat: torch.Tensor = flat) -> None:
            flat.copy_(s["x"].view(-1))
            y = torch.ops.symm_mem.one_shot_all_reduce(flat, "sum", group.group_name)
            boundary_call(one, dict(s, x=y.view(s["x"].shape)))

        def symm_twoshot_then_kernel(s: dict = s, flat: torch.Tensor = flat) -> None:
            flat.copy_(s["x"].view(-1))
            torch.ops.symm_mem.two_shot_all_reduce_(flat, "sum", group.group_name)
            boundary_call(one, dict(s, x=flat.view(s["x"].shape)))

        for protocol in ("oneshot", "twoshot"):
            with forced_protocol([ar], protocol):
                row[f"{protocol}_us"], row[f"{protocol}_short_us"] = _max_over_ranks(
                    lambda s=s: boundary_call(ar, s), device
                )
        # Collectives: a failure on one rank would leave the others waiting, so none is caught here.
        for key, fn in (
            ("nccl_kernel_us", nccl_then_kernel),
            ("symm_oneshot_kernel_us", symm_oneshot_then_kernel),
            ("symm_twoshot_kernel_us", symm_twoshot_then_kernel),
        ):
            row[key], row[key.replace("_us", "_short_us")] = _max_over_ranks(fn, device)
        if rank == 0:
            results.append(row)


def _max_over_ranks(call: Any, device: torch.device) -> tuple[float, float]:
    """(marginal us per call from a CALLS_PER_GRAPH- to a CALLS_PER_LONG_GRAPH-call graph, us per call of the short
    graph), each the median over samples of the slowest rank, as the simulated table is timed."""
    short = _slowest_rank_us(call, device, CALLS_PER_GRAPH)
    long = _slowest_rank_us(call, device, CALLS_PER_LONG_GRAPH)
    return marginal_us(short, CALLS_PER_GRAPH, long, CALLS_PER_LONG_GRAPH), short


def _slowest_rank_us(call: Any, device: torch.device, calls: int, samples: int = 15) -> float:
    """Median over samples of the slowest rank's GPU time per call (a graph of `calls` calls per sample)."""
    import torch.distributed as dist

    stream = torch.cuda.Stream(device)
    with torch.cuda.stream(stream):
        for _ in range(3):
            call()
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(calls):
            call()
    per_sample = []
    for _ in range(samples):
        dist.barrier()
        t = torch.tensor([event_us(graph.replay) / calls], device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        per_sample.append(float(t))
    return statistics.median(per_sample[1:])


def measure(
    args: argparse.Namespace, arch: str, timer: GraphTimer, copy_bw: float, png: Callable[[str], Any]
) -> tuple[str, list[dict]]:
    """The multi-rank part ("nvlink": one process per GPU where there are several; else "simulated" ranks on one
    GPU) and its rows; its table printed and its plot written to png(label)."""
    if torch.cuda.device_count() > 1:
        label, rows = "nvlink", run_multi_gpu(args)
        print_multi_gpu(rows)
    else:
        label, rows = "simulated", bench_allreduce(args, arch, timer, copy_bw)
        print_allreduce(rows, copy_bw)
    plot_allreduce(rows, png(label), simulated=label == "simulated")
    return label, rows


def main(argv: list[str] | None = None) -> int:
    """`python -m bench.allreduce`: the multi-rank part alone (`make bench` runs it as --parts allreduce)."""
    import datetime as dt
    import json
    from pathlib import Path

    from cute_kernels.compile import arch_for_device

    p = argparse.ArgumentParser(prog="python -m bench.allreduce", description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--hidden", type=int, nargs="+", default=[4096, 5120, 7168])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64, 256, 512])
    p.add_argument("--replays", type=int, default=7)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = p.parse_args(argv)
    device = torch.device("cuda", torch.cuda.current_device())
    arch = arch_for_device(device)
    timer = GraphTimer(device, replays=args.replays)
    copy_bw = timer.copy_bandwidth()
    name = torch.cuda.get_device_name(device)
    print(f"{name} ({arch}), torch {torch.__version__}, copy bandwidth {copy_bw / 1e12:.2f} TB/s")
    args.out.mkdir(parents=True, exist_ok=True)
    day = dt.date.today().isoformat()
    label, rows = measure(args, arch, timer, copy_bw, lambda label: args.out / f"allreduce-{label}-{day}.png")
    stem = f"allreduce-{label}-{day}"
    (args.out / f"{stem}.json").write_text(
        json.dumps({"gpu": name, "copy_bandwidth_Bps": copy_bw, "rows": rows}, indent=1)
    )
    print(f"wrote {args.out / stem}.json and .png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
