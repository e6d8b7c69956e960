"""compute-sanitizer memcheck, racecheck, synccheck and initcheck on DeepSeek-V4's own-pre entry
(tests/own_pre_sanitizer_case.py: the one-launch tile and the partials schedule's finish kernel, bf16, MXFP8 and FP8
1x128, at H 2048 and 1024, where a pass holds two rows; the fused boundary that computes its own pre, at one rank and
on 2 simulated ranks but for initcheck): the worker warps' named barriers and shared buffers beside the Sinkhorn warp,
the boundary's second cluster exchange. GPU only; skipped where compute-sanitizer is not on the PATH (memcheck's
negative control is test_peer_sanitizer's planted store)."""

from __future__ import annotations

import pytest

from tests.test_peer_sanitizer import errors, pytestmark, report, sanitize, warm  # noqa: F401  (the GPU and sanitizer marks)

CASE = "tests.own_pre_sanitizer_case"


@pytest.fixture(scope="module", autouse=True)
def warm_cache() -> None:
    """The own-pre case's kernels compiled before its sanitized runs."""
    warm(CASE)


@pytest.mark.parametrize("tool", ["memcheck", "racecheck", "synccheck", "initcheck"])
def test_the_own_pre_entry_is_clean_under_compute_sanitizer(tool: str) -> None:
    # initcheck runs one kernel at a time: a simulated rank's boundary would wait for a peer that never starts.
    one_rank = tool == "initcheck"
    status, output = sanitize(tool, CASE, *(["--one-rank"] if one_rank else []))
    assert status == 0 and errors(output) == 0, report(output)
    for hidden in (2048, 1024):
        for rows in (1, 5):
            for form in (None, "mxfp8", "fp8_1x128"):
                assert f"own-pre H={hidden} rows={rows} form={form}: ok" in output
            assert f"own-pre boundary H={hidden} rows={rows}: ok" in output
    for protocol in () if one_rank else ("oneshot", "twoshot"):
        for rows in (5, 40):
            assert f"own-pre boundary W=2 {protocol} rows={rows}: ok" in output
