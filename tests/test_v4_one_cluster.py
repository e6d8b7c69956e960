"""bench/experiments/v4_one_cluster.py (an experiment for #47's <= 5 us target, run on the GPU by hand): both one-launch
V4 boundaries (and the exact one's MXFP8 form) compile for sm_90a at both DeepSeek-V4 sizes, every fn value they hold
loaded before the PDL wait (or, with --prefetch, asked into L2 first); the exact one's split is the coefficients
kernel's; the step experiment (v4_one_cluster_step.py) hands the kernel its arguments in the order it reads them."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench.experiments.v4_one_cluster import CLUSTERS, OneClusterV4, OneClusterV4Exact
from cute_kernels.coefficients.config import MIX

ROOT = Path(__file__).resolve().parents[1]


CASES = [
    ("fma", "bf16"),
    ("exact", "bf16"),
    ("exact", "mxfp8"),
    ("exact", "fp8"),
    ("persistent", "bf16"),
    ("persistent", "mxfp8"),
    ("persistent", "fp8"),
]


def _entry_ptx(tmp_path: Path, H: int, variant: str, form: str, *extra: str) -> tuple[str, str]:
    """The kernel's PTX compiled by the experiment's CLI (--compile-only), split at `griddepcontrol.wait`. (One compile
    a process: the DSL's dump names of two forms can be the same.)"""
    env = dict(os.environ, CUTE_DSL_KEEP="ptx", CUTE_DSL_DUMP_DIR=str(tmp_path), CUTE_DSL_NO_CACHE="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "bench.experiments.v4_one_cluster", "--compile-only", "--hidden", str(H)]
    cmd += ["--variant", variant, "--forms", form, *extra]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    (ptx,) = tmp_path.rglob("*.ptx")
    body = ptx.read_text()
    before, after = body[body.index(".entry") :].split("griddepcontrol.wait", 1)
    return before, after


@pytest.mark.parametrize(("variant", "form"), CASES)
@pytest.mark.parametrize("H", sorted(CLUSTERS))
def test_every_form_compiles_with_fn_loaded_before_the_wait(H: int, variant: str, form: str, tmp_path: Path) -> None:
    """Before `griddepcontrol.wait`: 2 x 24 16-byte fn loads a thread (its 8 columns of each mix, or 8 chunks x 3
    n-tiles of 8 fn values) and the norm weight's (1, or its task's 4 vectors), no L2 prefetch; after it no load into
    registers: the rows come into shared memory by cp.async. The MXFP8 form stores single scale bytes."""
    before, after = _entry_ptx(tmp_path, H, variant, form)
    weights = 1 if variant == "fma" else 4
    assert len(re.findall(r"ld\.global\.v4", before)) == 2 * MIX + weights
    assert "prefetch.global.L2" not in before
    assert not re.findall(r"ld\.global", after) and re.findall(r"cp\.async\.cg\.shared\.global", after)
    assert bool(re.findall(r"st\.global\.u8", after)) == (form == "mxfp8")


@pytest.mark.parametrize("variant", ["fma", "exact"])
def test_the_prefetch_form_asks_for_the_ctas_fn_lines_before_its_register_loads(variant: str, tmp_path: Path) -> None:
    """--prefetch: a loop of `prefetch.global.L2` before the first fn load, the loads themselves unchanged, nothing
    more after the wait."""
    before, after = _entry_ptx(tmp_path, 7168, variant, "bf16", "--prefetch")
    assert "prefetch.global.L2" in before and "prefetch" not in after
    assert before.index("prefetch.global.L2") < before.index("ld.global.v4")
    weights = 1 if variant == "fma" else 4
    assert len(re.findall(r"ld\.global\.v4", before)) == 2 * MIX + weights


def test_a_cluster_whose_threads_cannot_hold_fn_is_refused() -> None:
    with pytest.raises(ValueError, match="at most|<= 256"):
        OneClusterV4(7168, 8, 4)  # 4 x 112 vectors: 448 threads of 255 registers
    with pytest.raises(ValueError, match="whole vectors"):
        OneClusterV4(7168, 3, 4)
    with pytest.raises(ValueError, match="none apart from the collapse"):
        OneClusterV4(4096, 32, 4)  # 2 warps: no warp for post and pre beside the collapse and Sinkhorn


def test_the_exact_form_takes_whole_slices_of_the_coefficients_split() -> None:
    """Its CTAs' columns are whole slices of the coefficients kernel's split along K (so each chunk's partial is that
    kernel's), 8 chunks a warp, and up to 8 rows a cluster (one owner CTA a row)."""
    for H, slices_per_stream in ((4096, 4), (7168, 2)):
        k = OneClusterV4Exact(H, CLUSTERS[H], 4)
        assert (k.spc, k.cpw, k.slices, k.max_share) == (slices_per_stream, 8, 128, 8)
    with pytest.raises(ValueError, match="whole"):
        OneClusterV4Exact(7168, 14, 4)  # 512 columns a CTA: not whole 224-column slices


def test_the_step_experiments_one_launch_sublayer_hands_the_kernel_its_arguments_in_order() -> None:
    """bench/experiments/v4_one_cluster_step.py's OneLaunchV4 with a stand-in for the kernel that computes the
    reference V4 boundary from its arguments as the kernel reads them (CPU): in the toy V4 step on ready partials every
    sublayer call's outputs are the shipped V4Boundaries step's, word for word (the eps values all distinct but the
    layer's one hc_eps for pre and Sinkhorn), and every sublayer call but the Engram seam's is a launch."""
    import torch

    from bench.critical_path import v4_step_call
    from bench.experiments.v4_one_cluster_step import OneLaunchV4, Recorded, ready_model, words_differ
    from bench.step import boundaries_only
    from boundary import BoundaryAllReduce, V4Boundaries, reference
    from boundary.params import MHCParams
    from boundary.toy import ToyConfig, ToyModel

    def kernel(mR, mX, mPost, mComb, mFn, mParam, mW, mNewR, mOut, mPostOut, mCombOut, mPreOut, mQ, mScale, *eps):
        rms_eps, pre_eps, sinkhorn_eps, post_mult, norm_eps = eps
        p = MHCParams(mFn, mParam[:3], mParam[3:], rms_eps, pre_eps, sinkhorn_eps, post_mult, 20)
        out = reference.v4_boundary(mX, mR, mPost, mComb, p, mW, norm_eps)
        for dst, src in zip((mNewR, mPostOut, mCombOut, mPreOut, mOut), out, strict=True):
            dst.copy_(src)
        if mQ is not None:
            data, scale = reference.mxfp8_quantize(out[4])
            mQ.copy_(data)
            mScale.copy_(scale)

    rows, hidden = 3, 256
    toy = ToyModel(ToyConfig(hidden_size=hidden, num_layers=4, vocab=16, rms_norm_eps=1e-4, hc_eps=1e-3))
    for i, layer in enumerate(toy.layers):
        layer.attn_norm.variance_epsilon, layer.ffn_norm.variance_epsilon = 0.5 + i, 0.25 + i
    model = ready_model(boundaries_only(toy, rows), rows)
    shipped = V4Boundaries(BoundaryAllReduce(hidden, max_rows=rows, device=torch.device("cpu")))
    one = OneLaunchV4(shipped, {None: kernel, "mxfp8": kernel})
    recorded = [Recorded(shipped), Recorded(one)]
    for b in recorded:
        v4_step_call(model, b, rows)()
    assert one.calls == 6  # layer 0's FFN entry, layer 1's FFN (its attention entry is the Engram seam), 2 x 2
    assert [len(o) for o in recorded[1].outputs] == [5] * 5 + [7]  # the last layer's FFN input in MXFP8 too
    assert words_differ(*recorded) == 0
    # The comparison sees a one-word difference, and a step with other calls.
    recorded[1].outputs[2] = recorded[1].outputs[2][:4] + (recorded[1].outputs[2][4].clone(),)
    recorded[1].outputs[2][4].view(-1)[7] += 1
    assert words_differ(*recorded) == 1
    with pytest.raises(ValueError, match="different sublayer calls"):
        words_differ(recorded[0], Recorded(one))
