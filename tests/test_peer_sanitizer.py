"""compute-sanitizer memcheck, racecheck and synccheck on a small simulated W = 2 and W = 4 case of the peer
all-reduce (tests/peer_sanitizer_case.py: both protocols, inline and staged), and memcheck's negative control:
a planted out-of-bounds store it must report. GPU only; skipped where compute-sanitizer is not on the PATH."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SANITIZER = shutil.which("compute-sanitizer") or shutil.which("/usr/local/cuda/bin/compute-sanitizer")
ERROR_EXIT = 97  # what the sanitizer exits with when it found an error (the case itself exits 0 or 1)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(SANITIZER is None, reason="compute-sanitizer is not on the PATH"),
]


def sanitize(tool: str, module: str, *args: str) -> tuple[int, str]:
    """(exit status, output) of `module` (with `args`) run under compute-sanitizer's `tool`."""
    # conftest puts the working tree on $PYTHONPATH for spawned processes.
    done = subprocess.run(
        [SANITIZER, "--tool", tool, "--error-exitcode", str(ERROR_EXIT), sys.executable, "-m", module, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    return done.returncode, done.stdout + done.stderr


def warm(module: str, *args: str) -> None:
    """`module` run once unsanitized, so every kernel it launches is in the disk cache before a sanitized run: the
    compiles (in worker processes, which the sanitizer follows too) are no part of the check."""
    subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, check=True, timeout=1200)


@pytest.fixture(scope="module")
def warm_peer_case() -> None:
    """The peer case's kernels compiled before its sanitized runs."""
    warm("tests.peer_sanitizer_case")


def errors(output: str) -> int:
    """The error count of the sanitizer's summary line ("ERROR SUMMARY: n errors"; racecheck: "RACECHECK SUMMARY:
    h hazards displayed (n errors, w warnings)")."""
    found = re.findall(r"(?:ERROR SUMMARY: |RACECHECK SUMMARY: \d+ hazards? displayed \()(\d+) error", output)
    assert found, f"no ERROR SUMMARY in the sanitizer's output:\n{output[-3000:]}"
    return int(found[-1])


def report(output: str) -> str:
    """What a failure shows: the sanitizer's own lines without the host-frame stacks (each error's head, its kernel
    and address first), then the output's tail."""
    lines = [line for line in output.splitlines() if line.startswith("=========") and "Host Frame" not in line]
    return "\n".join(line for line in lines if line.strip("= "))[:6000] + "\n...\n" + output[-1500:]


@pytest.mark.parametrize("tool", ["memcheck", "racecheck", "synccheck"])
def test_the_peer_all_reduce_is_clean_under_compute_sanitizer(tool: str, warm_peer_case: None) -> None:
    status, output = sanitize(tool, "tests.peer_sanitizer_case")
    assert status == 0 and errors(output) == 0, report(output)
    assert "W=2: ok" in output and "W=4: ok" in output


def test_memcheck_reports_a_planted_out_of_bounds_store() -> None:
    status, output = sanitize("memcheck", "tests.sanitizer_planted_case")
    assert status == ERROR_EXIT and errors(output) > 0, output[-3000:]
