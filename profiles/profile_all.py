"""`make profile`: Nsight Compute on every shipped kernel at a small and a large row count, with a short summary each.

Every (kernel of the plan, row count) is an item (`--list` prints the plan). The single-rank items all run in ONE
`ncu --clock-control none --profile-from-start off --set full` process: `profiles/run_kernel.py --batch ITEM + ITEM ...`
builds, compiles and warms up every item first, then gives each a profiled range of its own (cudaProfilerStart,
the marker, the item's one call, synchronize, cudaProfilerStop). The marker is torch.cuda._sleep(1): one launch of
PyTorch's at::cuda::(anonymous namespace)::spin_kernel, a kernel no item launches. The report's launches, in ID
(launch) order, are split at the markers: each marker opens the next item's launches, in the batch's order. Anything
but exactly one marker per item, a launch before the first marker, or an item without a launch fails the whole batch
loudly, naming what the report holds, rather than give an item another's launches; the markers are then dropped.
(NVTX ranges would need ncu's --nvtx and its filters, whose form in the raw CSV page is not checked here.)

The report for the batch is profiles/reports/<gpu>-single-rank-H<h>-rows<r1>-<r2>....ncu-rep, plus one per peer item
(git-ignored); each is read back (`ncu --import ... --csv --page raw --print-units base`) into
profiles/<gpu>-<kernel>-H<h>-rows<r>.txt: per launch the time, the achieved DRAM bandwidth, its share of the
device-to-device copy bandwidth measured at the start of the same run, the achieved occupancy and the top three
warp-stall reasons; then one table of every item, profiles/<gpu>-summary.md. Clocks are left alone, as in the benchmark.

The multi-rank boundary is SIMULATED: W ranks of BoundaryAllReduce.simulated on one GPU, sharing its SMs and HBM
(never NVLink). Kernel replay of single launches serialises them, so a rank profiled alone would wait for peers that
never run: each such item captures every rank's call in one CUDA graph (run_simulated: each rank on its own stream,
forked from one stream and joined back) and ncu profiles that graph as one workload (`--graph-profiling graph`,
one ncu process per item), its memory restored before each pass. ncu stretches that graph: W 4 x H 7168 spans
264-278 us at 16 rows under it and 16.7-20.7 us replayed without it (v27), so a second run of the same item without
the profiler (`run_kernel.py --replay-time`) gives the time: the median of its graph's replays by CUDA events, each
after an L2 flush, every rank's kernel together, on the GPU only. The summary gives ncu's span beside it, ncu's DRAM
bytes over the unprofiled time, and ncu's occupancy and stalls. Range replay (v26) also timed the host's issue of the W calls (315-610 us a range), and
application range replay, which reruns the whole program once per pass, took over 215 s an item (v25).

  python profiles/profile_all.py [--hidden 7168] [--rows 16 512] [--world 4]
  python profiles/profile_all.py --only boundary final    the kernels whose names start so
  python profiles/profile_all.py --list        the plan (no GPU needed)
  python profiles/profile_all.py --self-test   the report parsing on an embedded sample (no GPU needed)

A report's warp stalls per SASS line and opcode: `ncu --import REPORT --page source --csv --print-source sass > x.csv`,
then `python profiles/sass_stalls.py x.csv`.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime as dt
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

# profiles/ (this script's folder) is on sys.path; run_kernel puts the repository root there too (bench, cute_kernels)
from run_kernel import (
    BOUNDARY_VARIANTS,
    COEFFICIENT_VARIANTS,
    LAYER_INPUT_VARIANTS,
    OWN_PRE_VARIANTS,
    PEER_WORLD_SIZES,
    PROTOCOLS,
)
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
PROFILES = ROOT / "profiles"
REPORTS = PROFILES / "reports"
RUN_TIMEOUT_S = 1800  # one ncu run of the single-rank batch
GRAPH_TIMEOUT_S = 300  # one simulated item's graph profile (a hang fails that item, not the whole profile)
UNPROFILED_REPLAYS = 50  # replays of a simulated item's graph timed without the profiler
UNPROFILED_LINE = re.compile(r"^replay time: median ([0-9.]+) us", re.M)  # run_kernel.py --replay-time's result
MARKER = "spin_kernel"  # in the name of torch.cuda._sleep's kernel, run_kernel.py --batch's marker

NCU_COMMON = ("--clock-control", "none")
# Kernel replay profiles only what lies between cudaProfilerStart and Stop.
KERNEL_REPLAY = ("--profile-from-start", "off", "--set", "full")
# A CUDA graph profiled as one workload: the sections that hold the summary's metrics (launch statistics and
# source-level sampling belong to single kernels).
GRAPH_REPLAY = (
    "--profile-from-start",
    "off",
    *("--graph-profiling", "graph"),
    *("--section", "SpeedOfLight", "--section", "MemoryWorkloadAnalysis"),
    *("--section", "Occupancy", "--section", "WarpStateStats"),
)

TABLE_HEAD = "| kernel | H | rows | launch | time us | DRAM GB/s | % of copy | achieved occupancy % | top warp stalls |"
TABLE_RULE = "|---|---:|---:|---|---:|---:|---:|---:|---|"
# What a simulated item's numbers are of.
GRAPH_NOTE = (
    "one CUDA graph holds every rank's call, each on its rank's stream: its time is the graph's replay without the "
    f"profiler (median of {UNPROFILED_REPLAYS} replays timed by CUDA events after an L2 flush, every rank's kernel "
    "together, their waits for each other and the graph's launch included, no host issue); ncu profiles the same graph "
    "as one workload, which it stretches (its span is given beside), so its DRAM bytes are shown over the unprofiled "
    "time, and its occupancy and stalls are over its span"
)

TIME = "gpu__time_duration.sum"
DRAM = "dram__bytes.sum.per_second"
DRAM_PARTS = ("dram__bytes_read.sum.per_second", "dram__bytes_write.sum.per_second")
OCCUPANCY = "sm__warps_active.avg.pct_of_peak_sustained_active"
THEORETICAL = "sm__maximum_warps_per_active_cycle_pct"
# Warp-state metrics, per stall reason, in order of preference: the Warp State Statistics section's cycles per issued
# instruction (all cycles), the PC sampler's samples, the older latency form. Shares are of the family's sum over
# every state ("selected", the issuing warp, included), which is what ncu's rules quote.
STALL_FAMILIES = (
    (
        re.compile(r"smsp__average_warps_issue_stalled_(\w+)_per_issue_active\.ratio"),
        "warp cycles per issued instruction",
    ),
    (re.compile(r"smsp__pcsamp_warps_issue_stalled_(\w+)"), "warp-state samples"),
    (re.compile(r"smsp__average_warp_latency_issue_stalled_(\w+)(?:\.\w+)?"), "warp latency"),
)
NOT_STALLS = ("selected",)
TIME_SCALE = {
    "nsecond": 1e-9,
    "ns": 1e-9,
    "usecond": 1e-6,
    "us": 1e-6,
    "msecond": 1e-3,
    "ms": 1e-3,
    "second": 1.0,
    "s": 1.0,
}
BYTE_PREFIX = {
    "": 1.0,
    "K": 1e3,
    "M": 1e6,
    "G": 1e9,
    "T": 1e12,
    "Ki": 2.0**10,
    "Mi": 2.0**20,
    "Gi": 2.0**30,
    "Ti": 2.0**40,
}
BYTE_UNIT = re.compile(r"(Ki|Mi|Gi|Ti|K|M|G|T)?byte(?:/s|/second)?")

ABOUT = {
    "bf16": "the one-rank fused boundary, bf16 layer input",
    "mxfp8": "the one-rank fused boundary + the MXFP8 layer input",
    "fp8": "the one-rank fused boundary + the FP8 1x128 layer input (fp32 scales)",
    "aux": "the one-rank fused boundary + aux (the mean of the new streams)",
    "moe": "the one-rank fused boundary on a MoE output: top-8 finalize + shared expert",
    "residual": "the one-rank residual-only boundary (pre=None)",
    "standard": "coefficients, standard projection (no layer input)",
    "inline": "coefficients, inline form (+ the layer input)",
    "broadcast": "coefficients, broadcast form (the first layer's embedding)",
}


@dataclass(frozen=True)
class Kernel:
    """One kernel of the plan: its name in file names, its run_kernel.py arguments (beside --hidden and --rows)."""

    name: str
    args: tuple[str, ...]
    about: str
    simulated: bool = False


@dataclass(frozen=True)
class Item:
    """One profiled call: a kernel at one hidden size and row count."""

    kernel: Kernel
    hidden: int
    rows: int

    def stem(self, gpu: str) -> str:
        """The file name of its report and summary, without the extension."""
        return f"{gpu}-{self.kernel.name}-H{self.hidden}-rows{self.rows}"

    def arguments(self) -> list[str]:
        """Its run_kernel.py arguments (one item's, as in --batch)."""
        return [*self.kernel.args, "--hidden", str(self.hidden), "--rows", str(self.rows)]

    def command(self) -> list[str]:
        """The run_kernel.py command line that profiles it alone, from the repository root."""
        return ["profiles/run_kernel.py", *self.arguments()]


def batch_command(items: Sequence[Item]) -> list[str]:
    """The run_kernel.py command line that profiles single-rank `items` in one process, each after a marker."""
    command = ["profiles/run_kernel.py", "--batch"]
    for i, item in enumerate(items):
        command += ["+", *item.arguments()] if i else item.arguments()
    return command


def batch_stem(gpu: str, hidden: int, rows: Sequence[int]) -> str:
    """The file name of the single-rank batch's report, without the extension."""
    return f"{gpu}-single-rank-H{hidden}-rows{'-'.join(map(str, rows))}"


@dataclass(frozen=True)
class Launch:
    """The summary metrics of one profiled launch (or graph); None where the report lacks one."""

    name: str
    time_s: float | None
    dram_bps: float | None
    occupancy_pct: float | None
    theoretical_pct: float | None
    stalls: tuple[tuple[str, float], ...]  # (reason, share of every warp state), largest first
    stall_basis: str  # what the shares are of
    unprofiled_s: float | None = None  # a simulated graph: its replay's median time without the profiler

    def shown_time_s(self) -> float | None:
        """The time the summary gives: the unprofiled replay's where there is one (ncu stretches a graph), else ncu's."""
        return self.time_s if self.unprofiled_s is None else self.unprofiled_s

    def shown_dram_bps(self) -> float | None:
        """The DRAM bandwidth the summary gives: ncu's bytes over the shown time."""
        if self.dram_bps is None or self.time_s is None or not self.shown_time_s():
            return self.dram_bps
        return self.dram_bps * self.time_s / self.shown_time_s()  # type: ignore[operator]


Row = dict[str, tuple[str, str]]  # a row of the raw page: metric -> (value, unit)


class ProfileError(RuntimeError):
    """One run failed, or its report does not map onto its items; the message says why and where its output went."""


def kernels(world: int) -> list[Kernel]:
    """Every shipped kernel, in the plan's order."""
    plan = [Kernel(f"boundary-{v}", ("--kernel", "boundary", "--variant", v), ABOUT[v]) for v in BOUNDARY_VARIANTS]
    plan.append(Kernel("final", ("--kernel", "final"), "Boundaries.final: the fused boundary with the final norm"))
    plan.append(
        Kernel(
            "v4-final",
            ("--kernel", "v4_final"),
            "V4Boundaries.final: the fused boundary computing hc_head's weights from its new streams, then the norm",
        )
    )
    plan += [
        Kernel(f"coefficients-{v}", ("--kernel", "coefficients", "--variant", v), ABOUT[v])
        for v in COEFFICIENT_VARIANTS
    ]
    plan += [
        Kernel(
            "layer-input" + ("" if v == "bf16" else f"-{v}"),
            ("--kernel", "layer_input", "--variant", v),
            "the layer-input-only kernel (carried collapse)" + ("" if v == "bf16" else f" + the {v} form (V4)"),
        )
        for v in LAYER_INPUT_VARIANTS
    ]
    plan += [
        Kernel(
            "own-pre" + ("" if v == "bf16" else f"-{v}"),
            ("--kernel", "own_pre", "--variant", v),
            "DeepSeek-V4's own-pre coefficients variant (mixes, then the layer input collapsed with their pre)"
            + ("" if v == "bf16" else f" + the {v} form"),
        )
        for v in OWN_PRE_VARIANTS
    ]
    plan += [
        Kernel(
            f"peer-w{world}-{p}-SIMULATED",
            ("--kernel", "peer", "--world", str(world), "--protocol", p),
            f"SIMULATED: {world} ranks on one GPU, the peer boundary forced {p}, every rank's call in one CUDA graph",
            simulated=True,
        )
        for p in PROTOCOLS
    ]
    return plan


def selected(world: int, only: Sequence[str] = ()) -> list[Kernel]:
    """The plan's kernels whose names start with one of `only` (every kernel when it is empty); raises ValueError
    naming the plan when a prefix matches none."""
    every = kernels(world)
    for prefix in only:
        if not any(k.name.startswith(prefix) for k in every):
            names = ", ".join(k.name for k in every)
            raise ValueError(f"--only {prefix!r} matches no kernel of the plan ({names})")
    return [k for k in every if not only or any(k.name.startswith(p) for p in only)]


def plan(hidden: int, rows: Sequence[int], world: int, only: Sequence[str] = ()) -> list[Item]:
    """Every (kernel, row count) run at hidden size `hidden`, of the kernels `only` selects."""
    return [Item(k, hidden, r) for k in selected(world, only) for r in rows]


def ncu_runs(items: Sequence[Item]) -> int:
    """How many ncu processes `items` take: one for every single-rank item together, one per simulated item."""
    simulated = sum(item.kernel.simulated for item in items)
    return simulated + (len(items) > simulated)


def print_plan(hidden: int, rows: Sequence[int], world: int, only: Sequence[str] = ()) -> None:
    """The plan, one kernel a line, and how many items and ncu runs it makes."""
    plan_kernels = selected(world, only)
    row_text = ", ".join(map(str, rows))
    items = plan(hidden, rows, world, only)
    print(
        f"profile plan at H={hidden}, rows {row_text}: {len(plan_kernels)} kernels, {len(items)} items in "
        f"{ncu_runs(items)} ncu runs (the single-rank items in one, each SIMULATED item alone)"
    )
    for i, k in enumerate(plan_kernels, 1):
        print(f"  {i:2d}. {k.name:28s} {k.about}")


def unit_scale(unit: str) -> float:
    """The factor that takes a value in `unit` to base units (seconds, bytes, bytes/s); 1 for any other unit."""
    unit = unit.strip()
    if unit in TIME_SCALE:
        return TIME_SCALE[unit]
    match = BYTE_UNIT.fullmatch(unit)
    return BYTE_PREFIX[match.group(1) or ""] if match else 1.0


def parse_raw_csv(text: str) -> list[dict[str, tuple[str, str]]]:
    """The rows of `ncu --import R --csv --page raw`: a header of metric names, a units row, then one row per launch
    (or graph); each row as metric -> (value, unit). Lines ncu adds around the table (==PROF==, ==WARNING==) are
    skipped."""
    lines = [line for line in text.splitlines() if line.strip() and not line.startswith("==")]
    table = list(csv.reader(lines))
    if not table:
        return []
    header, body = table[0], table[1:]
    if "ID" in header:  # a launch's row has its ID; the units row has none
        i = header.index("ID")
        is_data = [len(row) > i and row[i].strip().isdigit() for row in body]
        data = [row for row, d in zip(body, is_data) if d]
        units = next((row for row, d in zip(body, is_data) if not d), [])
    else:
        units, data = (body[0], body[1:]) if body else ([], [])
    return [
        {name: (row[k] if k < len(row) else "", units[k] if k < len(units) else "") for k, name in enumerate(header)}
        for row in data
    ]


def number(row: dict[str, tuple[str, str]], name: str) -> float | None:
    """A metric's value in base units, or None where the row lacks it or it is no number (ncu writes "n/a")."""
    if name not in row:
        return None
    value, unit = row[name]
    try:
        return float(value.replace(",", "")) * unit_scale(unit)
    except ValueError:
        return None


def dram_bps(row: dict[str, tuple[str, str]]) -> float | None:
    """Achieved DRAM bandwidth (bytes read + written per second)."""
    total = number(row, DRAM)
    if total is not None:
        return total
    parts = [number(row, name) for name in DRAM_PARTS]
    return None if None in parts else sum(parts)  # type: ignore[arg-type]


def stalls(row: dict[str, tuple[str, str]]) -> tuple[tuple[tuple[str, float], ...], str]:
    """The stall reasons by share, largest first, from the first metric family the row has, and that family's basis."""
    for pattern, basis in STALL_FAMILIES:
        values: dict[str, float] = {}
        for name in row:
            match = pattern.fullmatch(name)
            value = number(row, name) if match else None
            if match and value is not None and not match.group(1).endswith("_not_issued"):
                values.setdefault(match.group(1), value)
        total = sum(values.values())
        if total > 0:
            shares = [(reason, v / total) for reason, v in values.items() if reason not in NOT_STALLS]
            return tuple(sorted(shares, key=lambda rs: -rs[1])), basis
    return (), ""


def row_name(row: dict[str, tuple[str, str]]) -> str:
    """The kernel's (or graph's) name in a row of the raw page."""
    return next((row[k][0] for k in ("Kernel Name", "Range Name", "Name") if row.get(k, ("", ""))[0]), "?")


def launch_of(row: dict[str, tuple[str, str]]) -> Launch:
    """The summary metrics of one row of the raw page."""
    name, (reasons, basis) = row_name(row), stalls(row)
    return Launch(
        name, number(row, TIME), dram_bps(row), number(row, OCCUPANCY), number(row, THEORETICAL), reasons, basis
    )


def split_at_markers(rows: Sequence[Row], count: int) -> list[list[Row]]:
    """The launches of `count` batch items, markers dropped, from the batch report's rows: in ID (launch) order each
    marker opens the next item's launches. Raises ProfileError naming every launch unless there is exactly one marker
    per item, none but a marker first, and a launch after every marker."""
    ids = [row.get("ID", ("", ""))[0].strip() for row in rows]
    if all(i.isdigit() for i in ids):
        rows = [row for _, row in sorted(zip(map(int, ids), rows), key=lambda ir: ir[0])]
    groups: list[list[Row]] = []
    early = 0  # launches before the first marker
    for row in rows:
        if MARKER in row_name(row):
            groups.append([])
        elif groups:
            groups[-1].append(row)
        else:
            early += 1
    empty = [i for i, group in enumerate(groups, 1) if not group]
    if len(groups) != count or early or empty:
        found = ", ".join("MARKER" if MARKER in row_name(row) else short_name(row_name(row)) for row in rows)
        raise ProfileError(
            f"the batch report does not split into its {count} items: {len(groups)} {MARKER} markers, {early} "
            f"launch(es) before the first, items {empty or 'none'} without a launch; its {len(rows)} launches in "
            f"order: {found or 'none'}"
        )
    return groups


def ids_text(rows: Sequence[Row]) -> str:
    """The report IDs of an item's launches, e.g. "IDs 4-5" or "ID 7"; "" where the rows lack them."""
    ids = [row.get("ID", ("", ""))[0].strip() for row in rows]
    if not ids or not all(ids):
        return ""
    return f"ID {ids[0]}" if len(ids) == 1 else f"IDs {ids[0]}-{ids[-1]}"


def combined(launches: Sequence[Launch]) -> tuple[float | None, float | None]:
    """(time, DRAM bandwidth) of every launch together; None where a launch lacks the metric."""
    times = [launch.shown_time_s() for launch in launches]
    if not launches or None in times:
        return None, None
    total = sum(times)  # type: ignore[arg-type]
    rates = [launch.shown_dram_bps() for launch in launches]
    if None in rates or total <= 0:
        return total, None
    return total, sum(r * t for r, t in zip(rates, times)) / total  # type: ignore[operator]


def short_name(name: str) -> str:
    """A CuTe DSL kernel's class and method ("kernel_cutlass_partials_kernel_cute_kernels..CoefficientsKernel_object_at
    ..." -> "CoefficientsKernel.partials_kernel"); other names cut to 48 characters."""
    match = re.match(r"kernel_cutlass_(\w+?)_cute_kernels.*?([A-Z]\w*?)_object_at", name)
    if match:
        return f"{match.group(2)}.{match.group(1)}"
    return name if len(name) <= 48 else name[:47] + "…"


def fmt(value: float | None, spec: str, scale: float = 1.0) -> str:
    """`value * scale` formatted, or "n/a"."""
    return "n/a" if value is None else format(value * scale, spec)


def pct_of_copy(bps: float | None, copy_bps: float) -> float | None:
    """A bandwidth as a percentage of the copy bandwidth."""
    return None if bps is None else 100 * bps / copy_bps


def stall_text(launch: Launch, top: int = 3) -> str:
    """The top stall reasons with their shares, e.g. "long_scoreboard 38 %, wait 12 %, barrier 9 %"."""
    return ", ".join(f"{reason} {100 * share:.0f} %" for reason, share in launch.stalls[:top]) or "n/a"


def launch_lines(launch: Launch, copy_bps: float) -> list[str]:
    """The summary of one launch, a metric a line."""
    occupancy = f"{fmt(launch.occupancy_pct, '.1f')} %"
    if launch.theoretical_pct is not None:
        occupancy += f" (theoretical {launch.theoretical_pct:.1f} %)"
    basis = f" (shares of {launch.stall_basis})" if launch.stalls else ""
    dram = launch.shown_dram_bps()
    lines = [
        f"  time                {fmt(launch.shown_time_s(), '.2f', 1e6)} us",
        f"  DRAM                {fmt(dram, '.0f', 1e-9)} GB/s = {fmt(pct_of_copy(dram, copy_bps), '.1f')} % of the copy "
        "bandwidth",
        f"  achieved occupancy  {occupancy}",
        f"  top warp stalls     {stall_text(launch)}{basis}",
    ]
    if launch.unprofiled_s is not None:
        lines[0] += f" without the profiler (median of {UNPROFILED_REPLAYS} graph replays, CUDA events)"
        lines[1] += " (ncu's bytes over that time)"
        lines.insert(1, f"  ncu's span          {fmt(launch.time_s, '.2f', 1e6)} us (the graph under Nsight Compute)")
    return lines


def summary(item: Item, launches: Sequence[Launch], report: str, context: str, copy_bps: float) -> str:
    """The text of one item's summary file; `report` says where its launches are."""
    lines = [
        f"{item.kernel.name}  H={item.hidden} rows={item.rows}: {item.kernel.about}",
        context,
        f"report   {report}",
        f"command  python {' '.join(item.command())}",
    ]
    if item.kernel.simulated:
        lines.append(f"SIMULATED: the ranks share one GPU's SMs and HBM, never NVLink; {GRAPH_NOTE}")
    for i, launch in enumerate(launches, 1):
        lines += ["", f"launch {i} of {len(launches)}: {launch.name}", *launch_lines(launch, copy_bps)]
    if len(launches) > 1:
        time_s, bps = combined(launches)
        lines += [
            "",
            f"all {len(launches)} launches: {fmt(time_s, '.2f', 1e6)} us, {fmt(bps, '.0f', 1e-9)} GB/s = "
            f"{fmt(pct_of_copy(bps, copy_bps), '.1f')} % of the copy bandwidth",
        ]
    return "\n".join(lines) + "\n"


def one_line(item: Item, launches: Sequence[Launch], copy_bps: float) -> str:
    """One run's result in a line (the progress output)."""
    time_s, bps = combined(launches)
    busiest = max(launches, key=lambda launch: launch.shown_time_s() or 0.0)
    return (
        f"{item.kernel.name} rows {item.rows}: {len(launches)} launch(es) {fmt(time_s, '.2f', 1e6)} us, "
        f"{fmt(bps, '.0f', 1e-9)} GB/s ({fmt(pct_of_copy(bps, copy_bps), '.1f')} % of copy), "
        f"occupancy {fmt(busiest.occupancy_pct, '.1f')} %, stalls {stall_text(busiest)}"
    )


def table(
    results: Sequence[tuple[Item, Sequence[Launch]]],
    failures: Sequence[tuple[Item, str]],
    gpu_name: str,
    context: str,
    copy_bps: float,
) -> str:
    """profiles/<gpu>-summary.md: every run, a launch a row (and a row for every launch together where there are several)."""
    lines = [
        f"# Nsight Compute: every shipped kernel on the {gpu_name}",
        "",
        f"`make profile` (profiles/profile_all.py). {context}. Warp stalls: each reason's share of the warp states "
        "(its cycles per issued instruction over their sum, or its PC samples). SIMULATED: W ranks on one GPU, never "
        f"NVLink; {GRAPH_NOTE}.",
        "",
        TABLE_HEAD,
        TABLE_RULE,
    ]
    for item, launches in results:
        head = f"| {item.kernel.name} | {item.hidden} | {item.rows} |"
        for i, launch in enumerate(launches, 1):
            which = short_name(launch.name) if len(launches) == 1 else f"{i}/{len(launches)} {short_name(launch.name)}"
            if launch.unprofiled_s is not None:
                which += f" (ncu's span {fmt(launch.time_s, '.2f', 1e6)} us)"
            dram = launch.shown_dram_bps()
            lines.append(
                f"{head} {which} | {fmt(launch.shown_time_s(), '.2f', 1e6)} | {fmt(dram, '.0f', 1e-9)} | "
                f"{fmt(pct_of_copy(dram, copy_bps), '.1f')} | {fmt(launch.occupancy_pct, '.1f')} | "
                f"{stall_text(launch)} |"
            )
        if len(launches) > 1:
            time_s, bps = combined(launches)
            lines.append(
                f"{head} all | {fmt(time_s, '.2f', 1e6)} | {fmt(bps, '.0f', 1e-9)} | "
                f"{fmt(pct_of_copy(bps, copy_bps), '.1f')} | | |"
            )
    for item, why in failures:
        lines.append(f"| {item.kernel.name} | {item.hidden} | {item.rows} | failed: {why} | | | | | |")
    return "\n".join(lines) + "\n"


def kept_rows(previous: str, rerun: Sequence[Item]) -> list[str]:
    """The table rows of an earlier summary (`previous`, with its own earlier rows) for items this run did not rerun,
    each after its run's context line: a partial run (--only, other --rows) keeps the rest of the table."""
    again = {(item.kernel.name, str(item.hidden), str(item.rows)) for item in rerun}
    kept: list[str] = []
    context, shown_context = "", None
    for line in previous.splitlines():
        if line.startswith("`make profile`") or line.startswith("Run of "):
            context = line.split(". Warp stalls:")[0].removeprefix("`make profile` (profiles/profile_all.py). ")
            context = context.removeprefix("Run of ").rstrip(":")
            continue
        cells = [c.strip() for c in line.split("|")]
        if len(cells) < 5 or not cells[2].isdigit() or tuple(cells[1:4]) in again:
            continue
        if context != shown_context:
            kept += ["", f"Run of {context}:", "", TABLE_HEAD, TABLE_RULE]
            shown_context = context
        kept.append(line)
    return kept


def merged_table(table_text: str, previous: str | None, rerun: Sequence[Item]) -> str:
    """This run's table, then the earlier summary's rows for the items it did not rerun (under their runs' context)."""
    kept = kept_rows(previous, rerun) if previous else []
    if not kept:
        return table_text
    return table_text + "\n## Earlier runs (items this run did not profile)\n" + "\n".join(kept) + "\n"


def run(command: Sequence[str], timeout_s: float) -> tuple[int, str]:
    """(exit status, stdout and stderr) of `command` from the repository root; on timeout its whole process group
    (ncu and the program it profiles) is killed and ProfileError raised."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p))
    with subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    ) as proc:
        try:
            out, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise ProfileError(f"no result within {timeout_s:.0f} s: {' '.join(command[:8])} ...") from None
    return proc.returncode, out


def shown(path: Path) -> str:
    """A path as printed: from the repository root where it lies inside it."""
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def ncu_command(ncu: str, stem: str, replay: Sequence[str], program: Sequence[str]) -> list[str]:
    """The ncu command line that profiles `program` into the report `stem`."""
    return [ncu, *NCU_COMMON, *replay, "-f", "-o", str(REPORTS / stem), sys.executable, *program]


def profile_rows(
    ncu: str, stem: str, replay: Sequence[str], program: Sequence[str], timeout_s: float = RUN_TIMEOUT_S
) -> list[Row]:
    """Profile `program` (run_kernel.py and its arguments) into the report `stem` and read its rows back; the ncu
    output goes to <stem>.log where anything fails."""
    report, log = REPORTS / f"{stem}.ncu-rep", REPORTS / f"{stem}.log"
    command = ncu_command(ncu, stem, replay, program)
    report.unlink(missing_ok=True)  # an earlier run's report must not pass for this one's
    status, out = run(command, timeout_s)
    if status or not report.exists():
        log.write_text(f"$ {' '.join(command)}\n{out}")
        raise ProfileError(f"ncu exited with status {status}; its output is in {shown(log)}")
    status, out = run([ncu, "--import", str(report), "--csv", "--page", "raw", "--print-units", "base"], 600)
    if status:
        log.write_text(out)
        raise ProfileError(f"ncu --import {shown(report)} exited with status {status}; see {shown(log)}")
    rows = parse_raw_csv(out)
    if not rows:
        raise ProfileError(f"{shown(report)} holds no launch: nothing ran between cudaProfilerStart and Stop")
    log.unlink(missing_ok=True)
    return rows


def profile_one(ncu: str, item: Item, gpu: str) -> tuple[list[Launch], str]:
    """Profile one item alone into its report: its launches, and where they are."""
    replay, timeout_s = (GRAPH_REPLAY, GRAPH_TIMEOUT_S) if item.kernel.simulated else (KERNEL_REPLAY, RUN_TIMEOUT_S)
    rows = profile_rows(ncu, item.stem(gpu), replay, item.command(), timeout_s)
    launches = [launch_of(row) for row in rows]
    if item.kernel.simulated:
        (graph,) = launches
        launches = [dataclasses.replace(graph, unprofiled_s=unprofiled_time_s(item))]
    return launches, f"{shown(REPORTS / item.stem(gpu))}.ncu-rep"


def unprofiled_time_s(item: Item) -> float:
    """The median time of `item`'s call (a simulated item: its graph's replay) without the profiler, in seconds."""
    command = [sys.executable, *item.command(), "--replay-time", str(UNPROFILED_REPLAYS)]
    status, out = run(command, GRAPH_TIMEOUT_S)
    match = UNPROFILED_LINE.search(out)
    if status or not match:
        raise ProfileError(f"timing the graph without ncu failed (status {status}): {out.strip()[-400:]}")
    return float(match.group(1)) * 1e-6


def profile_batch(ncu: str, items: Sequence[Item], gpu: str, stem: str) -> list[tuple[list[Launch], str]]:
    """Profile single-rank `items` in one process into the report `stem`: each item's launches, and where they are."""
    rows = profile_rows(ncu, stem, KERNEL_REPLAY, batch_command(items))
    report = f"{shown(REPORTS / stem)}.ncu-rep"
    try:
        groups = split_at_markers(rows, len(items))
    except ProfileError as exc:
        log = REPORTS / f"{stem}.log"
        log.write_text(f"{exc}\n")
        raise ProfileError(f"{exc} (also in {shown(log)})") from None
    return [
        ([launch_of(row) for row in group], f"{report} ({ids_text(group)})".removesuffix(" ()")) for group in groups
    ]


