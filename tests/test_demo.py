"""`python -m boundary.demo` runs, reports, and exits 0 when the two implementations agree."""

from __future__ import annotations

import subprocess
import sys

import pytest


def demo(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "boundary.demo", *args], capture_output=True, text=True, timeout=600)


def demo_here(capsys: pytest.CaptureFixture, *args: str) -> tuple[int, str, str]:
    """`python -m boundary.demo ARGS` run in this process (its main, as the module's entry calls it): (exit code,
    stdout, stderr). The test above runs it as a module once; the rest need no interpreter of their own."""
    from boundary import demo as module

    try:
        code = module.main(list(args))
    except SystemExit as exc:
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_demo_one_rank_agrees() -> None:
    out = demo("--device", "cpu", "--hidden", "1024", "--layers", "3", "--steps", "1")
    assert out.returncode == 0, out.stderr
    assert "bitwise equal" in out.stdout and "result: the scheduler and the plain implementation agree" in out.stdout
    assert "need an sm_90a" in out.stdout
    assert "ms/step" in out.stdout


@pytest.mark.parametrize("scheme", ["v4.1", "v4"])
def test_demo_two_ranks_agree(scheme: str) -> None:
    out = demo("--device", "cpu", "--tp", "2", "--hidden", "512", "--layers", "2", "--steps", "1", "--scheme", scheme)
    assert out.returncode == 0, out.stderr
    assert "TP=2" in out.stdout and "bitwise equal" in out.stdout and "DISAGREE" not in out.stdout
    assert f"DeepSeek-{scheme.upper()}-like" in out.stdout


def test_demo_runs_the_v4_scheme(capsys: pytest.CaptureFixture) -> None:
    code, out, _ = demo_here(capsys, "--device", "cpu", "--scheme", "v4", "--hidden", "512", "--layers", "3")
    assert code == 0
    assert "DeepSeek-V4-like" in out and "side streams=off" in out
    assert out.count("bitwise equal") == 4  # the warm-up and three steps


@pytest.mark.parametrize(
    "args,message", [(["--hidden", "1000"], "multiple of 256"), (["--rows", "0"], "must be positive")]
)
def test_demo_rejects_bad_arguments(args: list[str], message: str, capsys: pytest.CaptureFixture) -> None:
    code, _, err = demo_here(capsys, *args)
    assert code == 2 and message in err
