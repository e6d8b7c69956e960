"""Why sm_100a compiles a covering subset only (tests/compile_cover.py): no kernel takes or reads the arch."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

from cute_kernels.boundary.kernel import FusedBoundaryKernel
from cute_kernels.coefficients.kernel import CoefficientsKernel
from cute_kernels.coefficients.layer_input import LayerInputKernel
from tests.compile_cover import covering

ROOT = Path(__file__).resolve().parents[1]
# Every module that holds kernel code (a @cute.kernel or a role a kernel composes), and what it may import: the arch
# reaches a kernel only through its config, whose SM count sizes the grid.
KERNEL_MODULES = [p for p in sorted((ROOT / "cute_kernels").rglob("*.py")) if "@cute.jit" in p.read_text()]


def _arch_uses(tree: ast.AST) -> list[str]:
    """Where a module names an arch: an `arch` variable or parameter, `.arch` of anything but `cute`, or `hardware`."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id in ("arch", "hardware"):
            found.append(f"line {node.lineno}: {node.id}")
        elif isinstance(node, ast.arg) and node.arg == "arch":
            found.append(f"line {node.lineno}: parameter arch")
        elif isinstance(node, ast.Attribute) and node.attr in ("arch", "kernel_arch", "for_arch"):
            if not (isinstance(node.value, ast.Name) and node.value.id == "cute"):
                found.append(f"line {node.lineno}: .{node.attr}")
    return found


def test_no_kernel_class_takes_an_arch() -> None:
    for kernel in (FusedBoundaryKernel, CoefficientsKernel, LayerInputKernel):
        assert "arch" not in inspect.signature(kernel).parameters, kernel


def test_no_kernel_module_reads_the_arch() -> None:
    names = {p.relative_to(ROOT).as_posix() for p in KERNEL_MODULES}
    assert {"cute_kernels/boundary/kernel.py", "cute_kernels/coefficients/kernel.py"} <= names
    for path in KERNEL_MODULES:
        assert _arch_uses(ast.parse(path.read_text())) == [], path


def test_the_arch_check_finds_an_arch_branch() -> None:
    """The negative control: a kernel that branched on the arch would be caught."""
    planted = "def kernel(self, x):\n    if const_expr(self.config.arch == 'sm_100a'):\n        return x\n"
    assert _arch_uses(ast.parse(planted)) == ["line 2: .arch"]
    assert _arch_uses(ast.parse("def f(arch):\n    return cute.arch.lane_idx()\n")) == ["line 1: parameter arch"]


def test_the_cover_sets_every_feature_once_in_the_cases_order() -> None:
    cases = [("a", 1), ("a", 2), ("b", 1), ("b", 2), ("c", 1)]
    chosen = covering(cases, lambda c: enumerate(c))
    assert chosen == [("a", 1), ("b", 2), ("c", 1)]
    assert covering([], lambda c: c) == []