def check_machine() -> str:
    """The path of ncu; exits with status 1 and one line where ncu or a CUDA GPU is missing."""
    ncu = shutil.which("ncu")
    if ncu is None:
        sys.exit("profile_all: ncu (Nsight Compute) is not on PATH, so nothing can be profiled here")
    import torch

    if not torch.cuda.is_available():
        sys.exit("profile_all: no CUDA GPU here (torch.cuda.is_available() is False), so nothing can be profiled")
    return ncu


def copy_bandwidth() -> float:
    """The device-to-device copy bandwidth in bytes/s (bench.timing's, read + written), its buffers freed after."""
    import torch

    from bench.timing import GraphTimer

    bps = GraphTimer(torch.device("cuda", torch.cuda.current_device())).copy_bandwidth()
    torch.cuda.empty_cache()
    return bps


def gpu_names() -> tuple[str, str]:
    """(the GPU's name, its file-name form, e.g. "nvidia-h200")."""
    import torch

    name = torch.cuda.get_device_name()
    return name, re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def ncu_version(ncu: str) -> str:
    """ncu's version line, e.g. "Version 2025.3.1.0 (build ...)"."""
    status, out = run([ncu, "--version"], 60)
    lines = [line.strip() for line in out.splitlines() if line.strip()]
    return lines[-1] if status == 0 and lines else "version unknown"


