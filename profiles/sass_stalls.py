"""Warp-stall samples and executed instructions by stall reason and by opcode, from the per-SASS table of an
Nsight Compute report (`make profile` keeps one per run under profiles/reports/):
`ncu --import profiles/reports/<gpu>-coefficients-standard-H7168-rows512.ncu-rep --page source --csv
--print-source sass > sass.csv`, then `python profiles/sass_stalls.py sass.csv`."""

from __future__ import annotations

import argparse
import collections
import csv
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class StallSummary:
    """Sample and instruction counts of one kernel's SASS table."""

    kernel: str
    samples: int = 0
    executed: int = 0
    by_reason: collections.Counter = field(default_factory=collections.Counter)
    samples_by_op: collections.Counter = field(default_factory=collections.Counter)
    executed_by_op: collections.Counter = field(default_factory=collections.Counter)
    reasons_by_op: dict = field(default_factory=lambda: collections.defaultdict(collections.Counter))


def opcode(source: str) -> str:
    """The opcode of a SASS line without its predicate and modifiers ("@!P0 LDS.128 R4, [R2]" -> "LDS")."""
    words = source.split()
    if not words:
        return "?"
    op = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]
    return op.split(".")[0]


def summarize(path: Path) -> list[StallSummary]:
    """One summary per kernel in the CSV (ncu writes a "Kernel Name" line, then a header, then its rows)."""
    summaries: list[StallSummary] = []
    header: dict[str, int] | None = None
    reasons: list[str] = []
    with open(path, newline="") as f:
        for row in csv.reader(f):
            if row and row[0] == "Kernel Name":
                summaries.append(StallSummary(row[1] if len(row) > 1 else "?"))
                header = None
                continue
            if header is None:
                if "Source" not in row:
                    continue
                header = {name: i for i, name in enumerate(row)}
                reasons = [n for n in row if n.startswith("stall_") and "Not Issued" not in n]
                if not summaries:
                    summaries.append(StallSummary("?"))
                continue
            if len(row) < len(header):
                continue
            s = summaries[-1]
            op = opcode(row[header["Source"]])
            samples = int(row[header["# Samples"]] or 0)
            executed = int(row[header["Instructions Executed"]] or 0)
            s.samples += samples
            s.executed += executed
            s.samples_by_op[op] += samples
            s.executed_by_op[op] += executed
            for reason in reasons:
                n = int(row[header[reason]] or 0)
                s.by_reason[reason] += n
                s.reasons_by_op[op][reason] += n
    return summaries


def report(s: StallSummary, top: int = 12) -> str:
    """The summary as text: stall reasons, then opcodes by samples (with their top reasons) and by count."""
    share = max(s.samples, 1)
    lines = [f"{s.kernel[:100]}", f"  {s.samples} warp-stall samples, {s.executed} warp instructions executed"]
    lines.append("  stall reasons (share of samples):")
    for reason, n in s.by_reason.most_common(top):
        lines.append(f"    {reason[6:]:20s} {n:8d} {100 * n / share:5.1f} %")
    lines.append("  opcodes by samples (their top stall reasons):")
    for op, n in s.samples_by_op.most_common(top):
        why = ", ".join(f"{r[6:]} {c}" for r, c in s.reasons_by_op[op].most_common(3) if c)
        lines.append(f"    {op:10s} {n:8d} {100 * n / share:5.1f} %   {why}")
    lines.append("  opcodes by warp instructions executed:")
    for op, n in s.executed_by_op.most_common(top):
        lines.append(f"    {op:10s} {n:10d} {100 * n / max(s.executed, 1):5.1f} %")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("csv", type=Path, nargs="+")
    p.add_argument("--top", type=int, default=12, help="rows per table")
    args = p.parse_args()
    for path in args.csv:
        for s in summarize(path):
            print(report(s, args.top))


if __name__ == "__main__":
    main()
