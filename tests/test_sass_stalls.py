"""profiles/sass_stalls.py: the per-SASS stall table summed by stall reason and by opcode."""

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("sass_stalls", ROOT / "profiles" / "sass_stalls.py")
sass_stalls = importlib.util.module_from_spec(spec)
sys.modules["sass_stalls"] = sass_stalls  # its dataclass looks its module up
spec.loader.exec_module(sass_stalls)

CSV = """"Kernel Name","kernel_a",
"Address","Source","# Samples","Instructions Executed","stall_mio","stall_math","stall_mio (Not Issued)"
"0x0","      LDS.128 R4, [R2]","5","64","4","1","4"
"0x10","  @!P0 HMMA.16816.F32.BF16 R8, R4, R12, RZ ;","7","32","0","7","0"
"0x20","      LDS R5, [R3]","2","16","2","0","2"
"Kernel Name","kernel_b",
"Address","Source","# Samples","Instructions Executed","stall_mio","stall_math","stall_mio (Not Issued)"
"0x0","      FADD R1, R2, R3","3","8","0","3","0"
"""


def test_opcode_drops_predicate_and_modifiers() -> None:
    assert sass_stalls.opcode("@!P0 LDS.128 R4, [R2]") == "LDS"
    assert sass_stalls.opcode("HMMA.16816.F32.BF16 R8, R4, R12, RZ ;") == "HMMA"
    assert sass_stalls.opcode("") == "?"


def test_counts_are_summed_per_kernel_by_reason_and_opcode(tmp_path: Path) -> None:
    path = tmp_path / "k-sass.csv"
    path.write_text(CSV)
    a, b = sass_stalls.summarize(path)
    assert (a.kernel, a.samples, a.executed) == ("kernel_a", 14, 112)
    # Not-issued columns are a subset of the samples: they are not counted twice.
    assert dict(a.by_reason) == {"stall_mio": 6, "stall_math": 8}
    assert dict(a.samples_by_op) == {"LDS": 7, "HMMA": 7}
    assert dict(a.executed_by_op) == {"LDS": 80, "HMMA": 32}
    assert a.reasons_by_op["LDS"]["stall_mio"] == 6
    assert (b.kernel, b.samples, dict(b.by_reason)) == ("kernel_b", 3, {"stall_mio": 0, "stall_math": 3})
    text = sass_stalls.report(a)
    assert "mio" in text and "HMMA" in text and "14 warp-stall samples" in text
