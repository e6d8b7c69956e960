"""bench/experiments/v4_one_cluster.py (an experiment for #47's <= 5 us target, run on the GPU by hand): the one-launch
V4 boundary compiles for sm_90a at both DeepSeek-V4 sizes, and every fn value it holds is loaded before the PDL wait."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench.experiments.v4_one_cluster import CLUSTERS, OneClusterV4
from cute_kernels.coefficients.config import MIX

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("H", sorted(CLUSTERS))
def test_it_compiles_with_fn_loaded_before_the_wait(H: int, tmp_path: Path) -> None:
    """Before `griddepcontrol.wait`: 2 x 24 16-byte fn loads a thread (its 8 columns of each mix) and the norm
    weight's; after it no load into registers: the rows come into shared memory by cp.async."""
    env = dict(os.environ, CUTE_DSL_KEEP="ptx", CUTE_DSL_DUMP_DIR=str(tmp_path), CUTE_DSL_NO_CACHE="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "bench.experiments.v4_one_cluster", "--compile-only", "--hidden", str(H)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    (ptx,) = tmp_path.rglob("*.ptx")
    body = ptx.read_text()
    before, after = body[body.index(".entry") :].split("griddepcontrol.wait", 1)
    assert len(re.findall(r"ld\.global\.v4", before)) == 2 * MIX + 1
    assert not re.findall(r"ld\.global", after) and re.findall(r"cp\.async\.cg\.shared\.global", after)


def test_a_cluster_whose_threads_cannot_hold_fn_is_refused() -> None:
    with pytest.raises(ValueError, match="at most|<= 256"):
        OneClusterV4(7168, 8, 4)  # 4 x 112 vectors: 448 threads of 255 registers
    with pytest.raises(ValueError, match="whole vectors"):
        OneClusterV4(7168, 3, 4)
    with pytest.raises(ValueError, match="none apart from the collapse"):
        OneClusterV4(4096, 32, 4)  # 2 warps: no warp for post and pre beside the collapse and Sinkhorn
