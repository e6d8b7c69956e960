"""docs/perf-log.md is in the order its header says: the measured versions oldest first, then the end-of-session
summaries ("Where we stood") newest first, nothing of one kind among the other."""

from __future__ import annotations

import re
from pathlib import Path

LOG = Path(__file__).resolve().parents[1] / "docs" / "perf-log.md"
ORDINALS = ["first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth", "ninth", "tenth"]


def order_faults(text: str) -> list[str]:
    """What breaks the header's order: a summary before a version, versions not ascending, summaries not descending."""
    faults, versions, summaries = [], [], []
    for heading in re.findall(r"^## (.*)$", text, re.M):
        if m := re.match(r"v(\d+)\b", heading):
            if summaries:
                faults.append(f"version after a summary: {heading}")
            versions.append(int(m.group(1)))
        elif m := re.match(r"Where we stood \(end of (\d{4}-\d\d-\d\d), (\w+) session\)", heading):
            if m.group(2) not in ORDINALS:
                faults.append(f"a session ordinal the check does not know: {heading}")
                continue
            summaries.append((m.group(1), ORDINALS.index(m.group(2))))
        else:
            faults.append(f"neither a version nor a summary: {heading}")
    if versions != sorted(versions) or len(set(versions)) != len(versions):
        faults.append(f"versions not ascending: {versions}")
    if summaries != sorted(summaries, reverse=True):
        faults.append(f"summaries not newest first: {summaries}")
    return faults


def test_the_log_is_in_its_headers_order() -> None:
    assert not order_faults(LOG.read_text())


def test_a_misplaced_section_is_caught() -> None:
    text = "## v1 — a\n## v2 — b\n## Where we stood (end of 2026-11-29, third session)\n"
    assert not order_faults(text)
    assert order_faults(text + "## v3 — c\n")
    assert order_faults("## v2 — b\n## v1 — a\n")
    assert order_faults(text + "## Where we stood (end of 2026-11-30, fourth session)\n")
    assert order_faults(text.replace("Where we stood", "Where we stand"))
    assert order_faults(text.replace("third", "eleventh"))
