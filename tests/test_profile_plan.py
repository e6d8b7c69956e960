"""`make profile`'s driver on the CPU: its plan covers every shipped kernel at a small and a large row count, and its
summary parser reads ncu's raw CSV layout (an embedded sample) into time, bandwidth, occupancy and stall shares."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "profiles/profile_all.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=300
    )


def test_the_plan_names_every_kernel_at_two_row_counts() -> None:
    out = _run("--list")
    assert out.returncode == 0, out.stderr
    assert "13 kernels, 26 ncu runs" in out.stdout
    for kernel in ("boundary-bf16", "boundary-fp8", "boundary-moe", "final", "coefficients-inline", "layer-input"):
        assert kernel in out.stdout
    assert "peer-w4-oneshot-SIMULATED" in out.stdout and "peer-w4-twoshot-SIMULATED" in out.stdout


def test_only_selects_kernels_by_name_and_refuses_a_name_it_lacks() -> None:
    out = _run("--list", "--only", "boundary-fp8", "peer", "--rows", "16")
    assert out.returncode == 0, out.stderr
    assert "3 kernels, 3 ncu runs" in out.stdout and "boundary-bf16" not in out.stdout
    out = _run("--list", "--only", "softmax")
    assert out.returncode == 2 and "--only 'softmax' matches no kernel of the plan (boundary-bf16," in out.stderr


def test_the_summary_parser_reads_the_raw_csv_layout() -> None:
    out = _run("--self-test")
    assert out.returncode == 0, out.stderr + out.stdout
    assert "self-test passed" in out.stdout


def test_without_a_gpu_it_says_so_and_fails() -> None:
    out = _run()
    assert out.returncode == 1
    assert ("ncu" in out.stdout + out.stderr) or ("GPU" in out.stdout + out.stderr)