def profile_all(hidden: int, rows: Sequence[int], world: int, only: Sequence[str] = ()) -> int:
    """Profile the plan, write the summaries and the table; 1 where any run failed."""
    ncu = check_machine()
    gpu_name, gpu = gpu_names()
    items = plan(hidden, rows, world, only)
    REPORTS.mkdir(parents=True, exist_ok=True)
    copy_bps = copy_bandwidth()
    date = dt.datetime.now(dt.timezone.utc).date().isoformat()
    context = (
        f"{date}, Nsight Compute {ncu_version(ncu)}, clocks not locked (--clock-control none); "
        f"copy bandwidth measured in this run {copy_bps / 1e12:.2f} TB/s"
    )
    batch = [item for item in items if not item.kernel.simulated]
    runs: list[list[Item]] = ([batch] if batch else []) + [[item] for item in items if item.kernel.simulated]
    print(f"{gpu_name}: {len(items)} items in {len(runs)} ncu runs; {context}")
    done: dict[Item, list[Launch]] = {}
    failures: list[tuple[Item, str]] = []
    bar = tqdm(runs, unit="run", dynamic_ncols=True)
    for run_items in bar:
        first = run_items[0]
        if first.kernel.simulated:
            bar.set_description(f"ncu {first.kernel.name} rows {first.rows}")
        else:
            bar.set_description(f"ncu {len(run_items)} single-rank items in one process")
        try:
            if first.kernel.simulated:
                found = [profile_one(ncu, first, gpu)]
            else:
                found = profile_batch(ncu, run_items, gpu, batch_stem(gpu, hidden, rows))
        except ProfileError as exc:
            failures += [(item, str(exc)) for item in run_items]
            names = ", ".join(f"{item.kernel.name} rows {item.rows}" for item in run_items)
            tqdm.write(f"FAILED {names}: {exc}")
            continue
        for item, (launches, report) in zip(run_items, found):
            (PROFILES / f"{item.stem(gpu)}.txt").write_text(summary(item, launches, report, context, copy_bps))
            done[item] = launches
            tqdm.write(one_line(item, launches, copy_bps))
    bar.close()
    results = [(item, done[item]) for item in items if item in done]  # the plan's order
    summary_md = PROFILES / f"{gpu}-summary.md"
    previous = summary_md.read_text() if summary_md.exists() else None
    rerun = [item for item, _ in results] + [item for item, _ in failures]
    summary_md.write_text(merged_table(table(results, failures, gpu_name, context, copy_bps), previous, rerun))
    print(f"\n{len(results)} of {len(items)} items profiled. Results:")
    print(f"  summaries  {shown(PROFILES / gpu)}-<kernel>-H{hidden}-rows<rows>.txt ({len(results)} files)")
    print(f"  table      {shown(summary_md)}")
    print(f"  reports    {shown(REPORTS / gpu)}-*.ncu-rep (open with ncu-ui, or ncu --import REPORT --page details)")
    for item, why in failures:
        print(f"  FAILED     {item.kernel.name} rows {item.rows}: {why}", file=sys.stderr)
    return 1 if failures else 0


