"""CONTRACT §5's signature blocks are the code's: every `def` written there, in its class or at the top, has the
parameters of the public object it names (names, order, positional or keyword-only, and the defaults it writes)."""

from __future__ import annotations

import ast
import inspect
import re
import textwrap
from pathlib import Path

import pytest

import boundary

ROOT = Path(__file__).resolve().parents[1]


def section5_blocks(text: str) -> list[str]:
    """The ```python blocks of CONTRACT §5."""
    section = text.split("\n## 5.", 1)[1].split("\n## 6.", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)


def documented_defs(block: str) -> list[tuple[str | None, str, ast.arguments]]:
    """(class or None, name, arguments) of each `def` a block writes out; a shorthand (`<same positional>`) is left
    out."""
    out: list[tuple[str | None, str, ast.arguments]] = []
    lines, owner, i = block.splitlines(), None, 0
    while i < len(lines):
        line = lines[i]
        if m := re.match(r"class (\w+)", line):
            owner = m.group(1)
        elif re.match(r"\S", line) and not line.startswith("@"):
            owner = None if line.startswith("def ") else owner
        if re.match(r"\s*def \w+\(", line):
            stmt = [line.split("#")[0]]
            while not re.search(r"\)( -> .*)?: \.\.\.", " ".join(stmt)) and i + 1 < len(lines):
                i += 1
                stmt.append(lines[i].split("#")[0])
            source = textwrap.dedent("\n".join(stmt))
            if "<" not in source:
                source = re.sub(r"\) ->[^:]*:\s*\.\.\.", "): ...", source, flags=re.S)
                func = ast.parse(source.strip()).body[0]
                assert isinstance(func, ast.FunctionDef)
                out.append((None if line.startswith("def ") else owner, func.name, func.args))
        i += 1
    return out


def mismatches(owner: str | None, name: str, args: ast.arguments) -> list[str]:
    """How the code's signature of owner.name differs from the written one."""
    obj = getattr(boundary, owner) if owner else getattr(boundary, name)
    target = getattr(obj, name) if owner else obj
    params = [p for p in inspect.signature(target).parameters.values() if p.name not in ("self", "cls")]
    written = [(a.arg, "positional") for a in args.posonlyargs + args.args if a.arg not in ("self", "cls")]
    written += [(a.arg, "keyword-only") for a in args.kwonlyargs]
    code = [(p.name, "keyword-only" if p.kind is p.KEYWORD_ONLY else "positional") for p in params]
    problems = [f"{owner}.{name}: written {written}, code {code}"] if written != code else []
    defaults = dict(zip([a.arg for a in args.args][len(args.args) - len(args.defaults) :], args.defaults))
    defaults |= {a.arg: d for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None}
    by_name = {p.name: p for p in params}
    for pname, node in defaults.items():
        try:
            value = ast.literal_eval(node)
        except ValueError:
            continue  # a name (a module constant): not compared
        if pname in by_name and by_name[pname].default != value:
            problems.append(f"{owner}.{name}({pname}=...): written {value!r}, code {by_name[pname].default!r}")
    return problems


DEFS = [d for block in section5_blocks((ROOT / "docs" / "CONTRACT.md").read_text()) for d in documented_defs(block)]


def test_the_blocks_write_out_every_public_call() -> None:
    names = {(owner, name) for owner, name, _ in DEFS}
    for owner in ("Boundaries", "V4Boundaries", "BoundaryAllReduce"):
        assert (owner, "__init__") in names
    assert ("Boundaries", "sublayer") in names and ("V4Boundaries", "final") in names
    assert (None, "mhc_pre_delayed") in names and ("BoundaryAllReduce", "simulated") in names
    assert len(DEFS) >= 25


@pytest.mark.parametrize("owner,name,args", DEFS, ids=[f"{o}.{n}" if o else n for o, n, _ in DEFS])
def test_each_written_signature_is_the_codes(owner: str | None, name: str, args: ast.arguments) -> None:
    assert mismatches(owner, name, args) == []


def test_a_wrong_written_signature_is_caught() -> None:
    """The negative control: a renamed parameter, a keyword-only one written positional, and another default."""
    (bad,) = documented_defs(
        "class Boundaries:\n    def sublayer(self, layer, ffn, state, stage, quantize=True): ...\n"
    )
    found = mismatches(*bad)
    assert any("written" in p and "stage" in p for p in found)
    (default,) = documented_defs(
        "class Boundaries:\n    def sublayer(self, layer, ffn, state, step, *, quantize=True, capture_aux=False): ...\n"
    )
    assert mismatches(*default) == ["Boundaries.sublayer(quantize=...): written True, code False"]
