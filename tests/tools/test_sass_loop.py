"""scripts/sass_loop.py's walk of a loop's common path, on hand-made nvdisasm output (no GPU, no nvdisasm)."""
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("sass_loop", ROOT / "scripts" / "sass_loop.py")
sass_loop = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sass_loop)


def sass(lines):
    out, addr = [], 0
    for line in lines:
        if line.endswith(":"):
            out.append(line)
        else:
            out.append(f"        /*{addr:04x}*/                   {line} ;")
            addr += 16
    return "\n".join(out)


PROGRAM = [
    "MOV R1, R2",  # prologue
    ".L_x_1:",
    "BAR.SYNC.DEFER_BLOCKING 0x0",
    "@P0 BRA `(.L_x_2)",  # the slow copy (a sequence's last tile): not taken on the common path
    "IMAD R3, R4, R5, RZ",
    "LDGSTS.E.BYPASS.128 [R6], desc[UR4][R8.64], !P1",
    "BRA `(.L_x_3)",  # jumps over the slow copy
    ".L_x_2:",
    "SEL R3, R4, R5, P2",
    "LDGSTS.E.BYPASS.128 [R6], desc[UR4][R8.64], P2",
    ".L_x_3:",
    "HMMA.16816.F32 R10, R12, R14, RZ",
    "@!P3 BRA `(.L_x_4)",  # skips the mask: taken
    "FSEL R10, R10, -INF , !P4",
    ".L_x_4:",
    "FMNMX R20, R10, R11, !PT",
    "IADD3 R1, R1, 0x1, RZ",
    "@P5 BRA `(.L_x_1)",  # the back branch
    "EXIT",
]


def test_common_path_skips_slow_copy_and_mask():
    s = sass_loop.summarise(sass(PROGRAM))
    # BAR, BRA, IMAD, LDGSTS, BRA, HMMA, BRA, FMNMX, IADD3, BRA
    assert s["path"] == 10 and s["loop"] == 13
    assert s["counts"]["BRA"] == 4 and "SEL" not in s["counts"] and "FSEL" not in s["counts"]
    assert s["other"] == 6  # IMAD, IADD3 and the four branches


def test_no_loop_is_an_error():
    with pytest.raises(ValueError, match="no loop"):
        sass_loop.summarise(sass(["MOV R1, R2", "EXIT"]))


def test_hmma_chained_counts_back_to_back_accumulators():
    texts = ["HMMA.1688.F32.TF32 R72, R96.reuse, R60, R72",   # first: nothing before it
             "HMMA.1688.F32.TF32 R72, R96, R58, R72",          # chained
             "HMMA.1688.F32.TF32 R64, R80, R58.reuse, R64",    # another accumulator
             "HMMA.1688.F32.TF32 R72, R84, R56, R72",          # R72, but R64 was written last
             "HMMA.1688.F32.TF32 R56, R52, R114, RZ",          # fresh accumulator
             "@P0 HMMA.16816.F32 R56, R12.reuse, R14, R56"]    # chained, predicated
    assert sass_loop.hmma_chained(texts) == 2
    assert sass_loop.summarise(sass(PROGRAM))["chained"] == 0
