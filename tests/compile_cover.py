"""The second compile target's sweep: a covering subset of the first target's cases.

The kernels take no arch (tests/test_compile_cover.py holds that): the target changes the SM count a launch shape is
sized for and the code generator's target, never which code a kernel emits. So every case compiles for sm_90a, the
arch the GPU tests run, and for sm_100a each compile-time choice (every value of every flag or knob) compiles at least
once, inside a case where it is actually used.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import TypeVar

Case = TypeVar("Case")


def covering(cases: Sequence[Case], features: Callable[[Case], Iterable[Hashable]]) -> list[Case]:
    """The cases, in their order, that a greedy set cover picks so that every feature of any case appears in one."""
    sets = [frozenset(features(case)) for case in cases]
    needed = frozenset().union(*sets)
    chosen: list[int] = []
    while needed:
        best = max(range(len(cases)), key=lambda i: len(sets[i] & needed))  # the first of the largest: deterministic
        chosen.append(best)
        needed -= sets[best]
    return [cases[i] for i in sorted(chosen)]
