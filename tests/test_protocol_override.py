"""The peer protocol is chosen in one place (cute_kernels/boundary/api.py) and forced only through the public
`BoundaryAllReduce.protocol`: what warmup compiles and loads follows the same choice."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from boundary import BoundaryAllReduce
from cute_kernels.allreduce.tuning import protocol_for, protocols_up_to
from cute_kernels.boundary import api

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("bad", ["threeshot", "ONESHOT", 1, True])
def test_a_bad_protocol_is_a_value_error_naming_it(bad: object) -> None:
    with pytest.raises(ValueError, match=r"protocol must be None .* or one of \('oneshot', 'twoshot'\), got"):
        BoundaryAllReduce(512, device="cpu", protocol=bad)
    ar = BoundaryAllReduce(512, device="cpu")
    with pytest.raises(ValueError, match="protocol must be"):
        ar.protocol = bad
    assert ar.protocol is None


def test_the_protocol_is_public_and_settable() -> None:
    ar = BoundaryAllReduce(512, device="cpu", protocol="twoshot")
    assert ar.protocol == "twoshot"
    ar.protocol = "oneshot"
    assert ar.protocol == "oneshot"
    ar.protocol = None
    assert ar.protocol is None


@pytest.mark.parametrize(("world", "hidden"), [(2, 4096), (4, 4096), (4, 7168), (8, 5120)])
def test_one_policy_picks_a_calls_protocol_and_what_warmup_loads(world: int, hidden: int) -> None:
    for rows in (1, 4, 16, 17, 64, 65, 512):
        assert api.call_protocol(world, hidden, rows, None) == protocol_for(world, hidden, rows)
        for forced in ("oneshot", "twoshot"):
            assert api.call_protocol(world, hidden, rows, forced) == forced
    assert api.warmup_protocols(world, hidden, 512, None) == protocols_up_to(world, hidden, 512)
    assert api.warmup_protocols(world, hidden, 512, "twoshot") == ("twoshot",)
    jobs = api.warmup_jobs(hidden, arch="sm_90a", world_size=world, ranks_per_device=world, protocols=("twoshot",))
    assert jobs and all(" twoshot" in job.name and " oneshot" not in job.name for job in jobs)
    assert all(job.load is not None for job in jobs), "every warmup job loads its kernel onto the GPU"


def test_nothing_patches_the_protocol_switch() -> None:
    """Tests and benchmarks force a protocol through the public attribute, never by replacing the switch."""
    patched = re.compile(r"\.(protocol_for|protocols_up_to|oneshot_max_rows)\s*=")
    offenders = [
        str(p.relative_to(ROOT))
        for top in ("tests", "bench", "boundary")
        for p in (ROOT / top).rglob("*.py")
        if patched.search(p.read_text())
    ]
    assert not offenders, f"these files patch the protocol switch: {offenders}"
