"""Every public signature takes the module's calls (SPEC §5 as vLLM's `specialized_decode/boundary` documents them).

The module's signatures are written out below as that documentation gives them. Each of ours must accept every call
the module's could: the same parameter names, positional ones at the same places, the same defaults; anything we add
has a default. Every deliberate difference (an added parameter, another default) is a row of the table in CONTRACT §5,
"Where our signatures differ from the module's", and every row of that table is a real difference.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path
from typing import Any

import pytest

import boundary

ROOT = Path(__file__).resolve().parents[1]
ANY = object()  # a default the module leaves open ("timeout_us: int = ...")

# name -> the module's signature, transcribed from its documentation (SPEC §5, §4c).
MODULE: dict[str, str] = {
    "DecodeStep": "(rows, side_stream)",
    "DecodeStep.for_rows": "(rows, overlap_max_rows=MHC_OVERLAP_MAX_ROWS)",
    "UnfinalizedMoEOutput": "(gemm2_permuted, expert_weights, expanded_idx_to_permuted_idx)",
    "MoEOutput": "(routed, shared_output)",
    "QuantizedActivation": "(data, scale, orig_dtype, orig_shape, quant_key)",
    "BoundaryState": "(residual, post, comb, pre, pending=None)",
    "BoundaryAllReduce.__init__": "(self, hidden_size, *, group=None, max_rows=512, hc_mult=4, device=None)",
    "BoundaryAllReduce.mailbox": "(self, rows)",
    "BoundaryAllReduce.__call__": "(self, x, residual, post, comb, pre, norm_weight, norm_eps, mxfp8_out)",
    "BoundaryAllReduce.finalize": (
        "(self, gemm2_permuted, expert_weights, expanded_idx_to_permuted_idx, shared_output, residual, post, comb, "
        "pre, norm_weight, norm_eps, mxfp8_out)"
    ),
    "BoundaryAllReduce.warmup": "(self, max_rows=None)",
    "BoundaryAllReduce.check": "(self)",
    "BoundaryAllReduce.simulated": "(hidden_size, world_size, *, max_rows=512, device=None, timeout_us=ANY)",
    "BoundaryAllReduce.run_simulated": "(ranks, calls)",
    "Boundaries.__init__": "(self, all_reduce)",
    "Boundaries.first": "(self, layer, x, step)",
    "Boundaries.pre": "(self, layer, residual, state, step)",
    "Boundaries.sublayer": "(self, layer, ffn, state, step, *, quantize=False, capture_aux=False)",
    "Boundaries.post_only": "(self, state)",
    "Boundaries.join": "(self, layer, step)",
    "Boundaries.final": "(self, state, norm)",
    "empty_quantized_layer_input": "(num_tokens, hidden_size, device)",
    "mxfp8_scale_bytes": "(num_tokens, hidden_size)",
    "mhc_pre_delayed": (
        "(residual, fn, hc_scale, hc_base, rms_eps, hc_pre_eps, hc_sinkhorn_eps, hc_post_mult_value, "
        "sinkhorn_repeat, pre_mix=None, x=None, norm_weight=None, norm_eps=1e-6)"
    ),
    "mhc_pre_delayed_overlap": (
        "(residual, fn, hc_scale, hc_base, rms_eps, hc_pre_eps, hc_sinkhorn_eps, hc_post_mult_value, "
        "sinkhorn_repeat, pre_mix=None, x=None, norm_weight=None, norm_eps=1e-6, *, stream, layer_input=None)"
    ),
    "mhc_post": "(x, residual, post, comb)",
}


def module_signature(text: str) -> inspect.Signature:
    namespace: dict[str, Any] = {"ANY": ANY, "MHC_OVERLAP_MAX_ROWS": boundary.MHC_OVERLAP_MAX_ROWS}
    exec(f"def f{text}: pass", namespace)
    return inspect.signature(namespace["f"])


def ours(name: str) -> Any:
    """Our callable of that name, as the module's signature writes it: methods with self, classmethods without cls."""
    obj: Any = boundary
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def differences_table() -> dict[str, set[str]]:
    """CONTRACT §5's table of differences: API name -> the parameters a row names."""
    text = (ROOT / "docs" / "CONTRACT.md").read_text()
    start = text.index("### Where our signatures differ from the module's")
    lines = text[start:].splitlines()[1:]
    first = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows: dict[str, set[str]] = {}
    for line in lines[first:]:
        if not line.startswith("|"):
            break  # the table's end
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[0].startswith("`"):
            rows.setdefault(cells[0].strip("`"), set()).update(re.findall(r"`(\w+)`", cells[1]))
    return rows


def differences(name: str) -> set[str]:
    """The parameters of `name` that differ from the module's: added, or with another default."""
    theirs = module_signature(MODULE[name]).parameters
    mine = inspect.signature(ours(name)).parameters
    changed = set(mine) - set(theirs)
    for param in theirs.values():
        default = mine[param.name].default if param.name in mine else None
        if param.default is not inspect.Parameter.empty and param.default is not ANY and default != param.default:
            changed.add(param.name)
    return changed


@pytest.mark.parametrize("name", sorted(MODULE))
def test_our_signature_takes_every_call_of_the_modules(name: str) -> None:
    theirs = list(module_signature(MODULE[name]).parameters.values())
    mine = inspect.signature(ours(name)).parameters
    listed = differences_table().get(name, set())
    positional = list(mine.values())
    for index, param in enumerate(theirs):
        assert param.name in mine, f"{name} lacks the module's parameter {param.name!r}"
        got = mine[param.name]
        if param.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD:
            assert positional[index].name == param.name, f"{name}: {param.name!r} is not at place {index}"
            assert got.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD, f"{name}: {param.name!r} is not positional"
        if param.default is inspect.Parameter.empty:
            assert got.default is inspect.Parameter.empty or param.name in listed, (
                f"{name}: {param.name!r} has a default the module's lacks, not listed in CONTRACT"
            )
    for extra in set(mine) - {p.name for p in theirs}:
        assert mine[extra].default is not inspect.Parameter.empty, f"{name}: our extra {extra!r} needs a default"
    assert differences(name) == listed, (
        f"{name}: CONTRACT §5's table lists {sorted(listed)}, the signatures differ in {sorted(differences(name))}"
    )


def test_the_differences_table_names_only_real_apis() -> None:
    assert set(differences_table()) <= set(MODULE), set(differences_table()) - set(MODULE)
