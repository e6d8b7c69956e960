"""README's architecture map is the job -> file table a newcomer reads: every file it names exists, and every module
of the two packages (and of the bench) is in it."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def mapped_paths() -> list[str]:
    """The paths the map's first column names (a folder line sets where the indented names below it live)."""
    text = (ROOT / "README.md").read_text()
    block = re.search(r"^## Architecture\n\n```\n(.*?)^```$", text, re.S | re.M).group(1)
    paths, top = [], ""
    for line in block.splitlines():
        indent = len(line) - len(line.lstrip(" "))
        if not line.strip() or indent >= 20:  # a description's continuation
            continue
        names = [n.strip() for n in re.split(r"\s{2,}", line.strip())[0].split(",")]
        if indent == 0:
            first = names[0]
            base = first[: first.rstrip("/").rfind("/") + 1]
            top = first if first.endswith("/") else base
            paths += [first] + [base + n for n in names[1:]]
        else:
            paths += [top + n for n in names]
    return paths


def test_every_file_the_map_names_exists() -> None:
    missing = [p for p in mapped_paths() if not (ROOT / p).exists()]
    assert not missing, missing


def test_every_module_of_the_packages_and_the_bench_is_on_the_map() -> None:
    named = set(mapped_paths())
    modules = [
        p.relative_to(ROOT).as_posix()
        for folder in ("boundary", "cute_kernels", "bench")
        for p in (ROOT / folder).glob("*.py")
        if p.name != "__init__.py"
    ]
    assert modules and not [m for m in modules if m not in named], [m for m in modules if m not in named]
