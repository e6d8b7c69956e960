"""The start-delay diagnostic (bench.start_delay): its stamp kernel compiles for sm_90a, and its table."""

from __future__ import annotations

import pytest
import torch

from bench import start_delay


def test_the_stamp_kernel_compiles_plain_and_pdl_launched() -> None:
    kernels = start_delay.compile_stamps("sm_90a")
    assert set(kernels) == {False, True}


def test_the_summary_is_the_mean_and_the_90th_percentile() -> None:
    # ticks of 256 ns: a mean resolves below a tick, the 90th percentile shows a tail
    values = [0.0] * 5 + [256.0] * 4 + [2560.0]
    mean, p90 = start_delay.summary(values)
    assert mean == pytest.approx((4 * 256 + 2560) / 10)
    assert 256 < p90 <= 2560


def test_the_table_prints_one_line_per_join_and_launch(capsys: pytest.CaptureFixture[str]) -> None:
    rows = [
        {"join": join, "pdl": pdl, "last_ns": (100.0, 200.0), "boundary_ns": (1900.0, 2300.0)}
        for pdl in (True, False)
        for join in start_delay.JOINS
    ]
    start_delay.print_start_delays(rows)
    out = capsys.readouterr().out
    assert out.count("|") == 2 * (1 + len(rows))
    assert "   early             PDL |    100 /   200 |   1900 /  2300" in out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_the_stamps_follow_the_graphs_order_and_spins() -> None:
    """Every kernel starts after its predecessor ends (the PDL-launched boundary too: its stamp follows its wait), and
    a start delay is a launch's, far below the sublayer's spin."""
    from cute_kernels.compile import arch_for_device

    device = torch.device("cuda", torch.cuda.current_device())
    rows = start_delay.measure(device, arch_for_device(device))
    assert [(r["join"], r["pdl"]) for r in rows] == [(j, p) for p in (True, False) for j in start_delay.JOINS]
    for r in rows:
        for mean, p90 in (r["last_ns"], r["boundary_ns"]):
            assert 0 <= mean and 0 <= p90 < start_delay.SPIN_NS["sublayer"], r