SAMPLE_CSV = """==PROF== Disconnected from process 1719
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC",\
"dram__bytes.sum.per_second","gpu__time_duration.sum","sm__maximum_warps_per_active_cycle_pct",\
"sm__warps_active.avg.pct_of_peak_sustained_active",\
"smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio",\
"smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio",\
"smsp__average_warps_issue_stalled_selected_per_issue_active.ratio",\
"smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio",\
"smsp__average_warps_issue_stalled_wait_per_issue_active.ratio",\
"smsp__pcsamp_warps_issue_stalled_long_scoreboard","smsp__pcsamp_warps_issue_stalled_long_scoreboard_not_issued"
"","","","","","","","","","","","Gbyte/second","usecond","%","%","","","","","","",""
"0","1719","python3.12","127.0.0.1",\
"kernel_cutlass_partials_kernel_cute_kernelscoefficients_kernelCoefficientsKernel_object_at__tensorptrbf16",\
"1","7","(256, 1, 1)","(8, 32, 1)","0","9.0","2,400","10","37.5","30.25","1","3","1","2","1","5","9"
"1","1719","python3.12","127.0.0.1",\
"kernel_cutlass_finish_kernel_cute_kernelscoefficients_epilogueEpilogueRole_object_at__tensorptrf32",\
"1","7","(128, 1, 1)","(16, 1, 1)","0","9.0","n/a","2.5","","12.5","0","0","0","0","0","4","9"
"""

