"""The PTX gate's job list (bench.experiments.ptx_snapshot): every shipped kernel once, DeepSeek-V4's included, each
quantized form under a name of its own; names of the older jobs unchanged so that older snapshots still compare."""

from __future__ import annotations

from bench.experiments import ptx_snapshot


def test_the_gate_lists_deepseek_v4s_kernels_once_each_with_their_quantized_forms() -> None:
    entries = ptx_snapshot.enumerate_jobs(["sm_90a"], [4096], 512, [1])
    names = [e["name"] for e in entries]
    assert len(names) == len(set(names))
    own = [n for n in names if "_li-own" in n]
    for form in ("", "_q-mxfp8", "_q-fp8-1x128", "_q-fp8-1x128-ue8m0"):
        assert any(n.startswith(f"coefficients_H4096_standard_li-own{form}_rep-20_") for n in own), form
    assert any("_li-own_rep-1_" in n for n in own)  # hc_head's mixes (one Sinkhorn pass)
    assert {f"layer-input_H4096_standard_li-carried_q-{q}_w-8_nr-0" for q in ("mxfp8", "fp8-1x128")} <= set(names)
    # a job of the older lists keeps the name older snapshots gave it
    assert "layer-input_H4096_standard_li-carried_w-8_nr-0" in names


def test_only_snapshots_the_named_jobs(tmp_path, monkeypatch) -> None:
    ran: list[str] = []

    class Pool:
        def __init__(self, *args, **kwargs) -> None: ...
        def __enter__(self):
            return self

        def __exit__(self, *exc) -> None: ...
        def imap_unordered(self, fn, tasks, chunksize=1):
            for task in tasks:
                ran.append(task[3])
                yield {"task": task, "error": "not compiled in this test"}

    monkeypatch.setattr(ptx_snapshot.multiprocessing, "get_context", lambda *_: type("Ctx", (), {"Pool": Pool})())
    failed = ptx_snapshot.snapshot(tmp_path, ["sm_90a"], [4096], 512, 1, "forward", False, [1], ["li-own_q-mxfp8"])
    assert ran and all("li-own_q-mxfp8" in name for name in ran) and failed == len(ran)
