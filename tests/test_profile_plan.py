"""`make profile`'s driver on the CPU: its plan covers every shipped kernel at a small and a large row count in one ncu
run for the single-rank items (plus one per SIMULATED item), its summary parser reads ncu's raw CSV layout (an embedded
sample) into time, bandwidth, occupancy and stall shares, and splits a batch report at its markers (or fails loudly);
run_kernel.py's --batch refuses what it cannot profile in one process, and --replay-time what it cannot time."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str, script: str = "profiles/profile_all.py") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, script, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_the_plan_names_every_kernel_at_two_row_counts() -> None:
    out = _run("--list")
    assert out.returncode == 0, out.stderr
    assert "19 kernels, 38 items in 5 ncu runs" in out.stdout
    for kernel in ("boundary-bf16", "boundary-fp8", "boundary-moe", "final", "coefficients-inline", "layer-input"):
        assert kernel in out.stdout
    assert "peer-w4-oneshot-SIMULATED" in out.stdout and "peer-w4-twoshot-SIMULATED" in out.stdout
    assert "layer-input-mxfp8" in out.stdout and "layer-input-fp8" in out.stdout  # the V4 layer input's forms
    assert all(k in out.stdout for k in ("own-pre ", "own-pre-mxfp8", "own-pre-fp8"))  # DeepSeek-V4's one-launch entry


def test_only_selects_kernels_by_name_and_refuses_a_name_it_lacks() -> None:
    out = _run("--list", "--only", "boundary-fp8", "peer", "--rows", "16")
    assert out.returncode == 0, out.stderr
    assert "3 kernels, 3 items in 3 ncu runs" in out.stdout and "boundary-bf16" not in out.stdout
    out = _run("--list", "--only", "softmax")
    assert out.returncode == 2 and "--only 'softmax' matches no kernel of the plan (boundary-bf16," in out.stderr


def test_the_summary_parser_reads_the_raw_csv_layout_and_splits_a_batch_at_its_markers() -> None:
    out = _run("--self-test")
    assert out.returncode == 0, out.stderr + out.stdout
    assert "self-test passed" in out.stdout


def test_a_batch_refuses_peer_items_and_empty_items() -> None:
    batch = ("--batch", "--kernel", "boundary", "--rows", "16", "+")
    out = _run(*batch, "--kernel", "peer", "--protocol", "oneshot", script="profiles/run_kernel.py")
    assert out.returncode == 1 and "--kernel peer takes graph profiling" in out.stderr, out.stderr
    out = _run(*batch, script="profiles/run_kernel.py")
    assert out.returncode == 1 and "--batch needs one item's arguments" in out.stderr, out.stderr
    out = _run(*batch, "--kernel", "final", "--variant", "bf16", script="profiles/run_kernel.py")
    assert out.returncode == 2 and "--variant applies to --kernel" in out.stderr, out.stderr


def test_replay_time_times_one_item_alone_and_at_least_once() -> None:
    """run_kernel.py --replay-time (a simulated item's unprofiled time, which ncu's graph span is not: v27) takes at
    least one call and never a batch, whose items share one profiled process."""
    peer = ("--kernel", "peer", "--protocol", "oneshot")
    out = _run(*peer, "--replay-time", "0", script="profiles/run_kernel.py")
    assert out.returncode == 2 and "--replay-time needs at least 1 call, got 0" in out.stderr, out.stderr
    out = _run("--batch", "--kernel", "final", "--replay-time", "3", script="profiles/run_kernel.py")
    assert out.returncode == 1 and "--replay-time times one item alone: not in --batch" in out.stderr, out.stderr


def test_without_a_gpu_it_says_so_and_fails() -> None:
    out = _run()
    assert out.returncode == 1
    assert ("ncu" in out.stdout + out.stderr) or ("GPU" in out.stdout + out.stderr)


def test_each_replay_mode_gets_only_the_options_ncu_takes_with_it() -> None:
    """Both profile only what lies between cudaProfilerStart and Stop; the simulated items' CUDA graph is one workload
    (ncu --graph-profiling graph), not its kernels one by one (a rank alone would wait for peers that never run), and
    never range replay, which refuses --profile-from-start (v25) and timed the host's issue of the calls (v26)."""
    sys.path.insert(0, str(ROOT / "profiles"))
    try:
        import profile_all as pa
    finally:
        sys.path.pop(0)
    peer = pa.ncu_command("ncu", "x", pa.GRAPH_REPLAY, ["run_kernel.py"])
    single = pa.ncu_command("ncu", "x", pa.KERNEL_REPLAY, ["run_kernel.py"])
    assert peer[peer.index("--graph-profiling") + 1] == "graph" and "--replay-mode" not in peer
    assert peer[peer.index("--profile-from-start") + 1] == "off"
    assert single[single.index("--profile-from-start") + 1] == "off" and "--replay-mode" not in single
    assert "--graph-profiling" not in single