SAMPLE_BASE_UNITS = """"Kernel Name","gpu__time_duration.sum","dram__bytes_read.sum.per_second","dram__bytes_write.sum.per_second"
"","nsecond","byte/second","Kbyte/second"
"kernel_a","4,352","100000000000","50000000"
"""

# A batch of two items, as `ncu --csv --page raw` lists it (by ID): the first item's one launch, the second's two, each
# after a marker (torch.cuda._sleep's kernel, demangled).
SAMPLE_BATCH_CSV = """"ID","Kernel Name","gpu__time_duration.sum"
"","","nsecond"
"0","at::cuda::(anonymous namespace)::spin_kernel(long)","1,000"
"1","kernel_a","4,000"
"2","at::cuda::(anonymous namespace)::spin_kernel(long)","1,000"
"3","kernel_b1","2,000"
"4","kernel_b2","3,000"
"""


def expect_split_failure(rows: Sequence[Row], count: int, *wants: str) -> None:
    """Assert that splitting `rows` into `count` items raises ProfileError saying each of `wants`."""
    try:
        split_at_markers(rows, count)
    except ProfileError as exc:
        assert all(want in str(exc) for want in wants), (wants, str(exc))
    else:
        raise AssertionError(f"split_at_markers into {count} items did not fail")


def self_test() -> None:
    """Assert the parsing and the summary on the embedded samples of `ncu --csv --page raw` output."""
    launches = [launch_of(row) for row in parse_raw_csv(SAMPLE_CSV)]
    assert len(launches) == 2, launches
    first, second = launches
    assert short_name(first.name) == "CoefficientsKernel.partials_kernel", first.name
    assert short_name(second.name) == "EpilogueRole.finish_kernel", second.name
    assert abs(first.time_s - 10e-6) < 1e-15 and abs(first.dram_bps - 2.4e12) < 1, first
    assert first.occupancy_pct == 30.25 and first.theoretical_pct == 37.5, first
    assert first.stall_basis == "warp cycles per issued instruction", first.stall_basis
    top = [(reason, round(share, 4)) for reason, share in first.stalls[:3]]
    assert top == [("long_scoreboard", 0.375), ("short_scoreboard", 0.25), ("barrier", 0.125)], top
    assert all(reason != "selected" for reason, _ in first.stalls), first.stalls
    # The second launch: no DRAM figure ("n/a"), no theoretical occupancy, every warp-state ratio 0: the PC samples.
    assert second.dram_bps is None and second.theoretical_pct is None and second.occupancy_pct == 12.5, second
    assert second.stalls == (("long_scoreboard", 1.0),) and second.stall_basis == "warp-state samples", second
    time_s, bps = combined(launches)
    assert abs(time_s - 12.5e-6) < 1e-15 and bps is None, (time_s, bps)
    assert combined([first]) == (first.time_s, first.dram_bps)
    text = "\n".join(launch_lines(first, 4.8e12) + launch_lines(second, 4.8e12))
    for want in ("10.00 us", "2400 GB/s = 50.0 % of the copy bandwidth", "30.2 % (theoretical 37.5 %)", "n/a GB/s"):
        assert want in text, (want, text)
    assert "long_scoreboard 38 %, short_scoreboard 25 %, barrier 12 %" in text, text
    (base,) = [launch_of(row) for row in parse_raw_csv(SAMPLE_BASE_UNITS)]
    assert abs(base.time_s - 4.352e-6) < 1e-15 and abs(base.dram_bps - 1.5e11) < 1, base
    assert base.occupancy_pct is None and base.stalls == () and stall_text(base) == "n/a", base
    item = Item(kernels(4)[-1], 7168, 16)
    assert item.kernel.name == "peer-w4-twoshot-SIMULATED" and item.kernel.simulated
    assert "SIMULATED" in summary(item, [first], "the report", "context", 4.8e12)
    # A graph: the unprofiled time shown, ncu's span beside it, ncu's bytes (2.4 TB/s x 10 us) over the shown time.
    graph = dataclasses.replace(first, unprofiled_s=2e-6)
    text = summary(item, [graph], "the report", "context", 4.8e12)
    for want in ("time                2.00 us without the profiler", "ncu's span          10.00 us", "12000 GB/s"):
        assert want in text, (want, text)
    assert "| graph-less (ncu's span 10.00 us) | 2.00 | 12000 |" in table(
        [(item, [dataclasses.replace(graph, name="graph-less")])], [], "GPU", "context", 4.8e12
    )
    found = UNPROFILED_LINE.search("noise\nreplay time: median 16.70 us, min 15.01, max 33.40 over 50 calls: peer\n")
    assert found and float(found.group(1)) == 16.7, found
    batch = parse_raw_csv(SAMPLE_BATCH_CSV)
    rows_a, rows_b = split_at_markers(list(reversed(batch)), 2)  # ID order, not row order
    assert [row_name(r) for r in rows_a] == ["kernel_a"] and ids_text(rows_a) == "ID 1", rows_a
    assert [row_name(r) for r in rows_b] == ["kernel_b1", "kernel_b2"] and ids_text(rows_b) == "IDs 3-4", rows_b
    assert combined([launch_of(r) for r in rows_b])[0] == 5e-6
    expect_split_failure(batch, 3, "into its 3 items: 2 spin_kernel markers", "MARKER, kernel_a, MARKER, kernel_b1")
    expect_split_failure(batch[1:], 1, "1 launch(es) before the first", "kernel_a, MARKER, kernel_b1")
    expect_split_failure(batch[:1] + batch[2:], 2, "items [1] without a launch")
    expect_split_failure([], 1, "0 spin_kernel markers", "in order: none")
    single = plan(7168, [16, 512], 4, ["boundary-bf16", "final"])
    command = batch_command(single)
    assert command[:2] == ["profiles/run_kernel.py", "--batch"] and command.count("+") == 3, command
    assert command[2:10] == ["--kernel", "boundary", "--variant", "bf16", "--hidden", "7168", "--rows", "16"], command
    assert ncu_runs(plan(7168, [16, 512], 4)) == 5 and ncu_runs(single) == 1 and ncu_runs([item]) == 1
    text = summary(single[0], [first], "profiles/reports/x.ncu-rep (ID 1)", "context", 4.8e12)
    assert "\nreport   profiles/reports/x.ncu-rep (ID 1)\ncommand  python profiles/run_kernel.py --kernel" in text
    md = table([(plan(7168, [512], 4)[0], launches)], [(item, "ncu exited")], "GPU", "context", 4.8e12)
    assert (
        md.count("\n| boundary-bf16 | 7168 | 512 |") == 3 and "| all | 12.50 |" in md and "failed: ncu exited" in md
    ), md
    # A partial run keeps the earlier rows of the items it did not rerun, under their run's context, also when merged
    # again; the rerun item's earlier (failed) row goes.
    peer = table([(item, [first])], [], "GPU", "later context", 4.8e12)
    once = merged_table(peer, md, [item])
    assert once.startswith(peer) and "Run of context:" in once and "failed: ncu exited" not in once, once
    assert once.count("\n| boundary-bf16 | 7168 | 512 |") == 3 and once.count("| peer-w4-twoshot-SIMULATED |") == 1
    twice = merged_table(table([], [], "GPU", "third", 4.8e12), once, [])
    assert twice.count("Run of later context:") == 1 and twice.count("Run of context:") == 1, twice
    assert twice.count("\n| boundary-bf16 | 7168 | 512 |") == 3 and twice.count("| peer-w4-twoshot-SIMULATED |") == 1
    assert merged_table(peer, None, [item]) == peer


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=7168, help="hidden size H, a multiple of 256 (default 7168)")
    p.add_argument("--rows", type=int, nargs="+", default=[16, 512], help="row counts (default 16 512)")
    p.add_argument(
        "--world", type=int, default=4, choices=PEER_WORLD_SIZES, help="simulated ranks of the multi-rank boundary"
    )
    p.add_argument(
        "--only", nargs="+", default=[], metavar="PREFIX", help="profile the kernels whose names start so (see --list)"
    )
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--list", action="store_true", help="print the plan and exit (no GPU needed)")
    mode.add_argument("--self-test", action="store_true", help="check the report parsing on a sample and exit")
    args = p.parse_args(argv)
    if args.hidden <= 0 or args.hidden % 256:
        p.error(f"--hidden must be a positive multiple of 256 (the boundary's), got {args.hidden}")
    if min(args.rows) < 1:
        p.error(f"--rows must be positive, got {args.rows}")
    try:
        selected(args.world, args.only)
    except ValueError as exc:
        p.error(str(exc))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.self_test:
        self_test()
        print("profile_all self-test passed")
        return 0
    if args.list:
        print_plan(args.hidden, args.rows, args.world, args.only)
        return 0
    return profile_all(args.hidden, args.rows, args.world, args.only)


if __name__ == "__main__":
    sys.exit(main())
