"""The README's snippet and docs/INTEGRATION.md's worked example run as written; the guide's claims hold on the CPU."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from boundary import Boundaries, BoundaryAllReduce, DecodeStep, mhc_pre_delayed
from boundary.toy import ToyConfig, ToyModel, decode_step_plain, random_tokens
from boundary.types import MHCLayer
from cute_kernels import compile as kernel_compile
from tests.bf16 import bitwise_equal

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "INTEGRATION.md"
RUN_MARK = "<!-- runs in the tests -->"
BF16 = torch.bfloat16


def python_blocks(text: str) -> list[tuple[int, str]]:
    """(offset, code) of every ```python block of a Markdown text."""
    return [(m.start(), m.group(1)) for m in re.finditer(r"^```python\n(.*?)^```$", text, re.S | re.M)]


def section(text: str, heading: str) -> str:
    """The Markdown text under `heading`, up to the next heading of the same level."""
    level = heading.split(" ")[0]
    start = text.index(heading + "\n")
    following = re.search(rf"^{level} ", text[start + len(heading) :], re.M)
    return text[start : start + len(heading) + (following.start() if following else len(text))]


def run(code: str, name: str) -> dict:
    """Run a documented snippet as a module of its own; returns its globals."""
    namespace: dict = {"__name__": name}
    exec(compile(code, name, "exec"), namespace)
    return namespace


def assert_same_step(hidden: torch.Tensor, moe_input, model: ToyModel, tokens: torch.Tensor) -> None:
    """The bits of the toy's plain decode step: the final hidden state and, when given, the last MoE input."""
    plain = decode_step_plain(model, tokens)
    assert bitwise_equal(hidden, plain.hidden)
    if moe_input is not None:
        assert torch.equal(moe_input.data.view(torch.uint8), plain.moe_input_mxfp8.data.view(torch.uint8))
        assert torch.equal(moe_input.scale, plain.moe_input_mxfp8.scale)


def test_readme_snippet_runs_as_written_and_matches_the_toy() -> None:
    blocks = python_blocks(section((ROOT / "README.md").read_text(), "## Integrating"))
    assert len(blocks) == 1
    ns = run(blocks[0][1], "README.md")
    assert ns["model"].config == ToyConfig(), "the snippet runs the toy at its default settings"
    assert_same_step(ns["hidden"], None, ns["model"], ns["tokens"])


def test_guide_worked_example_gives_the_bits_of_the_plain_toy() -> None:
    text = GUIDE.read_text()
    marked = [code for start, code in python_blocks(text) if text[:start].rstrip().endswith(RUN_MARK)]
    assert len(marked) == 1
    ns = run(marked[0], "docs/INTEGRATION.md")
    model = ns["model"]
    assert model.config == ToyConfig() and model.config.engram_layers == (1,)
    assert_same_step(ns["hidden"], ns["moe_input"], model, ns["tokens"])
    for rows in (1, 9):  # the example's decode() at other row counts
        tokens = random_tokens(model, rows, 10 + rows)
        hidden, moe_input = ns["decode"](tokens)
        ns["all_reduce"].check()
        assert_same_step(hidden, moe_input, model, tokens)


def test_guide_custom_ops_example_compiles_in_one_graph_with_the_direct_paths_bits() -> None:
    """The compiled-model example runs as written (Inductor on the CPU) and gives the direct path's bits.

    Its model has an Engram seam, so this is also the test that Inductor compiles a whole step around post_only, which
    mutates nothing (while it declared aux_out mutated and the call passed None, Inductor failed on "getitem is not an
    OpOverload"). Our ops are opaque to Inductor; on the CPU its code for the toy's sublayers rounds as eager does."""
    from boundary.toy import compare, decode_step

    torch._dynamo.reset()
    text = GUIDE.read_text()
    mark = "<!-- runs in the tests: custom ops -->"
    marked = [code for start, code in python_blocks(text) if text[:start].rstrip().endswith(mark)]
    assert len(marked) == 1 and "torch.compile(decode_step, fullgraph=True)" in marked[0]  # Inductor, the default
    ns = run(marked[0], "docs/INTEGRATION.md (custom ops)")
    model, step = ns["model"], ns["step"]
    assert any(layer.engram for layer in model.layers), "an Engram seam"
    want = decode_step(model, Boundaries(ns["all_reduce"]), random_tokens(model, 4, 0), step)
    assert compare(ns["out"], want)["bitwise"]


def test_guide_covers_what_an_integrator_needs() -> None:
    headings = set(re.findall(r"^## (.+)$", GUIDE.read_text(), re.M))
    for needed in (
        "The layer protocol",
        "The workspace and its lifetime",
        "Warm-up before capture",
        "Errors, `check()` and `reset()`",
        "The Engram seam",
        "The final boundary",
        "Several ranks: a TP group",
        "The kernel cache",
        "NaN and inf inputs",
        "Compiled models: the custom ops",
    ):
        assert needed in headings, needed


def test_guide_lists_exactly_the_layer_attributes_the_scheduler_reads() -> None:
    table = section(GUIDE.read_text(), "## The layer protocol")
    documented = re.findall(r"^\| `(\w+)` \|", table, re.M)
    assert sorted(documented) == sorted(MHCLayer.__annotations__)
    toy_layer = ToyModel(ToyConfig(hidden_size=256, num_layers=1, vocab=8)).layers[0]
    assert all(hasattr(toy_layer, name) for name in documented)


def test_guide_cache_variables_do_what_it_says(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    cache = section(GUIDE.read_text(), "## The kernel cache")
    for var in ("MHC_BOUNDARY_CACHE_DIR", "MHC_BOUNDARY_DISK_CACHE", "MHC_BOUNDARY_SM_COUNT"):
        assert f"${var}" in cache
    monkeypatch.delenv("MHC_BOUNDARY_CACHE_DIR", raising=False)
    assert kernel_compile.cache_dir().name == "mhc_boundary_cache"
    monkeypatch.setenv("MHC_BOUNDARY_CACHE_DIR", str(tmp_path))
    assert kernel_compile.cache_dir() == tmp_path
    monkeypatch.setenv("MHC_BOUNDARY_DISK_CACHE", "0")
    assert not kernel_compile.disk_cache_enabled()


def test_check_reports_a_bad_moe_index_once_on_the_cpu() -> None:
    model = ToyModel(ToyConfig(hidden_size=512, num_layers=1, vocab=64))
    ar = BoundaryAllReduce(512, max_rows=8, device="cpu")
    boundaries, tokens, step = Boundaries(ar), random_tokens(model, 3, 0), DecodeStep.for_rows(3)
    layer = model.layers[0]
    state, x = boundaries.first(layer, model.embed[tokens], step)
    state.pending = model.attention(layer, x)
    state, x, _, _ = boundaries.sublayer(layer, True, state, step)
    state.pending = model.moe(layer, x)
    state.pending.routed.expanded_idx_to_permuted_idx[1, 0] = 10**6
    boundaries.post_only(state)
    with pytest.raises(ValueError, match=r"held 1000000 in row 1"):
        ar.check()
    ar.check()  # reported once; the workspace stays usable
    ar.reset()
    ar.check()


def test_nan_and_inf_stay_in_their_row() -> None:
    rows, hidden, nan_row, inf_row = 6, 512, 1, 4
    model = ToyModel(ToyConfig(hidden_size=hidden, num_layers=2, vocab=64))
    tokens = random_tokens(model, rows, 0)
    step = DecodeStep.for_rows(rows)

    def two_boundaries(poison: bool) -> list[torch.Tensor]:
        """The boundary after layer 0's attention (partial poisoned or not), its mixes, and the one after."""
        boundaries = Boundaries(BoundaryAllReduce(hidden, max_rows=8, device="cpu"))
        layer = model.layers[0]
        state, x = boundaries.first(layer, model.embed[tokens], step)
        partial = model.attention(layer, x)
        if poison:
            partial[nan_row, 3], partial[inf_row, 9] = float("nan"), float("inf")
        state.pending = partial
        state, x, _, _ = boundaries.sublayer(layer, True, state, step)
        first = [state.residual, x, state.post, state.comb, state.pre]
        state.pending = model.moe(layer, torch.zeros_like(x))  # a finite partial in every row
        state, x, _, _ = boundaries.sublayer(model.layers[1], False, state, step)
        return first + [state.residual, x]

    clean, dirty = two_boundaries(False), two_boundaries(True)
    others = [r for r in range(rows) if r not in (nan_row, inf_row)]
    for a, b in zip(clean, dirty):
        assert bitwise_equal(a[others], b[others])
    residual, x, post, comb, pre, next_residual, next_x = dirty
    assert x[nan_row].isnan().all() and residual[nan_row].isnan().any()
    assert residual[inf_row, :, 9].isinf().all() and residual[inf_row].isfinite().sum() == 4 * hidden - 4
    assert x[inf_row, 9].isnan() and (x[inf_row, torch.arange(hidden) != 9] == 0).all()
    for mix in (post, comb, pre):
        assert mix[[nan_row, inf_row]].isnan().all()
    for out in (next_residual, next_x):
        assert out[[nan_row, inf_row]].isnan().all()


def test_mixes_of_a_non_finite_row_stay_in_that_row() -> None:
    rows, hidden = 5, 256
    layer = ToyModel(ToyConfig(hidden_size=hidden, num_layers=1, vocab=8)).layers[0]
    g = torch.Generator().manual_seed(3)
    streams = torch.randn(rows, 4, hidden, generator=g).to(BF16)
    args = (layer.hc_attn_fn, layer.hc_attn_scale, layer.hc_attn_base, 1e-20, 1e-6, 1e-6, 2.0, 20)
    clean = mhc_pre_delayed(streams, *args)
    streams[2, 1, 7], streams[3, 0, 0] = float("nan"), float("-inf")
    dirty = mhc_pre_delayed(streams, *args)
    for a, b in zip(clean, dirty):  # post, comb, layer input (stream 0 here: no carried pre), next pre
        assert bitwise_equal(a[[0, 1, 4]], b[[0, 1, 4]])
    for mix in (dirty[0], dirty[1], dirty[3]):
        assert mix[[2, 3]].isnan().all()
