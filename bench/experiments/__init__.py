"""One-off tools for experiments and refactors (not part of `make bench`)."""

from __future__ import annotations

import argparse
from collections.abc import Iterator, Sequence


def shape_parser(doc: str, rows: Sequence[int], hidden: Sequence[int] = (4096, 7168)) -> argparse.ArgumentParser:
    """A GPU-timing experiment's command line: --hidden, --rows and --replays, described by its docstring's first
    paragraph; the experiment adds its own options."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, nargs="+", default=list(hidden))
    ap.add_argument("--rows", type=int, nargs="+", default=list(rows))
    ap.add_argument("--replays", type=int, default=7)
    return ap


def shapes(args: argparse.Namespace) -> Iterator[tuple[int, int]]:
    """(hidden, rows) of shape_parser's command line, hidden outer; the CUDA cache emptied after each shape's work."""
    import torch

    for hidden in args.hidden:
        for rows in args.rows:
            yield hidden, rows
            torch.cuda.empty_cache()
